"""The blockwise losses equal the materialized path (probabilities, then attnreg.losses) in value and
gradient, for every kind of mask, grouped-query keys, chosen heads, temperature and sink logits (gpt-oss), block
sizes that do not divide the length, cached keys before the queries, and keep nothing of size [T, S] for backward."""

import copy

import pytest
import torch
from conftest import FAMILIES, main_output, padded_batch

import attnreg
from attnreg.blockwise import prior_cross_entropy, row_entropy
from attnreg.eager import attention_probabilities
from attnreg.losses import row_entropy as materialized_entropy
from attnreg.tiny import tiny_model

B, H, KV, T, D = 2, 4, 2, 37, 8


def inputs(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, T, D, generator=generator, dtype=dtype).requires_grad_()
    key = torch.randn(B, KV, T, D, generator=generator, dtype=dtype).requires_grad_()
    return query, key


def padding_mask(kind):
    lengths = torch.tensor([T, T - 9])
    keep = torch.arange(T)[None, :] < lengths[:, None]  # [B, S]
    if kind == "none":
        return None
    if kind == "bool":
        return keep[:, None, None, :].expand(B, 1, T, T)
    return torch.zeros(B, 1, T, T).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)


def materialized(query, key, mask, causal, heads, temperature):
    probs = attention_probabilities(query, key, mask, D**-0.5, temperature, causal)
    return probs if heads is None else probs[:, heads]


CASES = [
    ("bool", False, None, None),
    ("float", False, [0, 3], None),
    ("none", True, [1], None),
    ("bool", True, [2, 3], torch.tensor([1.0, 2.0, 0.5, 3.0])),
]


SINKS = torch.tensor([2.0, -1.0, 0.5, 3.0])  # gpt-oss's learned sink logit per head, of sizes that take a real share


@pytest.mark.parametrize(("mask_kind", "causal", "heads", "temperature"), CASES)
@pytest.mark.parametrize("block_size", [5, 128])  # 5 does not divide T = 37; 128 is one block
@pytest.mark.parametrize("sinks", [False, True])
def test_entropy_and_parent_nll_equal_the_materialized_path(mask_kind, causal, heads, temperature, block_size, sinks):
    """With sinks the reference is autograd through eager gpt-oss's math (`attention_probabilities(..., sinks=)`, the
    sink's column dropped after the softmax; entropy counting the missing mass), the sink logits' gradient too."""
    mask = padding_mask(mask_kind)
    parents = torch.randint(-1, T, (B, T), generator=torch.Generator().manual_seed(1))
    if causal:
        parents = torch.minimum(parents, torch.arange(T))  # a decoder's parent is an earlier token
    weights = torch.randn(B, H if heads is None else len(heads), T, generator=torch.Generator().manual_seed(2))

    def both(fast: bool):
        query, key = inputs()
        sink = SINKS.clone().requires_grad_() if sinks else None
        options = dict(heads=heads, temperature=temperature, causal=causal, block_size=block_size, sinks=sink)
        if fast:
            entropy = row_entropy(query, key, mask, D**-0.5, **options)
            nll = prior_cross_entropy(query, key, mask, parents, D**-0.5, **options)
        else:
            probs = attention_probabilities(query, key, mask, D**-0.5, temperature, causal, sinks=sink)
            probs = probs if heads is None else probs[:, heads]
            assert not sinks or bool((probs.sum(-1) < 0.999).all())  # the sinks take a share of every row
            entropy = materialized_entropy(probs, sink=sinks)
            index = parents.clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
            nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        ((entropy + nll) * weights).sum().backward()
        sink_grad = sink.grad if sinks else torch.zeros(())
        return entropy.detach(), nll.detach(), query.grad, key.grad, sink_grad

    fast, slow = both(True), both(False)
    if sinks:
        assert fast[-1].abs().max() > 1e-3  # the sink logits get a gradient
    for fast_tensor, slow_tensor in zip(fast, slow, strict=True):
        torch.testing.assert_close(fast_tensor, slow_tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 6, 16, 64])  # none divides the 13 queries; 4 and 6 cut the cached keys
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_causal_blocks_after_cached_keys_equal_the_materialized_path(block_size, mask_kind):
    """The last 13 of 37 positions query all 37 keys (a decoder with a cache): a causal block sees every key before
    its first row's own without a causal mask and masks only the keys at its causal edge."""
    queries = 13
    mask = padding_mask(mask_kind)
    mask = None if mask is None else mask[:, :, T - queries :]
    parents = torch.minimum(
        torch.randint(-1, T, (B, queries), generator=torch.Generator().manual_seed(4)), torch.arange(T - queries, T)
    )
    weights = torch.randn(B, H, queries, generator=torch.Generator().manual_seed(5))

    def both(fast: bool):
        query, key = inputs()
        query = query[:, :, T - queries :].detach().requires_grad_()
        if fast:
            entropy = row_entropy(query, key, mask, D**-0.5, causal=True, block_size=block_size)
            nll = prior_cross_entropy(query, key, mask, parents, D**-0.5, causal=True, block_size=block_size)
        else:
            probs = attention_probabilities(query, key, mask, D**-0.5, causal=True)
            entropy = materialized_entropy(probs)
            index = parents.clamp_min(0)[:, None, :, None].expand(-1, H, -1, 1)
            nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        ((entropy + nll) * weights).sum().backward()
        return entropy.detach(), nll.detach(), query.grad, key.grad

    for fast, slow in zip(both(True), both(False), strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mean_attention", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_priors_and_head_means_with_sinks_equal_the_materialized_path(mean_attention, causal):
    """The checkpointed path (dense prior rows, the heads' mean attention) with sink logits: `-sum_j r_j log p_j` over
    the keys, `p` including the sink in its denominator, against autograd through the materialized path."""
    prior = torch.rand(B, T, T, generator=torch.Generator().manual_seed(6))
    if causal:
        prior = prior.tril()
    prior = prior / prior.sum(-1, keepdim=True)
    mask = padding_mask("bool")

    def both(fast: bool):
        query, key = inputs()
        sink = SINKS.clone().requires_grad_()
        if fast:
            values = prior_cross_entropy(
                query, key, mask, prior, D**-0.5, [0, 2, 3], None, causal, 5, mean_attention, sinks=sink
            )
        else:
            probs = attention_probabilities(query, key, mask, D**-0.5, causal=causal, sinks=sink)[:, [0, 2, 3]]
            probs = probs.mean(1, keepdim=True) if mean_attention else probs
            values = -(prior[:, None] * probs.clamp_min(1e-12).log()).sum(-1)
        values.sum().backward()
        return values.detach(), query.grad, key.grad, sink.grad

    for fast, slow in zip(both(True), both(False), strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_stays_within_bf16_tolerance(causal):
    """bf16 queries and keys (what autocast hands the attention function): entropy and parent NLL, values
    and gradients, within bf16 tolerance of the float32 materialized path."""
    parents = torch.minimum(torch.randint(-1, T, (B, T), generator=torch.Generator().manual_seed(1)), torch.arange(T))

    def both(fast: bool):
        query, key = inputs(dtype=torch.bfloat16 if fast else torch.float32)
        mask = padding_mask("bool")
        if fast:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as under bf16-mixed training
                entropy = row_entropy(query, key, mask, D**-0.5, causal=causal)
                nll = prior_cross_entropy(query, key, mask, parents, D**-0.5, causal=causal)
        else:
            probs = attention_probabilities(query, key, mask, D**-0.5, causal=causal)
            entropy = materialized_entropy(probs)
            index = parents.clamp_min(0)[:, None, :, None].expand(-1, H, -1, 1)
            nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        (entropy + nll).sum().backward()
        return entropy.detach(), nll.detach(), query.grad.float(), key.grad.float()

    for fast, slow in zip(both(True), both(False), strict=True):
        torch.testing.assert_close(fast, slow, rtol=3e-2, atol=3e-2)


def saved_bytes(function) -> int:
    """Bytes autograd keeps for backward while `function()` builds its graph (storages counted once)."""
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(seen.values())


@pytest.mark.parametrize("length", [64, 128, 256])
def test_nothing_of_size_t_by_s_is_saved(length):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, length, 16, generator=generator).requires_grad_()
    key = torch.randn(1, 4, length, 16, generator=generator).requires_grad_()
    fast = saved_bytes(lambda: row_entropy(query, key, None, 0.25, causal=True, block_size=32))
    eager = saved_bytes(lambda: materialized_entropy(attention_probabilities(query, key, None, 0.25, causal=True)))
    inputs_size = (query.numel() + key.numel()) * 4
    row_statistics = 3 * 4 * length * 4  # three float32 numbers per row and head
    assert fast <= inputs_size + row_statistics  # no probabilities, no mask
    assert eager >= 4 * length * length * 4  # the probabilities [1, 4, T, T] in float32


# -- through real models of every family, as the adapters run the methods -------------------------------------------
def run_terms(model, batch, blockwise, gate=False, temperature=False):
    """The summed terms of Entropy (all layers) and PriorKL (index and dense priors) and the gradients."""
    from attnreg import methods

    hub = attnreg.attach(model)
    if gate:
        with torch.no_grad():
            hub.gate(0).copy_(torch.tensor([1.0, 0.5, 0.0, 2.0])[: hub.layers[0].num_heads])
    if temperature:
        hub.set_temperature(torch.linspace(0.5, 2.0, hub.layers[1].num_heads), layers=[1])
    terms = [
        methods.EntropyRegularizer(weight=1.0, mode="max", blockwise=blockwise),
        methods.SyntaxPriorKL(weight=1.0, heads=[1], blockwise=blockwise, name="index"),
        methods.SyntaxPriorKL(
            weight=1.0, layers=[1], head_reduction="mean_attention", prior_key="dense", blockwise=blockwise
        ),
    ]
    taken: set[str] = set()
    for term in terms:
        term.bind(model, taken)
        term.start(10)
        taken.add(term.name)
    model.zero_grad()
    with hub.capture(terms[0].layers, inputs=blockwise) as record:
        output = model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")})
    values = [term.term(record, batch, step=0)[0] for term in terms]
    (sum(values) + main_output(output).float().pow(2).mean()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.stack(values).detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_the_materialized_values_and_gradients(family):
    import copy

    model = tiny_model(family).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch = padded_batch()
    length = batch["input_ids"].shape[1]
    batch["attnreg_prior"] = (torch.arange(length) - 1).expand(3, length).masked_fill(batch["attention_mask"] == 0, -1)
    dense = torch.rand(3, length, length, generator=torch.Generator().manual_seed(0)) * batch["attention_mask"][:, None]
    batch["dense"] = dense / dense.sum(-1, keepdim=True)  # rows over the real keys
    twin = copy.deepcopy(model)
    fast_values, fast_grads = run_terms(model, batch, blockwise=True, gate=True, temperature=True)
    slow_values, slow_grads = run_terms(twin, batch, blockwise=False, gate=True, temperature=True)
    torch.testing.assert_close(fast_values, slow_values, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == slow_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, slow_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_terms_see_attention_before_dropout():
    from attnreg import methods

    values = []
    for rate in (0.0, 0.5):
        model = tiny_model("bert").train()
        hub = attnreg.attach(model)
        hub.set_attention_dropout(rate)
        entropy = methods.EntropyRegularizer(weight=1.0, layers=[0])
        entropy.bind(model)
        entropy.start(10)
        with hub.capture([0], inputs=True) as record:
            model(**padded_batch())
        values.append(entropy.term(record, padded_batch(), 0)[0])
    torch.testing.assert_close(values[0], values[1])  # layer 0's inputs do not depend on dropout


@pytest.mark.parametrize("block_size", [8, 10])  # a block of 10 fully masked rows summed past float32's range
@pytest.mark.parametrize("causal", [False, True])
def test_rows_whose_keys_are_all_masked_read_as_the_materialized_path(causal, block_size):
    """Padded query rows of a causal model with left-over padding see no key at all: their entropy and
    parent NLL read as uniform attention over all S keys (not only the keys a causal block computes), and
    no gradient comes from them."""
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    mask[1, :, :, :] = False  # a sequence with no real token
    parents = torch.randint(-1, T, (B, T), generator=torch.Generator().manual_seed(3))

    def both(fast: bool):
        query, key = inputs()
        if fast:
            entropy = row_entropy(query, key, mask, D**-0.5, causal=causal, block_size=block_size)
            nll = prior_cross_entropy(query, key, mask, parents, D**-0.5, causal=causal, block_size=block_size)
        else:
            probs = attention_probabilities(query, key, mask, D**-0.5, causal=causal)
            entropy = materialized_entropy(probs)
            index = parents.clamp_min(0)[:, None, :, None].expand(-1, H, -1, 1)
            nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        (entropy + nll).sum().backward()
        return entropy.detach(), nll.detach(), query.grad, key.grad

    fast, slow = both(True), both(False)
    assert all(tensor.isfinite().all() for tensor in fast)
    for fast_tensor, slow_tensor in zip(fast, slow, strict=True):
        torch.testing.assert_close(fast_tensor, slow_tensor, rtol=1e-5, atol=1e-5)


# -- torch.compile: nothing in the hub or the blockwise path breaks the graph -------------------------------------
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_the_idle_hub_gates_and_the_blockwise_entropy_trace_as_one_graph(family):
    """dynamo traces an attached model with gates, and a step that captures every layer's inputs and adds
    the blockwise entropy, without a graph break (what `torch.compile` needs to compile it whole)."""
    from attnreg import methods

    torch._dynamo.reset()
    model = tiny_model(family, head="classification")
    hub = attnreg.attach(model)
    for layer in range(hub.num_layers):
        hub.gate(layer)
    batch = padded_batch()
    idle = torch._dynamo.explain(model)(**batch)
    assert (idle.graph_count, idle.graph_break_count) == (1, 0), idle.break_reasons

    entropy = methods.EntropyRegularizer(weight=0.1, mode="max")
    entropy.bind(model)
    entropy.start(10)

    def step(batch):
        with hub.capture(entropy.layers, True, inputs=True) as record:
            logits = model(**batch).logits
        return logits.pow(2).mean() + entropy.term(record, batch, 0)[0]

    regularized = torch._dynamo.explain(step)(batch)
    assert (regularized.graph_count, regularized.graph_break_count) == (1, 0), regularized.break_reasons


# -- grouped-query attention: the query heads of a group against their one key/value head ------------------------
def step_saved_bytes(model, batch, terms) -> int:
    """Bytes autograd keeps for one train step of `model` plus `terms` (parameters and buffers excluded), as
    `benchmarks/overhead.py` counts them."""
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    hub = attnreg.attach(model) if terms else None

    def loss():
        if not terms:
            return model(**batch).loss
        with hub.capture(terms[0].layers, True, inputs=True) as record:
            value = model(**batch).loss
        return value + sum(term.term(record, batch, 0)[0] for term in terms)

    seen = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in exclude:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        value = loss()
    value.backward()
    return sum(seen.values())


def test_grouped_keys_are_never_repeated_the_entropy_keeps_what_sdpa_keeps():
    """SmolLM2's heads (9 query heads on 3 key/value heads of 64), 2 layers, 256 tokens: entropy on every head keeps
    within 1% of SDPA's step (a repeated key/value head would add 2 x 256 x 64 x 4 bytes per extra query head and
    layer, 4.8%), the KL on one head per layer within 0.2%; the values and key gradients equal the materialized
    path's, whose probabilities use the keys `repeat_kv` repeats."""
    from attnreg import methods

    sizes = dict(hidden=576, layers=2, heads=9, num_key_value_heads=3, intermediate_size=1536, vocab=1000)
    base = tiny_model("llama", head="causal_lm", positions=256, **sizes).train()
    input_ids = torch.randint(3, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "labels": input_ids, "attnreg_prior": (torch.arange(256) - 1)[None]}
    plain = {key: value for key, value in batch.items() if key != "attnreg_prior"}
    sdpa = step_saved_bytes(base, plain, [])
    for term, bound in ((methods.EntropyRegularizer(mode="max"), 1.01), (methods.SyntaxPriorKL(heads=[4]), 1.002)):
        model = copy.deepcopy(base)
        term.bind(model)
        term.start(10)
        saved = step_saved_bytes(model, batch, [term])
        assert saved <= bound * sdpa, (type(term).__name__, saved / sdpa)

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 9, 150, 16, generator=generator).requires_grad_()
    key = torch.randn(1, 3, 150, 16, generator=generator).requires_grad_()
    parents = torch.randint(-1, 150, (1, 150), generator=generator).minimum(torch.arange(150))
    for heads in (None, [4], [8, 0, 1], [2, 3, 5]):  # all, one, uneven over the groups, even but not contiguous
        fast = row_entropy(query, key, None, 0.25, heads, causal=True, block_size=64)
        fast = fast + prior_cross_entropy(query, key, None, parents, 0.25, heads, causal=True, block_size=64)
        fast_grads = torch.autograd.grad(fast.sum(), (query, key))
        probs = attention_probabilities(query, key, None, 0.25, causal=True)[:, heads if heads else slice(None)]
        index = parents.clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
        nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        slow = materialized_entropy(probs) + nll
        slow_grads = torch.autograd.grad(slow.sum(), (query, key))
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        for got, want in zip(fast_grads, slow_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [[0, 4], [-1], []])
def test_heads_outside_the_layer_are_refused_not_read_as_another_head(heads):
    query, key = inputs()
    with pytest.raises(IndexError, match=r"must name head positions 0\.\.3"):
        row_entropy(query, key, None, D**-0.5, heads)
    with pytest.raises(IndexError, match=r"must name head positions 0\.\.3"):
        prior_cross_entropy(query, key, None, torch.zeros(B, T, dtype=torch.long), D**-0.5, heads)


def test_the_kl_and_the_entropy_on_a_grouped_query_model_trace_as_one_graph_and_the_prior_is_still_checked():
    """On a grouped-query model (Llama, 4 query heads sharing 2 key/value heads, padded rows) a step with the blockwise
    KL, and one with the blockwise entropy, trace as one graph each: `check_prior` asserts the prior's values inside
    the graph instead of reading them (the `.item()` that broke it), and the window's row count is not taken under the
    compiler. Compiled (through AOT autograd), the KL step equals the eager step in value and gradient on a good
    prior and refuses a prior with a key index outside the keys, as the eager step does."""
    from attnreg import methods

    torch._dynamo.reset()
    base = tiny_model("llama", head="classification")
    assert base.config.num_key_value_heads < base.config.num_attention_heads
    batch = padded_batch()
    prior = (torch.arange(batch["input_ids"].shape[1]) - 1).expand_as(batch["input_ids"])
    batch["attnreg_prior"] = prior.masked_fill(batch["attention_mask"] == 0, -1)  # no row on a padded key

    def regularized(term):
        model = copy.deepcopy(base)
        hub = attnreg.attach(model)
        term.bind(model)
        term.start(10)

        def step(batch):
            with hub.capture(term.layers, True, inputs=True) as record:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return logits.pow(2).mean() + term.term(record, batch, 0)[0]

        return model, step

    kl_model, kl_step = regularized(methods.SyntaxPriorKL(heads={0: [1], 1: [2]}))
    for term in (methods.EntropyRegularizer(weight=0.1, mode="max"), None):
        step = kl_step if term is None else regularized(term)[1]
        explained = torch._dynamo.explain(step)(batch)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    torch._dynamo.reset()
    compiled = torch.compile(kl_step, backend="aot_eager", fullgraph=True)
    values, grads = [], []
    for run in (kl_step, compiled):
        value = run(batch)
        value.backward()
        values.append(value.detach())
        grads.append([parameter.grad.clone() for parameter in kl_model.parameters()])
        kl_model.zero_grad(set_to_none=True)
    torch.testing.assert_close(values[0], values[1])
    for eager, traced in zip(*grads, strict=True):
        torch.testing.assert_close(eager, traced)
    bad = dict(batch, attnreg_prior=batch["attnreg_prior"].clone())
    bad["attnreg_prior"][1, 4] = batch["input_ids"].shape[1]  # one past the last key
    with pytest.raises(IndexError, match=r"row \(batch 1, query 4\) has key index 9, outside 0\.\.8"):
        kl_step(bad)
    with pytest.raises(RuntimeError, match=r"prior: a key index is outside 0\.\.S-1.*under torch\.compile"):
        compiled(bad)
