"""prior_kl refuses priors and heads that cannot be right, naming the argument and the first bad row."""

import pytest
import torch

from attnreg.losses import check_prior, prior_kl


def attention(batch=2, heads=3, queries=4, keys=4, dtype=torch.float32):
    scores = torch.randn(batch, heads, queries, keys, generator=torch.Generator().manual_seed(0))
    return scores.softmax(-1).to(dtype)


def dense_parents(indices, keys=4, dtype=torch.float32):
    rows = torch.zeros(*indices.shape, keys, dtype=dtype)
    kept = indices >= 0
    rows[kept] = torch.nn.functional.one_hot(indices[kept], keys).to(dtype)
    return rows


INDICES = torch.tensor([[1, 0, 3, -1], [2, 2, -1, 0]])


@pytest.mark.parametrize(
    ("prior", "error", "message"),
    [
        (
            torch.tensor([[1, 0, 3, -1], [2, 4, -1, 0]]),
            IndexError,
            r"row \(batch 1, query 1\) has key index 4, outside 0..3",
        ),
        (
            torch.tensor([[1, 0, 3, -5], [2, 2, -1, 0]]),
            IndexError,
            r"row \(batch 0, query 3\) has key index -5.*only -1",
        ),
        (INDICES.float(), TypeError, r"prior: key indices \[B, T\] must be an integer tensor, got torch.float32"),
        (INDICES.tolist(), TypeError, r"prior must be a torch.Tensor .* got list"),
        (INDICES[:, :3], ValueError, r"prior of shape \(2, 3\) does not match attention of shape \(2, 3, 4, 4\)"),
        (INDICES.bool(), TypeError, "must be an integer tensor, got torch.bool"),
    ],
)
def test_bad_key_indices_are_refused(prior, error, message):
    with pytest.raises(error, match=message):
        prior_kl(attention(), prior)


def bad_dense(row, values):
    prior = dense_parents(INDICES)
    prior[row] = torch.tensor(values)
    return prior


@pytest.mark.parametrize(
    ("prior", "message"),
    [
        (bad_dense((1, 2), [0.5, 0.7, -0.2, 0.0]), r"row \(batch 1, query 2\) has a negative entry -0.2 at key 2"),
        (bad_dense((0, 1), [1.0, 1.0, 1.0, 0.0]), r"row \(batch 0, query 1\) sums to 3; rows must sum to 1"),
        (bad_dense((0, 0), [0.5, 0.5, 0.0, 0.001]), r"row \(batch 0, query 0\) sums to 1.001"),
        (
            bad_dense((1, 3), [float("nan"), 1.0, 0.0, 0.0]),
            r"row \(batch 1, query 3\) has a non-finite entry nan at key 0",
        ),
        (bad_dense((1, 0), [0.0, float("inf"), 0.0, 0.0]), r"non-finite entry inf at key 1"),
        (dense_parents(INDICES).long(), "dense rows .* must be a floating-point tensor, got torch.int64"),
    ],
)
def test_bad_dense_rows_are_refused(prior, message):
    with pytest.raises((ValueError, TypeError), match=message):
        prior_kl(attention(), prior)


def test_negative_dense_prior_no_longer_gives_nan():
    prior = bad_dense((0, 2), [-1.0, 1.0, 1.0, 0.0])  # sums to 1, but one entry is negative
    with pytest.raises(ValueError, match="negative entry"):
        prior_kl(attention(), prior)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rounded_soft_rows_in_low_precision_are_accepted(dtype):
    soft = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1)).mul(2).softmax(-1)
    soft[0, 1] = 0.0  # a row left out
    prior = soft.to(dtype)
    assert torch.isfinite(prior_kl(attention(dtype=dtype), prior))
    check_prior(prior, (2, 3, 4, 4))


@pytest.mark.parametrize(
    ("heads", "error", "message"),
    [
        ([99], IndexError, r"heads: head 99 is outside 0..2 \(the attention has 3 heads\)"),
        ([-1], IndexError, "head -1 is outside 0..2"),
        ([0.0], TypeError, "integer head positions, got 0.0"),
        ([True], TypeError, "integer head positions"),
        (1, TypeError, "heads must be a list of head positions"),
        ([], ValueError, "heads is empty"),
    ],
)
def test_bad_heads_are_refused(heads, error, message):
    with pytest.raises(error, match=message):
        prior_kl(attention(), INDICES, heads=heads)


def test_valid_priors_still_give_the_same_loss():
    probs = attention()
    assert torch.allclose(prior_kl(probs, INDICES, heads=(0, 2)), prior_kl(probs, dense_parents(INDICES), heads=[0, 2]))
    assert torch.allclose(prior_kl(probs, INDICES.int()), prior_kl(probs, INDICES))  # int32 indices work too
    assert prior_kl(probs, torch.full((2, 4), -1)) == 0


def test_validation_allocates_nothing_of_the_attention_size():
    """The check reduces over the prior: nothing of the attention's size, not even a bool copy of the prior."""
    prior = torch.randn(4, 64, 64).softmax(-1)
    with torch.profiler.profile(profile_memory=True) as profile:
        check_prior(prior, (4, 64, 64, 64))
    largest = max((event.cpu_memory_usage for event in profile.events()), default=0)
    assert largest < prior.numel()


def test_value_checks_can_be_skipped_but_shapes_and_heads_never_are():
    bad = torch.tensor([[1, 0, 3, -5], [2, 2, -1, 0]])
    check_prior(bad, (2, 3, 4, 4), values=False)  # the values are someone else's job here
    with pytest.raises(IndexError, match="key index -5"):
        check_prior(bad, (2, 3, 4, 4))
    with pytest.raises(ValueError, match="does not match attention"):
        check_prior(bad[:, :3], (2, 3, 4, 4), values=False)
    with pytest.raises(IndexError, match="head 5 is outside"):
        check_prior(bad, (2, 3, 4, 4), heads=[5], values=False)
    with pytest.raises(TypeError, match="must be an integer tensor"):
        check_prior(bad.float(), (2, 3, 4, 4), values=False)


@pytest.mark.parametrize("blockwise", [True, False])
def test_prior_kl_term_checks_the_prior_values_once_per_batch_and_still_refuses_a_bad_one(blockwise, monkeypatch):
    """Every layer's KL reads the same prior: its values are checked with the first layer only (one GPU sync
    per batch, not one per layer); a bad prior is still refused, naming its row."""
    import attnreg
    from attnreg import blockwise as blockwise_module
    from attnreg import losses, methods
    from attnreg.tiny import tiny_model

    model = tiny_model("bert", num_hidden_layers=3).train()
    term = methods.SyntaxPriorKL(weight=1.0, heads=[1], blockwise=blockwise)
    term.bind(model, set())
    term.start(10)
    input_ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attnreg_prior": torch.tensor([[1, 0, 3, -1, 2, 4]] * 2)}
    calls = []

    def counted(prior, shape, heads=None, values=True):
        if shape is not None:  # a check against the attention (check_prior(prior, None) reads the type alone)
            calls.append(values)
        return check_prior(prior, shape, heads, values)

    module = blockwise_module if blockwise else losses
    monkeypatch.setattr(module, "check_prior", counted)
    with attnreg.attach(model).capture(term.layers, inputs=blockwise) as record:
        model(input_ids=input_ids)
    value, _ = term.term(record, batch, step=0)
    assert torch.isfinite(value) and calls == [True, False, False]  # three layers, values checked once
    batch["attnreg_prior"][1, 4] = 9  # a key index past the 6 tokens
    with pytest.raises(IndexError, match=r"row \(batch 1, query 4\) has key index 9"):
        term.term(record, batch, step=0)
