"""A term's weight under gradient accumulation, NaN through the blockwise losses, and Hugging Face `Trainer`
checkpoints around a head removal: each against an independent reference (the same examples in one batch,
the materialized path, the uninterrupted run)."""

import math
import warnings

import lightning as L
import pytest
import torch
from conftest import Classifier, sgd_arguments
from torch.utils.data import DataLoader
from transformers import TrainingArguments

import attnreg
from attnreg import blockwise, losses, methods
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.methods.pruning import load_pruned, pruned_heads, silenced_heads
from attnreg.methods.runner import UnevenMicroBatchesWarning
from attnreg.tiny import tiny_model


def examples(count: int, length: int = 8, vocab: int = 99) -> list[dict[str, torch.Tensor]]:
    """Causal-LM examples of one length (no padding): a mean over 8 equals the mean of two means over 4."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (count, length), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(length, dtype=torch.long), "labels": row} for row in ids]


def hf_arguments(tmp_path, **options) -> TrainingArguments:
    return sgd_arguments(tmp_path, **({"dataloader_drop_last": True} | options))


def term_methods():
    flatten = methods.EntropyRegularizer(weight=100.0, mode="max")
    return [flatten, methods.EntropyRegularizer(weight=50.0, mode="min", layers=[1])]


def hf_weights(tmp_path, family, batch, accumulation, with_terms=True) -> dict[str, torch.Tensor]:
    trainer = AttnRegTrainer(
        model=tiny_model(family, head="causal_lm").train(),
        args=hf_arguments(
            tmp_path, max_steps=1, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation
        ),
        train_dataset=examples(8),
        methods=term_methods() if with_terms else [],
    )
    trainer.train()
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_term_weight_does_not_depend_on_accumulation(tmp_path, family):
    """2 x 4 accumulated equals 1 x 8 on the same examples: the terms' gradients are not doubled."""
    accumulated = hf_weights(tmp_path / "a", family, batch=4, accumulation=2)
    whole = hf_weights(tmp_path / "b", family, batch=8, accumulation=1)
    plain = hf_weights(tmp_path / "c", family, batch=8, accumulation=1, with_terms=False)
    moved = max(float((whole[name] - plain[name]).abs().max()) for name in whole)
    assert moved > 1e-3  # the terms move the weights, so a doubled term would show
    for name, value in whole.items():
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_lightning_term_weight_does_not_depend_on_accumulation():
    data = examples(8)

    def run(batch, accumulation):
        torch.manual_seed(0)
        module = Classifier(tiny_model("llama", head="causal_lm"), lr=0.5)
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.5)
        trainer = L.Trainer(
            max_steps=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accumulate_grad_batches=accumulation,
            callbacks=[attnreg.EntropyRegularizer(weight=100.0, mode="max")],
        )
        trainer.fit(module, DataLoader(data, batch_size=batch))
        return module.model.state_dict()

    accumulated, whole = run(4, 2), run(8, 1)
    for name, value in whole.items():
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- NaN and inf reach the loss on both paths ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_in_the_inputs_gives_a_nan_loss_on_both_paths(dtype, bad, causal):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 6, 8, generator=generator)
    key = torch.randn(2, 2, 6, 8, generator=generator)
    key[0, 1, 2, 3] = bad  # one token's key of one key/value head
    query, key = query.to(dtype), key.to(dtype)
    mask = torch.ones(2, 6, dtype=torch.long)
    inputs = attnreg.records.LayerInputs(query, key, None, 8**-0.5, causal)
    probs = attnreg.eager.attention_probabilities(query, key, None, 8**-0.5, causal=causal)
    parents = torch.tensor([[1, 0, 1, 1, 3, 3], [-1, 0, 0, 2, 2, 4]])
    if causal:
        parents = torch.tensor([[-1, 0, 1, 1, 3, 3], [-1, 0, 0, 2, 2, 4]])
    for normalize in (False, True):
        materialized = losses.attention_entropy(probs, mask, causal=causal, normalize=normalize)
        blocked = blockwise.attention_entropy(inputs, mask, causal=causal, normalize=normalize, block_size=4)
        assert not torch.isfinite(materialized).all(), (normalize, materialized)
        assert not torch.isfinite(blocked).all(), (normalize, blocked)
        bad_heads = ~torch.isfinite(materialized)
        assert torch.equal(bad_heads, ~torch.isfinite(blocked))
    kl = blockwise.prior_kl(inputs, parents, heads=[2, 3], causal=causal, check_values=False)
    assert not torch.isfinite(kl).all()
    assert torch.isfinite(blockwise.prior_kl(inputs, parents, heads=[0, 1], causal=causal)).all()


# -- Hugging Face Trainer checkpoints around a head removal -------------------------------------------------------
class Stream(torch.utils.data.IterableDataset):
    """Fixed causal-LM examples in a fixed order (no sampler), so a resumed run sees what the uninterrupted one saw."""

    def __init__(self, count: int):
        self.items = examples(count)

    def __iter__(self):
        return iter(self.items)


def gating_trainer(tmp_path, family, removal, **options) -> AttnRegTrainer:
    torch.manual_seed(0)
    return AttnRegTrainer(
        model=tiny_model(family, head="causal_lm").train(),
        args=hf_arguments(
            tmp_path, **(dict(max_steps=6, learning_rate=0.05, save_strategy="steps", save_steps=2) | options)
        ),
        train_dataset=Stream(24),
        methods=[
            methods.EntropyRegularizer(weight=1.0, mode="max"),
            methods.HeadGating(methods.L1Gates(weight=0.5), removal),
        ],
    )


def state(trainer) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def assert_same_weights(resumed: dict, uninterrupted: dict) -> None:
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


def touched(model) -> dict[int, tuple[int, ...]]:
    """Heads removed or, under the grouped-query rule, silenced."""
    found = {layer: set(heads) for layer, heads in pruned_heads(model).items()}
    for layer, heads in silenced_heads(model).items():
        found.setdefault(layer, set()).update(heads)
    return {layer: tuple(sorted(heads)) for layer, heads in sorted(found.items()) if heads}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_before_the_removal_resumes_the_uninterrupted_run(tmp_path, family):
    """The checkpoint keeps the gates unfolded: resuming from step 2 ends where the uninterrupted run ends,
    on every weight (fp32), and a gate of the checkpoint reads back as it was saved."""
    removal = methods.Removal(keep=5)  # at the end of training
    whole = gating_trainer(tmp_path / "whole", family, removal)
    whole.train()
    saved = attnreg.attach(load_pruned(tmp_path / "whole" / "checkpoint-2"))
    assert saved.gate(0).shape == (4,) and not torch.equal(saved.gate(0), torch.ones(4))  # trained, unfolded
    resumed = gating_trainer(tmp_path / "resumed", family, removal)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert touched(resumed.model) == touched(whole.model) and sum(map(len, touched(whole.model).values())) == 3
    assert_same_weights(state(resumed), state(whole))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_after_a_removal_resumes_and_loads(tmp_path, family):
    """Heads removed at step 3: checkpoint-4 has the pruned shapes; a fresh model resumes from it to the
    uninterrupted run's weights, and `load_pruned` reads it to the model the run had at that step."""
    removal = methods.Removal(keep=5, after_steps=3)
    whole = gating_trainer(tmp_path / "whole", family, removal)
    whole.train()
    removed = touched(whole.model)
    assert sum(map(len, removed.values())) == 3
    resumed = gating_trainer(tmp_path / "resumed", family, removal)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-4"))
    assert touched(resumed.model) == removed
    assert_same_weights(state(resumed), state(whole))
    last = load_pruned(tmp_path / "whole" / "checkpoint-6")
    ids = torch.stack([example["input_ids"] for example in examples(3)])
    with torch.no_grad():
        torch.testing.assert_close(last(ids).logits, whole.model.eval()(ids).logits, rtol=0, atol=1e-6)


# -- a removal that cannot be done is found at bind; one that fails at the end loses nothing -------------------
class Wrapped(torch.nn.Module):
    """A projection wrapped with a trainable side path, as PEFT's LoRA layers wrap theirs."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.side = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.side(x)


def test_a_removal_that_cannot_be_done_is_refused_at_bind():
    model = tiny_model("llama", head="causal_lm")
    model.model.layers[1].self_attn.o_proj = Wrapped(model.model.layers[1].self_attn.o_proj)
    gating = methods.HeadGating(methods.L1Gates(), methods.Removal(keep=4))
    with pytest.raises(
        TypeError, match=r"HeadGating: heads of layer 1 .*model\.layers\.1\.self_attn\.o_proj: .*Wrapped wraps"
    ):
        gating.bind(model, taken=set())
    assert not attnreg.attach(model).gates  # refused before any gate was made


def test_a_removal_failing_at_the_end_leaves_the_trained_model_gated_and_saved(tmp_path, monkeypatch):
    trainer = gating_trainer(tmp_path, "gpt2", methods.Removal(keep=5), save_strategy="no")

    def fails(*args, **kwargs):
        raise RuntimeError("slicing went wrong")

    monkeypatch.setattr(attnreg.methods.pruning, "prune_heads", fails)  # a failure inside the removal, after training
    with pytest.raises(RuntimeError, match=r"failed \(RuntimeError: slicing went wrong\); nothing was folded") as error:
        trainer.train()
    rescue = tmp_path / "attnreg-unpruned"
    assert str(rescue) in str(error.value)
    hub = attnreg.attach(trainer.model)
    assert sorted(hub.gates) == [0, 1] and not torch.equal(hub.gate(0).detach(), torch.ones(4))  # trained, not folded
    ids = torch.stack([example["input_ids"] for example in examples(3)])
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(rescue)(ids).logits, trainer.model.eval()(ids).logits, rtol=0, atol=0)


# -- rows of different lengths: a term's weight would depend on the split, which is said -------------------------
def uneven(count: int = 8) -> list[dict[str, torch.Tensor]]:
    """Short rows first, long rows last: under 2 x 4 the two micro-batches hold different numbers of tokens."""
    rows = examples(count)
    for index, row in enumerate(rows[: count // 2]):
        row["attention_mask"] = row["attention_mask"].clone()
        row["attention_mask"][2 + index % 2 :] = 0
        row["labels"] = row["labels"].masked_fill(row["attention_mask"] == 0, -100)
    return rows


class Fixed(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def split_run(tmp_path, chosen, batch, accumulation, rows=uneven) -> dict[str, torch.Tensor]:
    trainer = AttnRegTrainer(
        model=tiny_model("llama", head="causal_lm").train(),
        args=hf_arguments(
            tmp_path, max_steps=1, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation
        ),
        train_dataset=Fixed(rows(8)),
        methods=chosen(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, UnevenMicroBatchesWarning)]
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def teacher():
    return tiny_model("llama", head="causal_lm", seed=5).eval()


@pytest.mark.parametrize(
    "chosen",
    [term_methods, lambda: [methods.Distillation(teacher(), weight=5.0)]],
    ids=["entropy", "distillation"],
)
def test_hf_term_weight_does_not_depend_on_how_rows_of_different_lengths_are_split(tmp_path, chosen):
    """Short rows in one micro-batch, long in the other: 2 x 4 ends on the weights of 1 x 8 (the global mean),
    as the model's own loss does through `num_items_in_batch`."""
    whole = split_run(tmp_path / "whole", chosen, batch=8, accumulation=1)
    split = split_run(tmp_path / "split", chosen, batch=4, accumulation=2)
    plain = split_run(tmp_path / "plain", lambda: [], batch=8, accumulation=1)
    assert max(float((whole[name] - plain[name]).abs().max()) for name in whole) > 1e-3  # the terms act
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("rows, warned", [(uneven, True), (examples, False)], ids=["uneven", "even"])
def test_hf_says_when_a_term_cannot_be_weighed_by_its_items(tmp_path, rows, warned):
    """A term that is no mean over items (entropy held in a band) keeps the per-micro-batch mean: said."""
    trainer = AttnRegTrainer(
        model=tiny_model("llama", head="causal_lm").train(),
        args=hf_arguments(tmp_path, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2),
        train_dataset=Fixed(rows(8)),
        methods=[methods.EntropyRegularizer(weight=1.0, mode="target", target=(0.2, 0.3))],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [w for w in caught if issubclass(w.category, UnevenMicroBatchesWarning)]
    assert bool(said) == warned
    if warned:
        assert "real tokens per micro-batch [10, 32]" in str(said[0].message)


@pytest.mark.parametrize("rows, warned", [(uneven, True), (examples, False)], ids=["uneven", "even"])
def test_lightning_says_when_micro_batches_differ_in_tokens(rows, warned):
    module = Classifier(tiny_model("llama", head="causal_lm"), lr=0.5)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accumulate_grad_batches=2, callbacks=[attnreg.EntropyRegularizer(weight=1.0)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(rows(8), batch_size=4))
    assert any(issubclass(w.category, UnevenMicroBatchesWarning) for w in caught) == warned
