"""Entropy and prior-KL losses against hand-written references."""

import math

import pytest
import torch

from attnreg.losses import attention_entropy, entropy_penalty, prior_kl, row_entropy


def softmax_rows(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).mul(3).softmax(-1)


def test_row_entropy_value_and_gradient_match_autograd():
    probs = softmax_rows(2, 3, 4, 5).requires_grad_()
    reference = -(probs * probs.log()).sum(-1)
    assert torch.allclose(row_entropy(probs), reference)
    upstream = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, probs, upstream)
    (got,) = torch.autograd.grad(row_entropy(probs), probs, upstream)
    assert torch.allclose(got, expected)


def test_row_entropy_with_a_sink_counts_the_missing_mass_as_one_outcome():
    """gpt-oss's rows lack the sink's share: with `sink=True` the entropy (and its gradient through the softmax, to the
    logits and to the sink logit) is that of the whole softmax over keys and sink, computed by autograd here."""
    scores = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(3)
    sinks = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    upstream = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for by_hand in (True, False):
        logits, sink = scores.clone().requires_grad_(), sinks.clone().requires_grad_()
        column = sink.reshape(1, -1, 1, 1).expand(2, 3, 4, 1)
        full = torch.cat([logits, column], dim=-1).softmax(-1)  # keys and sink
        if by_hand:
            entropy = torch.special.entr(full).sum(-1)
        else:
            entropy = row_entropy(full[..., :-1], sink=True)  # what capture records: the sink's column dropped
        grads = torch.autograd.grad((entropy * upstream).sum(), (logits, sink))
        results.append((entropy.detach(), *grads))
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected)
    # Without the flag the sink's share is not counted: a different number.
    assert (row_entropy(full[..., :-1].detach()) - results[0][0]).abs().max() > 0.1


def test_normalized_entropy_with_a_sink_reads_one_for_a_head_uniform_over_keys_and_sink():
    window = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()  # causal: 1, 2, 3, 4 keys
    probs = window / (window.sum(-1, keepdim=True) + 1.0)  # the sink has one more equal share
    normalized = attention_entropy(probs, causal=True, normalize=True, layer_mask=window, sink=True)
    torch.testing.assert_close(normalized, torch.ones(1))  # every row counts: two outcomes at least
    keys_alone = attention_entropy(probs, causal=True, normalize=True, layer_mask=window)
    assert abs(float(keys_alone) - 1.0) > 0.01


def test_row_entropy_gradient_is_finite_at_masked_keys():
    scores = torch.randn(2, 2, 4, 4, requires_grad=True)
    masked = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    probs = masked.softmax(-1)  # exact zeros above the diagonal
    row_entropy(probs).sum().backward()
    assert torch.isfinite(scores.grad).all() and scores.grad.abs().sum() > 0


def by_hand_entropy(probs, attention_mask, causal, normalize):
    batch, heads, queries, _ = probs.shape
    totals = torch.zeros(heads, dtype=torch.float64)
    counts = torch.zeros(heads, dtype=torch.float64)
    for b in range(batch):
        for i in range(queries):
            if not attention_mask[b, i]:
                continue
            keys = [j for j in range(queries) if attention_mask[b, j] and (not causal or j <= i)]
            if normalize and len(keys) < 2:
                continue
            for h in range(heads):
                p = probs[b, h, i]
                value = -sum(float(p[j]) * math.log(float(p[j])) for j in range(queries) if p[j] > 0)
                totals[h] += value / (math.log(len(keys)) if normalize else 1.0)
                counts[h] += 1
    return totals / counts


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_attention_entropy_over_real_rows(causal, normalize):
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    allowed = attention_mask.bool()[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(5, 5, dtype=torch.bool).tril()
    scores = torch.randn(2, 3, 5, 5, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1)
    got = attention_entropy(probs, attention_mask, causal=causal, normalize=normalize)
    assert torch.allclose(got, by_hand_entropy(probs, attention_mask, causal, normalize))


def test_normalized_entropy_of_uniform_attention_is_one():
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    probs = attention_mask[:, None, None, :].float().expand(2, 2, 4, 4)
    probs = probs / probs.sum(-1, keepdim=True)
    assert torch.allclose(attention_entropy(probs, attention_mask, normalize=True), torch.ones(2))


def test_entropy_penalty_modes():
    entropy = torch.tensor([[0.1, 0.5], [0.9, 0.6]])
    assert entropy_penalty(entropy, "min") == pytest.approx(0.525)
    assert entropy_penalty(entropy, "max") == pytest.approx(-0.525)
    per_head = entropy_penalty(entropy, "target", band=(0.4, 0.7))
    assert per_head == pytest.approx((0.3**2 + 0.2**2) / 4)
    per_layer = entropy_penalty(entropy, "target", band=(0.4, 0.7), per="layer")  # layer means 0.3, 0.75
    assert per_layer == pytest.approx((0.1**2 + 0.05**2) / 2)
    assert entropy_penalty(torch.tensor([0.5]), "target", band=(0.4, 0.7)) == 0
    with pytest.raises(ValueError, match="band"):
        entropy_penalty(entropy, "target", band=(0.7, 0.4))
    with pytest.raises(ValueError, match="mode"):
        entropy_penalty(entropy, "sharpen")


def test_prior_kl_one_hot_indices_equal_dense_prior_and_hand_value():
    probs = softmax_rows(2, 3, 4, 4)
    parents = torch.tensor([[1, 0, 3, -1], [2, 2, -1, 0]])
    dense = torch.zeros(2, 4, 4, dtype=torch.float64)
    for b in range(2):
        for i in range(4):
            if parents[b, i] >= 0:
                dense[b, i, parents[b, i]] = 1.0
    by_hand = torch.stack(
        [-probs[b, :, i, parents[b, i]].log() for b in range(2) for i in range(4) if parents[b, i] >= 0]
    ).mean()
    assert torch.allclose(prior_kl(probs, parents), by_hand)
    assert torch.allclose(prior_kl(probs, dense), by_hand)


def test_prior_kl_dense_soft_prior_heads_and_mean_attention():
    probs = softmax_rows(1, 4, 3, 3)
    prior = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.2, 0.3, 0.5]]], dtype=torch.float64)

    def kl(p, q):
        return sum(float(p[j]) * math.log(float(p[j]) / float(q[j])) for j in range(3) if p[j] > 0)

    heads = [1, 3]
    expected = sum(kl(prior[0, i], probs[0, h, i]) for h in heads for i in (0, 2)) / 4
    assert prior_kl(probs, prior, heads=heads).item() == pytest.approx(expected)
    mean = probs.mean(1)
    expected_mean = sum(kl(prior[0, i], mean[0, i]) for i in (0, 2)) / 2
    assert prior_kl(probs, prior, reduction="mean_attention").item() == pytest.approx(expected_mean)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prior_kl_is_finite_when_the_parent_gets_exactly_zero(dtype):
    scores = torch.randn(2, 2, 4, 4, requires_grad=True)
    probs = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")).softmax(-1).to(dtype)
    parents = torch.tensor([[3, 3, 3, 3], [1, 2, -1, 0]])  # row 0 points at masked keys: p = 0 there
    loss = prior_kl(probs, parents)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(scores.grad).all()


def test_prior_kl_without_supervised_rows_is_zero_not_nan():
    probs = softmax_rows(1, 2, 3, 3)
    assert prior_kl(probs, torch.full((1, 3), -1)) == 0
