"""Entropy normalisation counts the keys each layer's own mask admits: on a sliding layer (a window of 4 on 9 tokens;
ModernBERT's bidirectional window of 2 either side) a uniform head reads 1.0 on every real row, on the blockwise and
the materialized path, in a forward pass and on the decoding steps of `generate`; elsewhere both paths agree."""

import math
import warnings

import pytest
import torch
from conftest import padded_batch
from test_families import WINDOW, build

import attnreg
from attnreg import blockwise
from attnreg.families import FAMILIES
from attnreg.losses import admissible_keys, attention_entropy, row_entropy
from attnreg.methods import EntropyRegularizer
from attnreg.tiny import tiny_config

WINDOWED = [f.name for f in FAMILIES if getattr(tiny_config(f.name).get_text_config(), "sliding_window", None)]
UNIFORM = 1e6  # head 0's temperature: its logits are all but zero, so it attends uniformly to what its mask admits


def uniform_head_0(hub):
    for layer, info in enumerate(hub.layers):
        hub.set_temperature(torch.tensor([UNIFORM] + [1.0] * (info.num_heads - 1)), layers=[layer])


def row_normalized(entropy, padding, keys, causal, layer_mask, sink=False):
    """Per-row normalized entropies `[B, h, T]` and the rows that count (real, more than one outcome), and the keys
    each row admits; a sink (gpt-oss) is one more outcome."""
    shape = torch.Size((entropy.shape[0], entropy.shape[1], entropy.shape[2], keys))
    rows, counts = admissible_keys(padding, shape, causal, layer_mask)
    outcomes = counts + sink
    return entropy / outcomes.clamp_min(2).log(), (rows & (outcomes > 1)).expand_as(entropy), counts


def test_the_windowed_families_are_the_expected_ones():
    assert {"mistral", "modernbert", "gemma3_text", "qwen3", "cohere2"} <= set(WINDOWED)
    assert "llama" not in WINDOWED and "bert" not in WINDOWED


@pytest.mark.parametrize("name", WINDOWED)
def test_a_uniform_head_reads_one_on_sliding_layers(name):
    model = build(name)
    hub = attnreg.attach(model)
    uniform_head_0(hub)
    causal = hub.family.causal
    batch = padded_batch()
    padding = batch["attention_mask"]

    with torch.no_grad(), hub.capture(inputs=True) as record:
        model(**batch)
    with torch.no_grad(), hub.capture() as probs:
        model(**batch)

    narrowed = False
    for layer in range(hub.num_layers):
        inputs = record[layer]
        keys = inputs.key.shape[2]
        entropy = blockwise.row_entropy(
            inputs.query, inputs.key, inputs.attention_mask, inputs.scaling, heads=[0], sinks=inputs.sinks
        )
        sink = inputs.sinks is not None
        normalized, counted, counts = row_normalized(entropy, padding, keys, causal, inputs.attention_mask, sink)
        assert counted.any()
        torch.testing.assert_close(normalized[counted], torch.ones(int(counted.sum())), rtol=0, atol=1e-5)
        _, plain_counts = admissible_keys(padding, torch.Size((3, 1, padding.shape[1], keys)), causal)
        real = padding.bool()[:, None, :]
        narrowed |= bool((counts < plain_counts)[real].any())

        # The mean over rows, on both paths: head 0 reads 1, and every head agrees between the paths.
        fast = blockwise.attention_entropy(inputs, padding, causal, normalize=True)
        assert probs.attention_mask(layer).shape == inputs.attention_mask.shape
        layer_mask, sink = probs.attention_mask(layer), probs.has_sink(layer)
        slow = attention_entropy(probs[layer], padding, causal, normalize=True, layer_mask=layer_mask, sink=sink)
        assert abs(float(fast[0]) - 1.0) <= 1e-5 and abs(float(slow[0]) - 1.0) <= 1e-5
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        assert torch.allclose(blockwise.attention_entropy(inputs, padding, causal, True, heads=[2, 0]), fast[[2, 0]])
    assert narrowed, "no layer's mask narrowed the keys: the test would not exercise a window"

    # The Entropy method, both paths, logs the same per-layer means.
    figures = []
    for blocked in (True, False):
        method = EntropyRegularizer(mode="max", blockwise=blocked)
        method.bind(model)
        method.start(10)
        with torch.no_grad(), hub.capture(method.layers, inputs=method.inputs) as captured:
            model(**batch)
        figures.append(method.term(captured, batch, step=0)[1])
    assert figures[0].keys() == figures[1].keys()
    for key, value in figures[0].items():
        assert abs(float(value) - float(figures[1][key])) <= 1e-5, key


@pytest.mark.parametrize("name", [name for name in WINDOWED if next(f for f in FAMILIES if f.name == name).causal])
def test_a_uniform_head_reads_one_on_decoding_steps(name):
    model = build(name)
    hub = attnreg.attach(model)
    uniform_head_0(hub)
    prompt = padded_batch()["input_ids"][:1, :7]
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad(), hub.capture(inputs=True) as record:
        model.generate(input_ids=prompt, **options)
    with torch.no_grad(), hub.capture() as probs:
        model.generate(input_ids=prompt, **options)
    steps = 0
    for layer in range(hub.num_layers):
        calls, prob_calls = record.calls(layer), probs.calls(layer)
        prompt_mask = calls[0].attention_mask  # a sliding layer's mask admits at most the window on the prompt
        sliding = prompt_mask is not None and int(prompt_mask.sum(-1).max()) == WINDOW
        assert len(calls) == len(prob_calls) == 4  # the prompt, then one call per new token but the last
        for call, (inputs, p) in enumerate(zip(calls, prob_calls, strict=True)):
            keys = inputs.key.shape[2]
            entropy = blockwise.row_entropy(
                inputs.query,
                inputs.key,
                inputs.attention_mask,
                inputs.scaling,
                heads=[0],
                causal=inputs.causal,
                sinks=inputs.sinks,
            )
            sink = probs.has_sink(layer, call)
            assert sink == (inputs.sinks is not None)
            normalized, counted, counts = row_normalized(entropy, None, keys, True, inputs.attention_mask, sink)
            torch.testing.assert_close(normalized[counted], torch.ones(int(counted.sum())), rtol=0, atol=1e-5)
            mask = probs.attention_mask(layer, call)
            slow, slow_counted, _ = row_normalized(row_entropy(p[:, :1], sink), None, p.shape[-1], True, mask, sink)
            torch.testing.assert_close(slow[slow_counted], torch.ones(int(slow_counted.sum())), rtol=0, atol=1e-5)
            if inputs.query.shape[2] == 1:  # a decoding step: one query, the window's keys or all of them
                steps += 1
                assert int(counts) == (WINDOW if sliding else keys)
                assert math.isclose(float(normalized[0, 0, 0]), 1.0, abs_tol=1e-5)
    assert steps == 3 * hub.num_layers


def window_prior(padding: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Parents `[B, T]` drawn anywhere in each real row (so several fall outside a window of 4), -1 on padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = padding.sum(-1)
    parents = torch.stack([torch.randint(0, int(n), (padding.shape[1],), generator=generator) for n in lengths])
    return parents.masked_fill(padding == 0, -1)


@pytest.mark.parametrize("name", WINDOWED)
def test_the_syntax_prior_leaves_out_rows_outside_a_window(name):
    """The KL of a windowed layer is over the rows whose parent its mask admits (a hand computation on the eager
    probabilities), in value and gradient, blockwise and materialized; the rows left out are said once per layer."""
    model = build(name)
    hub = attnreg.attach(model)
    causal = hub.family.causal
    batch = padded_batch()
    prior = window_prior(batch["attention_mask"])
    batch["attnreg_prior"] = prior
    heads = [1]

    with hub.capture() as probs:  # the reference: eager probabilities, rows kept by hand
        model(**batch)
    expected, masks, outside = {}, {}, 0
    for layer in range(hub.num_layers):
        mask = probs.attention_mask(layer)
        masks[layer] = mask
        admitted = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min
        position = torch.arange(prior.shape[1])
        counted = (prior >= 0) & (prior <= position if causal else True)
        reach = counted & admitted.gather(-1, prior.clamp_min(0)[..., None]).squeeze(-1)
        outside += int((counted & ~reach).sum())
        chosen = probs[layer][:, heads].gather(-1, prior.clamp_min(0)[:, None, :, None]).squeeze(-1)
        nll = torch.where(reach[:, None], chosen, 1.0).log().neg()  # rows outside: 0 probability, left out
        expected[layer] = (nll * reach[:, None]).sum() / reach.sum()
    assert outside > 0, "no parent fell outside a window: the test would not exercise one"
    reference = torch.stack(list(expected.values())).mean()
    parameters = [p for p in model.parameters() if p.requires_grad]
    reference_grad = torch.autograd.grad(reference, parameters, allow_unused=True)

    for blocked in (True, False):
        method = attnreg.methods.SyntaxPriorKL(heads=heads, blockwise=blocked)
        method.bind(model)
        method.start(10)
        with hub.capture(method.layers, inputs=method.inputs) as record:
            model(**batch)
        with pytest.warns(UserWarning, match=r"sliding window.*leaves out \d+ of the \d+ prior rows") as caught:
            value, logs = method.term(record, batch, step=0)
        windowed = sum("leaves out" in str(w.message) for w in caught)
        assert 1 <= windowed <= hub.num_layers
        for layer in range(hub.num_layers):
            figure, want = float(logs[f"syntax_prior_kl/layer{layer}"]), float(expected[layer].detach())
            assert abs(figure - want) <= 1e-4, (blocked, layer, figure, want)
        gradient = torch.autograd.grad(value, parameters, allow_unused=True)
        for got, want in zip(gradient, reference_grad, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        with hub.capture(method.layers, inputs=method.inputs) as record:  # said once: not again
            model(**batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method.term(record, batch, step=0)


def test_attention_entropy_infers_a_window_from_the_probabilities():
    """Uniform attention over a window of 4 keys reads 1 without `layer_mask`, as with it; a padded key still counts
    out, and a bidirectional window too."""
    keys = torch.arange(12)
    causal_window = (keys[None, :] <= keys[:, None]) & (keys[None, :] > keys[:, None] - 4)
    both_ways = (keys[None, :] - keys[:, None]).abs() <= 2
    for window, causal in ((causal_window, True), (both_ways, False)):
        mask = window.expand(2, 3, 12, 12).clone()
        mask[1, :, :, 9:] = False  # the second row's last 3 tokens are padding
        padding = torch.ones(2, 12, dtype=torch.long)
        padding[1, 9:] = 0
        uniform = mask / mask.sum(-1, keepdim=True).clamp_min(1)
        inferred = attention_entropy(uniform, padding, causal=causal, normalize=True)
        given = attention_entropy(uniform, padding, causal=causal, normalize=True, layer_mask=mask[:, :1])
        torch.testing.assert_close(inferred, torch.ones(3), rtol=0, atol=1e-6)
        torch.testing.assert_close(given, inferred)
