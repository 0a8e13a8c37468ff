"""Distillation after pruning: the loss against references written another way, padding left out,
clear errors, and a real fit of a pruned model, without labels (the app's module with `labels=False` and the
`Distillation` callback), that moves it back toward the unpruned teacher."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import fit, padded_batch

import attnreg
from attnreg.app.modules import SequenceClassifier
from attnreg.methods import pruning
from attnreg.methods.distillation import distillation_loss
from attnreg.tiny import tiny_model


def outputs(seed: int, batch: int = 3, tokens: int = 5, layers: int = 2, classes: int = 2, hidden: int = 8):
    generator = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        logits=torch.randn(batch, classes, generator=generator),
        hidden_states=tuple(torch.randn(batch, tokens, hidden, generator=generator) for _ in range(layers + 1)),
    )


MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])


def test_loss_is_zero_for_identical_outputs_and_matches_kl_plus_masked_mse():
    student, teacher = outputs(0), outputs(1)
    assert distillation_loss(teacher, teacher, MASK, hidden_weight=1.0).item() == pytest.approx(0.0, abs=1e-7)
    t = 3.0
    kl = F.kl_div(F.log_softmax(student.logits / t, -1), F.softmax(teacher.logits / t, -1), reduction="batchmean")
    squared = []  # per layer, the mean over the real tokens of the mean over features
    for mine, target in zip(student.hidden_states[1:], teacher.hidden_states[1:], strict=True):
        rows = [((mine[b, :n] - target[b, :n]) ** 2).mean(-1) for b, n in enumerate(MASK.sum(1).tolist())]
        squared.append(torch.cat(rows).mean())
    expected = t * t * kl + 0.5 * torch.stack(squared).mean()
    actual = distillation_loss(student, teacher, MASK, temperature=t, hidden_weight=0.5)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(distillation_loss(student, teacher, temperature=t, hidden_weight=0.0), t * t * kl)


def test_padded_tokens_and_the_embeddings_do_not_count():
    student, teacher = outputs(0), outputs(1)
    before = distillation_loss(student, teacher, MASK, hidden_weight=1.0)
    changed = [h.clone() for h in student.hidden_states]
    changed[0] += 100.0  # the embeddings: pruning heads does not change them
    for h in changed[1:]:
        h[MASK == 0] = 1e4
    changed_output = SimpleNamespace(logits=student.logits, hidden_states=tuple(changed))
    after = distillation_loss(changed_output, teacher, MASK, hidden_weight=1.0)
    torch.testing.assert_close(after, before)


def test_token_logits_of_a_causal_lm_are_averaged_over_real_tokens_only():
    generator = torch.Generator().manual_seed(0)
    student, teacher = (SimpleNamespace(logits=torch.randn(3, 5, 11, generator=generator)) for _ in range(2))
    real = MASK.bool()
    kl = F.kl_div(F.log_softmax(student.logits[real], -1), F.softmax(teacher.logits[real], -1), reduction="batchmean")
    actual = distillation_loss(student, teacher, MASK, temperature=1.0, hidden_weight=0.0)
    torch.testing.assert_close(actual, kl)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(temperature=0.0), "temperature must be positive"),
        (dict(hidden_weight=-1.0), "hidden_weight must be at least 0"),
        (dict(student=SimpleNamespace(logits=torch.zeros(3, 2), hidden_states=None)), "output_hidden_states=True"),
        (dict(student=outputs(0, layers=3)), "the student has 3 layers and the teacher 2"),
        (dict(student=outputs(0, classes=3)), r"student logits \(3, 3\) and teacher logits \(3, 2\) differ"),
        (dict(attention_mask=MASK[:, :4]), r"attention_mask \(3, 4\) does not match the hidden states"),
    ],
)
def test_bad_input_gets_a_clear_error(change, message):
    arguments = dict(student=outputs(0), teacher=outputs(1), attention_mask=MASK, hidden_weight=1.0) | change
    with pytest.raises(ValueError, match=message):
        distillation_loss(**arguments)


def test_training_without_labels_and_without_a_term_is_refused_before_the_first_step():
    module = SequenceClassifier(tiny_model("bert", head="classification"), labels=False)
    with pytest.raises(ValueError, match=r"labels=False\) trains on attnreg's terms alone.*attnreg.Distillation"):
        fit(module, [padded_batch(batch=2, length=6, seed=0)])
    assert module.global_step == 0


@pytest.mark.parametrize(("family", "hidden_weight"), [("bert", 1.0), ("llama", 0.0)])
def test_fit_pulls_a_pruned_model_back_toward_its_unpruned_teacher(family, hidden_weight):
    teacher = tiny_model(family, head="classification", layers=2, heads=4).eval()
    teacher.config.pad_token_id = 0
    student = copy.deepcopy(teacher)
    pruning.prune_heads(student, {0: [0, 1, 2, 3], 1: [1]} if family == "bert" else {0: [0, 1], 1: [2, 3]})
    with torch.no_grad():  # far from the teacher, as a model pruned hard is
        for parameter in student.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    teacher_weights = {name: value.clone() for name, value in teacher.state_dict().items()}
    unlabeled = [padded_batch(batch=4, length=8, seed=seed) for seed in range(24)]
    probe = padded_batch(batch=4, length=8, seed=99)

    def gap() -> float:
        with torch.no_grad():
            ours = student.eval()(**probe, output_hidden_states=True)
            theirs = teacher(**probe, output_hidden_states=True)
        return distillation_loss(ours, theirs, probe["attention_mask"], hidden_weight=hidden_weight).item()

    before = gap()
    labeled = copy.deepcopy(student)
    module = SequenceClassifier(student, labels=False, lr=3e-3, warmup=0.0)
    fit(module, unlabeled, [attnreg.Distillation(teacher, hidden_weight=hidden_weight)])
    assert gap() < 0.85 * before  # unlabeled batches, no labels anywhere: only the teacher teaches
    with_labels = [{**batch, "labels": torch.randint(0, 2, (4,))} for batch in unlabeled]  # read by nothing
    again = SequenceClassifier(labeled, labels=False, lr=3e-3, warmup=0.0)
    fit(again, with_labels, [attnreg.Distillation(teacher, hidden_weight=hidden_weight)])
    torch.testing.assert_close(labeled.state_dict(), student.state_dict(), rtol=0, atol=0)
    assert all(torch.equal(value, teacher.state_dict()[name]) for name, value in teacher_weights.items())
    assert not any(name.startswith("teacher") for name in module.state_dict())
    optimized = {id(p) for group in module.optimizers().optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in student.parameters()}
