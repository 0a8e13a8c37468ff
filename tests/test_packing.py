"""Padding-free packing (TRL's `padding_free=True`, transformers' `DataCollatorWithFlattening`): several documents in
one row, `position_ids` restarting at 0 for each, no attention mask. transformers 5.25's eager and SDPA let a document
attend to the ones before it (where the model builds a cache, as it does by default); attached models keep them
apart, so attention, logits and every term equal the documents run separately, or the forward is refused.
"""

from __future__ import annotations

import pytest
import torch

import attnreg
from attnreg import methods
from attnreg.eager import Packing, find_packing
from attnreg.keywords import PACKING_KWARG
from attnreg.tiny import tiny_model

LENGTHS = (5, 3, 4)  # three documents packed in one row of 12 tokens


def _documents(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=generator) for length in LENGTHS]


def _packed(documents: list[torch.Tensor]) -> dict:
    """One row, positions restarting at each document, no attention mask (DataCollatorWithFlattening's batch)."""
    return {
        "input_ids": torch.cat(documents)[None],
        "position_ids": torch.cat([torch.arange(len(document)) for document in documents])[None],
    }


def _padded(documents: list[torch.Tensor]) -> dict:
    """The same documents as a right-padded batch, one per row (what runs them separately)."""
    longest = max(len(document) for document in documents)
    ids = torch.zeros(len(documents), longest, dtype=torch.long)
    mask = torch.zeros(len(documents), longest, dtype=torch.long)
    for row, document in enumerate(documents):
        ids[row, : len(document)], mask[row, : len(document)] = document, 1
    return {"input_ids": ids, "attention_mask": mask}


def _parents(documents: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    """A one-hot prior per document: each token's parent an earlier token of its document, the first left out."""
    generator = torch.Generator().manual_seed(seed)
    priors = []
    for document in documents:
        parents = torch.tensor(
            [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, len(document))]
        )
        priors.append(parents)
    return priors


def _pieces(packed: torch.Tensor) -> list[torch.Tensor]:
    """The packed row's `[..., T, ...]` split by document, along the token axis after the batch and head axes."""
    return list(packed.split(LENGTHS, dim=-2))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_packed_row_equals_documents_run_separately(family: str) -> None:
    documents = _documents()
    model = tiny_model(family, head="causal_lm").eval()
    with torch.no_grad():
        plain = model(**_packed(documents)).logits  # transformers alone, before attaching
    hub = attnreg.attach(model)
    with torch.no_grad(), hub.capture() as packed_probs:
        packed = model(**_packed(documents)).logits[0]
    with torch.no_grad(), hub.capture() as separate_probs:
        separate = model(**_padded(documents)).logits
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert (plain[0] - packed).abs().max() > 1e-3, "transformers alone kept the documents apart: the test shows nothing"
    for row, (start, length) in enumerate(zip(starts, LENGTHS, strict=True)):
        torch.testing.assert_close(packed[start : start + length], separate[row, :length], atol=1e-5, rtol=1e-5)
        for layer in range(hub.num_layers):
            probs = packed_probs[layer][0, :, start : start + length]  # [H, length, T]
            torch.testing.assert_close(
                probs[..., start : start + length], separate_probs[layer][row, :, :length, :length], atol=1e-6, rtol=0
            )
            inside = torch.zeros(probs.shape[-1], dtype=torch.bool)
            inside[start : start + length] = True
            assert probs[..., ~inside].abs().max() == 0  # no mass on the other documents
    attnreg.detach(model)


def _terms(model, batch: dict, priors: torch.Tensor, blockwise: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Entropy and syntax-prior terms of `batch` and their gradients in the model's parameters."""
    entropy = methods.EntropyRegularizer(mode="min", weight=1.0, blockwise=blockwise)
    prior = methods.SyntaxPriorKL(weight=1.0, heads={0: [1], 1: [0, 3]}, blockwise=blockwise)
    values, grads = [], []
    for method, extra in ((entropy, {}), (prior, {"attnreg_prior": priors})):
        method.bind(model)
        method.start(10)
        model.zero_grad()
        with attnreg.attach(model).capture(method.layers, inputs=method.inputs) as record:
            model(**batch)
        value, _ = method.term(record, {**batch, **extra}, step=0)
        value.backward()
        values.append(float(value.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    return values, grads


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("blockwise", [True, False])
def test_entropy_and_syntax_prior_terms_equal_documents_run_separately(family: str, blockwise: bool) -> None:
    documents, model = _documents(), tiny_model(family, head="causal_lm").train()
    model.config.attention_dropout = 0.0
    parents = _parents(documents)
    offsets = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    packed_prior = torch.cat([torch.where(p >= 0, p + o, p) for p, o in zip(parents, offsets, strict=True)])[None]
    padded_prior = torch.full((len(documents), max(LENGTHS)), -1)
    for row, p in enumerate(parents):
        padded_prior[row, : len(p)] = p
    packed_values, packed_grads = _terms(model, _packed(documents), packed_prior, blockwise)
    separate_values, separate_grads = _terms(model, _padded(documents), padded_prior, blockwise)
    assert packed_values == pytest.approx(separate_values, rel=1e-5, abs=1e-6)
    for packed, separate in zip(packed_grads, separate_grads, strict=True):
        torch.testing.assert_close(packed, separate, atol=1e-6, rtol=1e-4)


def test_bidirectional_encoder_keeps_documents_apart() -> None:
    documents, model = _documents(), tiny_model("bert").eval()
    hub = attnreg.attach(model)
    with torch.no_grad(), hub.capture(layers=[1]) as probs:
        packed = model(**_packed(documents)).last_hidden_state[0]
    start = 0
    for document, length in zip(documents, LENGTHS, strict=True):
        with torch.no_grad():
            alone = model(input_ids=document[None]).last_hidden_state[0]
        torch.testing.assert_close(packed[start : start + length], alone, atol=1e-5, rtol=1e-5)
        block = probs[1][0, :, start : start + length]
        assert torch.allclose(block[..., start : start + length].sum(-1), torch.ones(()), atol=1e-6)
        start += length


def test_gradient_checkpointing_recomputes_with_the_documents_apart() -> None:
    documents = _documents()
    losses = []
    for checkpointing in (False, True):
        model = tiny_model("llama", head="causal_lm").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        attnreg.attach(model)
        batch = _packed(documents)
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        losses.append((float(loss), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    torch.testing.assert_close(losses[0][1], losses[1][1], atol=1e-6, rtol=1e-5)


def test_padding_and_plain_positions_are_no_packing() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    positions = mask.cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)  # as generate fills them
    assert find_packing(positions, mask) is None  # right and left padding
    assert find_packing(torch.arange(5)[None] + 7) is None  # positions after a cache
    assert find_packing(torch.tensor([[0, 1, 0, 1]]), torch.ones(1, 1, 4, 4)) is None  # a 4-D mask decides itself
    assert find_packing(torch.tensor([[0, 1, 0, 1]]), torch.ones(1, 4)).segments.tolist() == [[0, 0, 1, 1]]
    model = tiny_model("llama", head="causal_lm").eval()
    ids = torch.randint(3, 90, (2, 5))
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        attnreg.attach(model)
        attached = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(attached[real], plain[real], atol=1e-6, rtol=1e-6)


def test_nothing_is_read_without_position_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", head="causal_lm").eval()
    attnreg.attach(model)

    def never(*args, **kwargs):
        raise AssertionError("find_packing ran for a forward without position_ids")

    monkeypatch.setattr(attnreg.hub, "find_packing", never)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 90, (2, 6)))


def test_positional_position_ids_are_read() -> None:
    documents, model = _documents(), tiny_model("llama", head="causal_lm").eval()
    hub = attnreg.attach(model)
    batch = _packed(documents)
    with torch.no_grad(), hub.capture(layers=[0]) as probs:
        model(batch["input_ids"], None, batch["position_ids"])
    assert probs[0][0, :, LENGTHS[0], : LENGTHS[0]].abs().max() == 0


def test_a_layer_the_packing_never_reaches_is_refused() -> None:
    documents, model = _documents(), tiny_model("llama", head="causal_lm").train()
    hub = attnreg.attach(model)

    def drop(module, args, kwargs):  # a family whose layers drop the forward's keyword arguments
        kwargs.pop(PACKING_KWARG, None)
        return args, kwargs

    hub.attention(1).register_forward_pre_hook(drop, with_kwargs=True)
    with pytest.raises(NotImplementedError) as error:
        model(**_packed(documents))
    message = str(error.value)
    for part in (
        "row 0, position 5",
        "layers [1]",
        "'attnreg'",
        "'sdpa'",
        "padding_free=False",
        "DataCollatorWithPadding",
        "flash-attention",
    ):
        assert part in message, part


def test_packed_positions_after_a_cache_are_refused() -> None:
    model = tiny_model("llama", head="causal_lm").eval()
    attnreg.attach(model)
    with torch.no_grad():
        cache = model(input_ids=torch.randint(3, 90, (1, 4)), use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match=r"row 0, position 2 .* 4 queries and 8 keys"):
            model(input_ids=torch.randint(3, 90, (1, 4)), position_ids=torch.tensor([[4, 5, 0, 1]]), cache=cache)


def test_packing_mask_keeps_the_layer_mask() -> None:
    packing = Packing(torch.tensor([[0, 0, 0, 1, 1]]))
    window = torch.ones(5, 5, dtype=torch.bool).tril().triu(-1)[None, None]  # a sliding window of 2 keys
    merged = packing.mask(window, 5, 5, causal=True, device=None)
    assert merged[0, 0].sum(-1).tolist() == [1, 2, 2, 1, 2]
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~window, torch.finfo(torch.float32).min)
    assert torch.equal(packing.mask(additive, 5, 5, True, None) == 0, merged)


def test_trl_padding_free_batches_reach_every_layer_packed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    from attnreg.app.task import build_tokenizer, generate, vocabulary
    from attnreg.eager import Packing
    from attnreg.integrations.hf import with_attnreg

    documents: list[int] = []
    original = Packing.mask

    def counted(self, *args, **kwargs):
        documents.append(int(self.segments.max()) + 1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Packing, "mask", counted)
    tokens = build_tokenizer(vocabulary())
    args = trl.SFTConfig(
        str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=3,
        padding_free=True,
        max_length=None,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    texts = [{"input_ids": tokens(example.sentence.text)["input_ids"]} for example in generate(6, seed=1)]
    trainer = with_attnreg(trl.SFTTrainer)(
        model=tiny_model("llama", head="causal_lm", vocab=len(tokens)).train(),
        args=args,
        train_dataset=datasets.Dataset.from_list(texts),
        processing_class=tokens,
        methods=[methods.EntropyRegularizer(weight=1.0, mode="max")],
    )
    trainer.train()
    assert documents and min(documents) >= 3  # every layer of every step saw the 3 documents of its row apart
