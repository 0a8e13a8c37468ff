"""Distillation as a method: its term is the functional `distillation_loss` of the training forward's outputs and
the teacher's, and it runs unchanged through a plain loop, Lightning and the Hugging Face `Trainer`, which end on
the same weights (different from a run without it)."""

import copy

import pytest
import torch
from test_user_method import batches, hugging_face, lightning, plain

from attnreg.methods import Distillation, Runner
from attnreg.methods.distillation import distillation_loss
from attnreg.tiny import tiny_model


def teacher():
    model = tiny_model("llama", head="causal_lm")
    with torch.no_grad():
        for parameter in model.parameters():  # a teacher that differs from the students' start
            parameter.mul_(1.5)
    return model.eval()


@pytest.mark.parametrize("hidden_weight", [0.0, 0.5])
def test_the_term_is_the_distillation_loss_of_the_training_forward(hidden_weight):
    student, reference = tiny_model("llama", head="causal_lm").train(), teacher()
    method = Distillation(copy.deepcopy(reference), temperature=3.0, hidden_weight=hidden_weight, weight=0.25)
    runner = Runner([method])
    runner.bind(student)
    runner.start(4)
    batch = batches()[0]
    with runner.capture(student) as captured:
        output = student(**runner.model_inputs(batch))
    value = runner.loss(captured, batch, step=0)
    assert output.hidden_states is not None if hidden_weight else output.hidden_states is None
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        target = reference(**inputs, output_hidden_states=True)
    expected = distillation_loss(output, target, batch["attention_mask"], 3.0, hidden_weight)
    torch.testing.assert_close(value, 0.25 * expected)
    value.backward()
    assert all(p.grad is None for p in method.teacher.parameters())  # the teacher is frozen
    runner.teardown()


def test_distillation_runs_unchanged_in_three_loops(tmp_path):
    methods = [Distillation(teacher(), temperature=2.0, weight=5.0) for _ in range(3)]
    hf = hugging_face(methods[2], tmp_path, "attnreg/distillation/kl")
    weights = [plain(methods[0])[0], lightning(methods[1]), hf]
    without = plain(None)[0]
    moved = max(float((weights[0][name] - without[name]).abs().max()) for name in without)
    assert moved > 1e-3
    for other in weights[1:]:
        for name, value in weights[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_distillation_refuses_what_cannot_work():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="teacher is the model being trained"):
        Distillation(model).bind(model)
    with pytest.raises(ValueError, match="temperature must be positive"):
        Distillation(teacher(), temperature=0.0)
    with pytest.raises(TypeError, match="teacher must be a model"):
        Distillation("bert-base-uncased")
    method = Distillation(teacher())
    method.bind(tiny_model("llama", head="causal_lm"))
    with pytest.raises(RuntimeError, match="no training forward"):
        method.term(None, {}, step=0)
