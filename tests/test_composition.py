"""Every attnreg callback in one real `Trainer.fit`: gradient accumulation, bf16, a mid-run checkpoint and
a resume with more steps. Each term is logged, finite and covers the layers it names; learning rates,
dropout and weights follow their schedules after the resume (re-stretched over the longer run)."""

import itertools
import math

import lightning as L
import pytest
import torch
from conftest import padded_batch
from torch.utils.data import DataLoader

import attnreg
from attnreg.app.modules import SequenceClassifier
from attnreg.methods import L1Gates, Removal
from attnreg.progress import TrainingLengthWarning
from attnreg.schedules import Constant, Linear, Warmup
from attnreg.syntax.data import PRIOR_KEY
from attnreg.tiny import tiny_model

LR = 1e-3
MICRO_BATCHES = 4  # per epoch: 2 optimizer steps per epoch with accumulate_grad_batches=2


def micro_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """Classification batches with a previous-token prior (-1 on the first and padded rows)."""
    items = []
    for index in range(count):
        batch = padded_batch(batch=4, length=8, seed=index)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        prior = torch.arange(8).expand(4, 8) - 1
        batch[PRIOR_KEY] = prior.masked_fill(batch["attention_mask"] == 0, -1)
        items.append(batch)
    return items


class Recorder(SequenceClassifier):
    """Keeps every value logged during training."""

    def __init__(self, model):
        super().__init__(model, lr=LR)
        self.logged: dict[str, list[tuple[int, float]]] = {}

    def log(self, name, value, *args, **kwargs):
        if self.training:
            self.logged.setdefault(name, []).append((self.global_step, float(value)))
        super().log(name, value, *args, **kwargs)


def callbacks() -> dict[str, L.Callback]:
    unlabeled = [{k: v for k, v in b.items() if k != PRIOR_KEY} for b in micro_batches(2)]
    return {
        "prior": attnreg.SyntaxPriorKL(weight=Linear(1.0, 0.5), layers=[1], heads=[0]),
        "entropy": attnreg.EntropyRegularizer(weight=Warmup(0.5, Constant(0.1)), mode="max", layers=[0]),
        "dropout": attnreg.AttentionDropoutSchedule(Linear(0.2, 0.0)),
        "lr": attnreg.LayerwiseLR(lr=LR, decay=0.8, multipliers={"gates": 10}, schedule=Linear(1.0, 0.1)),
        "freeze": attnreg.FreezeLayers(["embeddings"], epochs=1),
        "gating": attnreg.HeadGating(gates=L1Gates(weight=0.01), removal=Removal(keep=6)),
        "importance": attnreg.HeadImportance(DataLoader(unlabeled, batch_size=None)),
        "monitor": attnreg.AttentionMonitor(every_n_steps=2, heatmaps=False),
    }


class Watch(L.Callback):
    """Before every micro-batch: the step, the learning rate of layer 0's group, and the loss weights."""

    def __init__(self, chosen: dict[str, L.Callback]):
        self.chosen, self.seen = chosen, []

    def on_train_batch_start(self, trainer, pl_module, *args):
        lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
        weights = {name: c.current_weight() for name, c in self.chosen.items() if hasattr(c, "current_weight")}
        self.seen.append((trainer.global_step, lrs, weights))


def make_trainer(tmp_path, max_steps, chosen, **options) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[*chosen.values(), Watch(chosen)],
        **options,
    )


class SaveAt(L.Callback):
    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(self.path)


def test_every_callback_together_with_accumulation_bf16_and_a_longer_resume(tmp_path):
    torch.manual_seed(0)
    first = make_trainer(tmp_path, 4, {**callbacks(), "save": SaveAt(2, tmp_path / "step2.ckpt")})
    first.fit(Recorder(tiny_model("bert", head="classification")), DataLoader(micro_batches(MICRO_BATCHES), None))
    first.save_checkpoint(tmp_path / "end.ckpt")  # after the end-of-fit pruning

    chosen = callbacks()
    module = Recorder(tiny_model("bert", head="classification"))
    embeddings = module.model.bert.embeddings.word_embeddings.weight
    resumed = make_trainer(tmp_path, 6, chosen)
    with pytest.warns(TrainingLengthWarning, match="re-stretched from 4 to 6 steps"):
        resumed.fit(module, DataLoader(micro_batches(MICRO_BATCHES), None), ckpt_path=tmp_path / "step2.ckpt")
    (watch,) = [callback for callback in resumed.callbacks if isinstance(callback, Watch)]

    # Steps 2..5 of 6, two micro-batches each, with every schedule at step / 6.
    assert [step for step, _, _ in watch.seen] == [2, 2, 3, 3, 4, 4, 5, 5]
    for step, lrs, weights in watch.seen:
        progress = step / 6
        factor = 1.0 - 0.9 * progress
        assert lrs["head"] == pytest.approx(LR * factor)
        assert lrs["layer1"] == pytest.approx(LR * 0.8**2 * factor)
        assert lrs["gates"] == pytest.approx(10 * LR * factor)
        assert weights["prior"] == pytest.approx(1.0 - 0.5 * progress)
        assert weights["entropy"] == pytest.approx(0.1 * min(progress / 0.5, 1.0))
    dropout = module.logged["attnreg/attention_dropout_schedule"]  # set (and logged) once per optimizer step
    assert [value for _, value in dropout] == pytest.approx([0.2 * (1 - s / 6) for s in (2, 3, 4, 5)])

    # Each term: logged at every micro-batch, finite, and only for the layers it names.
    for name in ("attnreg/syntax_prior_kl", "attnreg/entropy_regularizer", "attnreg/head_gating"):
        values = [value for _, value in module.logged[name]]
        assert len(values) == 8 and all(math.isfinite(v) for v in values), name
    assert "attnreg/syntax_prior_kl/layer1" in module.logged and "attnreg/syntax_prior_kl/layer0" not in module.logged
    assert "attnreg/entropy_regularizer/layer0" in module.logged
    assert "attnreg/entropy_regularizer/layer1" not in module.logged
    assert chosen["monitor"].method.entropy is not None and chosen["monitor"].method.entropy.isfinite().all()

    # FreezeLayers: epoch 0 (steps 0-1) was the first run; from epoch 1 on the embeddings train.
    assert embeddings.requires_grad
    # HeadGating pruned to 6 heads at the end of the resumed run; HeadImportance scored what is left.
    hub = attnreg.attach(module.model)
    assert sum(layer.num_heads for layer in hub.layers) == 6 and not hub.gates
    assert sorted(len(scores) for scores in chosen["importance"].method.scores.values()) == sorted(
        layer.num_heads for layer in hub.layers
    )

    # Resuming the pruned end of the first run with more steps keeps its shapes and trains on.
    again = Recorder(tiny_model("bert", head="classification"))
    longer = make_trainer(tmp_path, 6, callbacks())
    with pytest.warns(TrainingLengthWarning):
        longer.fit(again, DataLoader(micro_batches(MICRO_BATCHES), None), ckpt_path=tmp_path / "end.ckpt")
    assert longer.global_step == 6
    assert sum(layer.num_heads for layer in attnreg.attach(again.model).layers) == 6
    assert {step for step, _ in again.logged["attnreg/entropy_regularizer"]} == {4, 5}
    assert "attnreg/head_gating" not in again.logged  # pruned and folded: no penalty any more


def test_frozen_layers_do_not_change_in_their_epochs(tmp_path):
    chosen = {"freeze": attnreg.FreezeLayers(["embeddings"], epochs=1), "entropy": attnreg.EntropyRegularizer()}
    module = Recorder(tiny_model("bert", head="classification"))
    embeddings = module.model.bert.embeddings.word_embeddings.weight
    start = embeddings.detach().clone()
    after_epoch0 = {}

    class Snapshot(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            after_epoch0.setdefault(trainer.current_epoch, embeddings.detach().clone())

    trainer = make_trainer(tmp_path, 4, {**chosen, "snapshot": Snapshot()})
    trainer.fit(module, DataLoader(micro_batches(MICRO_BATCHES), None))
    assert torch.equal(after_epoch0[0], start) and not torch.equal(after_epoch0[1], start)


PAIRS = list(itertools.combinations(sorted(callbacks()), 2))


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(pair) for pair in PAIRS])
def test_every_pair_of_callbacks_fits(tmp_path, pair):
    every = callbacks()
    chosen = {name: every[name] for name in pair}
    module = Recorder(tiny_model("gpt2", head="classification"))
    make_trainer(tmp_path, 3, chosen, enable_checkpointing=False).fit(
        module, DataLoader(micro_batches(MICRO_BATCHES), None)
    )
    for name, values in module.logged.items():
        assert all(math.isfinite(value) for _, value in values), name
