"""Schedules: values by hand, against the papers' own formulas and transformers' warmup, and their checks."""

import math

import hydra.utils
import pytest
import torch
from transformers import get_linear_schedule_with_warmup

from attnreg.schedules import (
    Constant,
    Cosine,
    CurriculumDropout,
    EarlyDropout,
    Exponential,
    LateDropout,
    Linear,
    Step,
    Warmup,
    as_schedule,
    schedule_values,
)


@pytest.mark.parametrize(
    "schedule, progress, expected",
    [
        (Constant(0.1), 0.7, 0.1),
        (Linear(0.2, 0.0), 0.0, 0.2),
        (Linear(0.2, 0.0), 0.5, 0.1),
        (Linear(0.2, 0.0), 1.0, 0.0),
        (Linear(0.0, 0.4, start=0.5, end=0.75), 0.25, 0.0),
        (Linear(0.0, 0.4, start=0.5, end=0.75), 0.625, 0.2),
        (Linear(0.0, 0.4, start=0.5, end=0.75), 0.9, 0.4),
        (Cosine(1.0, 0.0), 0.5, 0.5),
        (Cosine(1.0, 0.0), 0.25, 0.5 * (1 + math.cos(math.pi / 4))),
        (Cosine(0.3, 0.1, start=0.5), 0.2, 0.3),
        (Exponential(1.0, 0.01), 0.5, 0.1),
        (Exponential(1.0, 0.01), 1.0, 0.01),
        (Step([0.1, 0.05, 0.0], [0.3, 0.6]), 0.29, 0.1),
        (Step([0.1, 0.05, 0.0], [0.3, 0.6]), 0.3, 0.05),
        (Step([0.1, 0.05, 0.0], [0.3, 0.6]), 0.6, 0.0),
        (Warmup(0.5, Constant(0.2)), 0.25, 0.1),
        (Warmup(0.5, Linear(1.0, 0.0), initial=0.5), 0.25, 0.75),
        (Warmup(0.5, Linear(1.0, 0.0)), 0.75, 0.5),
        (EarlyDropout(0.1, cutoff=0.5), 0.49, 0.1),
        (EarlyDropout(0.1, cutoff=0.5), 0.5, 0.0),
        (EarlyDropout(0.1, cutoff=0.5, shape="linear"), 0.25, 0.05),
        (EarlyDropout(0.1, cutoff=0.5, shape="linear"), 0.8, 0.0),
        (LateDropout(0.1, cutoff=0.5), 0.4, 0.0),
        (LateDropout(0.1, cutoff=0.5), 0.5, 0.1),
        (CurriculumDropout(0.1, gamma=10.0), 0.0, 0.0),
        (CurriculumDropout(0.1, gamma=10.0), 0.1, 0.1 * (1 - math.exp(-1))),
    ],
)
def test_values_by_hand(schedule, progress, expected):
    assert schedule(progress) == pytest.approx(expected, abs=1e-12)


def test_warmup_then_linear_is_transformers_linear_warmup():
    total, warmup = 50, 7
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)
    theirs = []
    for _ in range(total):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = schedule_values(Warmup(warmup / total, Linear(1.0, 0.0)), total)
    assert ours == pytest.approx(theirs, abs=1e-12)


def liu_drop_scheduler(drop_rate, iterations, cutoff_iterations, mode):
    """Liu et al.'s `drop_scheduler` (facebookresearch/dropout), constant schedules, without numpy."""
    if mode == "early":
        return [drop_rate] * cutoff_iterations + [0.0] * (iterations - cutoff_iterations)
    return [0.0] * cutoff_iterations + [drop_rate] * (iterations - cutoff_iterations)


@pytest.mark.parametrize("mode, schedule", [("early", EarlyDropout), ("late", LateDropout)])
def test_early_and_late_dropout_match_liu_et_al(mode, schedule):
    total, cutoff = 40, 12
    assert schedule_values(schedule(0.1, cutoff=cutoff / total), total) == liu_drop_scheduler(0.1, total, cutoff, mode)


def test_curriculum_dropout_is_one_minus_morerio_keep_probability():
    total, gamma_per_iteration, keep_final = 200, 0.02, 0.9  # their form: theta(t) = (1 - p) exp(-gamma t) + p

    def keep(iteration):
        return (1.0 - keep_final) * math.exp(-gamma_per_iteration * iteration) + keep_final

    ours = schedule_values(CurriculumDropout(final=1.0 - keep_final, gamma=gamma_per_iteration * total), total)
    assert ours == pytest.approx([1.0 - keep(i) for i in range(total)], abs=1e-12)
    assert ours[0] == 0.0 and all(a < b for a, b in zip(ours, ours[1:], strict=False))


def test_at_step_and_numbers():
    assert Linear(1.0, 0.0).at_step(25, total_steps=100) == 0.75
    assert as_schedule(0.3)(0.9) == 0.3
    assert as_schedule(math.sqrt) is math.sqrt
    with pytest.raises(ValueError, match=r"step must be an integer in \[0, total_steps=10\], got 11"):
        Linear(1.0, 0.0).at_step(11, total_steps=10)
    with pytest.raises(ValueError, match="total_steps must be a positive integer"):
        Linear(1.0, 0.0).at_step(0, total_steps=0)
    with pytest.raises(ValueError, match=r"progress must be a fraction of training in \[0, 1\], got 1.5"):
        Constant(0.1)(1.5)
    with pytest.raises(ValueError, match="progress"):
        Constant(0.1)(float("nan"))
    with pytest.raises(TypeError, match="schedule must be"):
        as_schedule("cosine")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Linear(0.1, 0.0, start=0.6, end=0.2), r"end=0.2 must come after start=0.6"),
        (lambda: Cosine(0.1, 0.0, start=0.0, end=1.5), r"must be fractions of training in \[0, 1\]"),
        (lambda: Linear(-0.1, 0.0), r"Linear: initial must be a finite number >= 0, got -0.1"),
        (lambda: Constant(float("inf")), "value must be a finite number >= 0"),
        (lambda: Exponential(0.1, 0.0), "Exponential: final must be > 0"),
        (lambda: Step([0.1, 0.0], [0.5, 0.7]), "one value more than boundaries"),
        (lambda: Step([0.1, 0.0, 0.2], [0.7, 0.5]), "boundaries must increase"),
        (lambda: Step([0.1, 0.0], [1.2]), r"boundaries\[0\]=1.2 lies outside training"),
        (lambda: Warmup(0.0, Constant(1.0)), r"fraction must be in \(0, 1\)"),
        (lambda: EarlyDropout(1.0, cutoff=0.5), r"rate is a dropout rate and must be in \[0, 1\), got 1.0"),
        (lambda: EarlyDropout(-0.1, cutoff=0.5), r"must be in \[0, 1\)"),
        (lambda: EarlyDropout(0.1, cutoff=1.0), r"cutoff=1.0 lies outside training"),
        (lambda: EarlyDropout(0.1, cutoff=0.5, shape="cosine"), "shape must be 'constant' or 'linear'"),
        (lambda: LateDropout(0.1, cutoff=0.0), r"cutoff=0.0 lies outside training"),
        (lambda: CurriculumDropout(1.2, gamma=5.0), r"final is a dropout rate and must be in \[0, 1\)"),
        (lambda: CurriculumDropout(0.1, gamma=0.0), "gamma must be a finite number > 0"),
    ],
)
def test_bad_parameters_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_hydra_instantiates_nested_schedules_from_plain_config():
    config = {
        "_target_": "attnreg.schedules.Warmup",
        "fraction": 0.1,
        "then": {"_target_": "attnreg.schedules.Step", "values": [1.0, 0.5], "boundaries": [0.5]},
    }
    schedule = hydra.utils.instantiate(config)
    assert schedule == Warmup(0.1, Step((1.0, 0.5), (0.5,)))
    assert schedule(0.05) == 0.5 and schedule(0.9) == 0.5 and schedule(0.2) == 1.0
