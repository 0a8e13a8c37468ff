"""A method written in this file, unchanged, through Lightning, the Hugging Face `Trainer` and a plain PyTorch
loop: the three give the same weights, which differ from a run without it (no file of attnreg touched)."""

import lightning as L
import pytest
import torch
from conftest import Classifier, sgd_arguments
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer

import attnreg
from attnreg.integrations.hf import AttnRegTrainer, with_attnreg
from attnreg.methods import EntropyRegularizer, Loop, Method, Runner
from attnreg.tiny import tiny_model

STEPS, BATCH, LR = 3, 4, 0.5


class FirstTokenPenalty(Method):
    """Penalises the attention every head of `layers` gives the first token, ramped up over `warmup`."""

    default_name = "first_token"

    def __init__(self, weight: float, warmup: float, layers=None):
        super().__init__()
        self.weight, self.warmup, self.layers_argument = weight, warmup, layers
        self.steps_begun: list[int] = []

    def bind(self, model, taken=()):
        super().bind(model, taken)
        self.layers = self.hub.resolve_layers(self.layers_argument)

    def schedules(self):
        return [self.ramp]

    def ramp(self, progress: float) -> float:
        return min(1.0, progress / self.warmup)

    def on_step_begin(self, loop: Loop) -> None:
        self.steps_begun.append(loop.step)

    def term(self, record, batch, step):
        share = torch.stack([record[layer][..., 0].mean() for layer in self.layers]).mean()
        return self.weight * self.ramp(self.progress(step)) * share, {f"{self.name}/share": share.detach()}


def examples():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (STEPS * BATCH, 8), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": row} for row in ids]


def batches():
    return list(DataLoader(examples(), batch_size=BATCH))


def plain(method) -> tuple[dict, Method]:
    """The docs' plain loop."""
    model = tiny_model("llama", head="causal_lm").train()
    runner = Runner([method] if method else [])
    runner.bind(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loop = Loop(optimizers=[optimizer])
    runner.start(STEPS)
    runner.fit_start(loop)
    for batch in batches():
        runner.step_begin(loop)
        with runner.capture(model) as captured:
            loss = model(**runner.model_inputs(batch)).loss
        (loss + runner.loss(captured, batch, loop.step)).backward()
        runner.before_optimizer_step(loop)
        optimizer.step()
        optimizer.zero_grad()
        loop.step += 1
        runner.step_end(loop)
    runner.fit_end(loop)
    runner.teardown()
    return model.state_dict(), method


def lightning(method) -> dict:
    module = Classifier(tiny_model("llama", head="causal_lm"))
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=LR)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[attnreg.MethodCallback(method)],
    )
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    return module.model.state_dict()


class Ordered(IterableDataset):
    def __iter__(self):
        return iter(examples())


def hugging_face(method, tmp_path, figure: str = "attnreg/first_token/share") -> dict:
    args = sgd_arguments(
        tmp_path, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR, logging_steps=1
    )
    trainer = AttnRegTrainer(
        model=tiny_model("llama", head="causal_lm").train(), args=args, train_dataset=Ordered(), methods=[method]
    )
    trainer.train()
    assert all(figure in log for log in trainer.state.log_history if "loss" in log)
    return trainer.model.state_dict()


def test_a_method_of_ones_own_runs_unchanged_in_three_loops(tmp_path):
    methods = [FirstTokenPenalty(weight=20.0, warmup=0.5) for _ in range(3)]
    weights = [plain(methods[0])[0], lightning(methods[1]), hugging_face(methods[2], tmp_path)]
    without = plain(None)[0]
    for method in methods:
        assert method.steps_begun == list(range(STEPS))  # once per optimizer step, in every loop
    moved = max(float((weights[0][name] - without[name]).abs().max()) for name in without)
    assert moved > 1e-3
    for other in weights[1:]:
        for name, value in weights[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_method_of_ones_own_is_refused_where_it_cannot_run():
    with pytest.raises(TypeError, match="one attnreg.methods.Method"):
        attnreg.MethodCallback(object())
    with pytest.raises(TypeError, match="must be attnreg.methods.Method objects"):
        Runner([lambda probs, batch: 0])
    callback = attnreg.SyntaxPriorKL(heads={0: [0]})  # the Lightning shell where the Trainer wants the method
    with pytest.raises(TypeError, match=r"SyntaxPriorKL is a Lightning callback: give attnreg.methods.SyntaxPriorKL"):
        Runner([callback])
    assert Runner([callback.method]).methods == [callback.method]  # what the message says works


def test_a_subclass_no_grad_forward_inside_the_step_is_not_captured(tmp_path):
    """A Trainer subclass whose loss runs an extra forward under no_grad (TRL's metrics pass, say): the terms
    read the training forward only, and the run ends where the run without that pass ends."""

    class Metrics(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with torch.no_grad():
                model(input_ids=inputs["input_ids"])  # a metrics pass, after the training forward
            return loss

    weights = []
    for trainer_class in (Trainer, Metrics):
        trainer = with_attnreg(trainer_class)(
            model=tiny_model("llama", head="causal_lm").train(),
            args=sgd_arguments(tmp_path / trainer_class.__name__, max_steps=STEPS, per_device_train_batch_size=BATCH),
            train_dataset=Ordered(),
            methods=[EntropyRegularizer(weight=10.0, mode="max")],
        )
        trainer.train()
        weights.append(trainer.model.state_dict())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0, msg=name)


def test_the_lightning_path_goes_through_the_runner(monkeypatch):
    """Lightning's callbacks and mixin translate events only: the capture, the loss and every event come
    from `Runner`, as in the Trainer's adapter and the plain loop."""
    calls: list[str] = []
    for name in ("bind", "capture", "loss", "step_begin", "before_optimizer_step", "step_end", "fit_end", "teardown"):
        original = getattr(Runner, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Runner, name, spy)
    method = FirstTokenPenalty(weight=20.0, warmup=0.5)
    lightning(method)
    assert method.steps_begun == list(range(STEPS))
    for name in ("bind", "capture", "loss", "step_begin", "before_optimizer_step", "step_end"):
        assert calls.count(name) >= STEPS if name != "bind" else name in calls, name
    assert calls.count("loss") == STEPS and calls[-2:] == ["fit_end", "teardown"]


def test_a_no_grad_forward_inside_a_lightning_step_is_not_captured():
    """The Runner's no-grad rule holds in Lightning too: an extra forward under no_grad inside the step (a
    metrics pass) leaves the terms and the weights as the step without it."""

    class Metrics(Classifier):
        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            with torch.no_grad():
                self.model(input_ids=batch["input_ids"])
            return loss

    weights = []
    for module_class in (Classifier, Metrics):
        module = module_class(tiny_model("llama", head="causal_lm"))
        module.configure_optimizers = lambda module=module: torch.optim.SGD(module.parameters(), lr=LR)
        trainer = L.Trainer(
            max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[attnreg.EntropyRegularizer(weight=10.0, mode="max")],
        )  # fmt: skip
        trainer.fit(module, DataLoader(batches(), batch_size=None))
        weights.append(module.model.state_dict())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0, msg=name)
