"""HeadGating and HeadImportance in real Lightning fits: smaller models, optimizer state, resuming."""

import copy

import lightning as L
import pytest
import torch
from conftest import fit, main_output, padded_batch
from conftest import trainer as make_trainer
from torch.utils.data import DataLoader

import attnreg
from attnreg.callbacks.pruning import HeadGating, HeadImportance
from attnreg.methods import HardConcreteGates, L1Gates, Removal, pruning
from attnreg.records import GATE
from attnreg.schedules import Constant, Warmup
from attnreg.tiny import tiny_model

# One head of a 32-wide, 8-per-head layer: query/key/value rows with bias, output-projection columns.
PARAMETERS_PER_HEAD = 3 * (8 * 32 + 8) + 8 * 32


class Classifier(attnreg.AttnRegMixin, L.LightningModule):
    def __init__(self, model, lr=1e-2, decay=None):
        super().__init__()
        self.model, self.lr, self.decay = model, lr, decay

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.decay is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.decay**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def batches(count, seed=0):
    items = []
    for index in range(count):
        batch = padded_batch(batch=8, length=10, seed=seed + index)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        items.append(batch)
    return items


class Snapshot(L.Callback):
    """Placed before HeadGating: keeps a copy of the gated model (and optimizer state) just before pruning."""

    def __init__(self, gating, at_step=None):
        self.gating, self.at_step, self.model, self.optimizer_state = gating, at_step, None, None

    def _take(self, trainer, pl_module):
        self.model = copy.deepcopy(pl_module.model).eval()
        optimizer = trainer.optimizers[0]
        self.optimizer_state = {name: optimizer.state[p] for name, p in pl_module.model.named_parameters()}
        self.optimizer_state = copy.deepcopy(self.optimizer_state)

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.at_step is not None and trainer.global_step == self.at_step and not self.gating.method.pruned:
            self._take(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if self.at_step is None:
            self._take(trainer, pl_module)


def close_gates(model, removed):
    """Set the gates of `removed` heads (original numbers) to 0 in a gated copy (hard-concrete: log-alpha
    to -100); heads already gone are skipped."""
    hub = attnreg.hub_of(model)
    for layer, heads in removed.items():
        numbers = pruning.head_numbers(model, layer)
        positions = [numbers.index(head) for head in heads if head in numbers]
        found = pruning.hard_concrete(hub, layer)
        tensor = found.log_alpha if found is not None else hub.gate(layer)
        with torch.no_grad():
            tensor[positions] = -100.0 if found is not None else 0.0
    return model


class AtFinalRound(L.Callback):
    """Placed after HeadGating: keeps a copy of the pruned model right after the last removal."""

    def __init__(self, gating):
        self.gating, self.model = gating, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.gating.method.pruned and self.model is None:
            self.model = copy.deepcopy(pl_module.model).eval()


def outputs(model, batch):
    with torch.no_grad():
        return main_output(model.eval()(**{k: v for k, v in batch.items() if k != "labels"}))


def count(model):
    return sum(p.numel() for p in model.parameters())


class Record(L.Callback):
    """Placed after HeadGating: at every batch end, the parameter count (and with `gating`, the target)."""

    def __init__(self, gating=None):
        self.gating, self.counts, self.targets = gating, {}, {}

    def on_train_batch_start(self, trainer, pl_module, *args):
        if self.gating is not None:
            self.targets[trainer.global_step] = self.gating.method.target(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.counts[trainer.global_step] = count(pl_module.model)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("bert", dict(gates=L1Gates(weight=0.1), removal=Removal(keep=5))),
        ("gpt2", dict(gates=HardConcreteGates(target_warmup=0.5), removal=Removal(keep=5))),
    ],
)
def test_fit_ends_with_a_smaller_model_equal_to_the_gated_one(family, options):
    model = tiny_model(family, head="classification", initializer_range=0.2)
    original = count(model)
    gating = HeadGating(**options)
    hard_concrete = isinstance(options["gates"], HardConcreteGates)
    snapshot, record = Snapshot(gating), Record(gating if hard_concrete else None)
    trainer = fit(Classifier(model), batches(8), [snapshot, gating, record])
    assert "attnreg/head_gating" in trainer.callback_metrics
    assert sum(map(len, gating.method.removed.values())) == 3 and gating.method.report.num_removed == 3
    assert count(model) == original - 3 * PARAMETERS_PER_HEAD
    assert pruning.pruned_heads(model) == {layer: tuple(heads) for layer, heads in gating.method.removed.items()}
    assert attnreg.hub_of(model).gates == {} and not any(GATE in name for name in model.state_dict())
    # the removed heads are those with the smallest gates at the end (|g|, or the deterministic L0 gate)
    hub = attnreg.hub_of(snapshot.model)
    if not hard_concrete:
        scores = {layer: gate.detach().abs() for layer, gate in hub.gates.items()}
    else:
        scores = {layer: pruning.hard_concrete(hub, layer).deterministic().detach() for layer in (0, 1)}
    chosen = pruning.select_heads(scores, keep=5)
    assert gating.method.removed == {layer: heads for layer, heads in chosen.items() if heads}
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(snapshot.model, gating.method.removed), batch)
    assert (outputs(model, batch) - expected).abs().max() <= 1e-5
    if hard_concrete:
        assert "attnreg/head_gating/expected_heads" in trainer.callback_metrics
        assert gating.method.lambdas.abs().sum() > 0
        # the Lagrangian's target moves from where the gates start (8 heads open with P = 0.973 each) to 5
        # over the first half of the 8 steps
        start = 8 * float(pruning.HardConcreteGate(1).expected_l0())
        assert record.targets == pytest.approx({step: start - (start - 5) * min(1.0, step / 4) for step in range(8)})


def test_grouped_query_heads_the_rule_keeps_are_silenced():
    model = tiny_model("llama", head="classification", initializer_range=0.2)
    original = count(model)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=5))
    snapshot = Snapshot(gating)
    with pytest.warns(UserWarning, match="kept requested heads"):  # 3 heads chosen: one group stays
        fit(Classifier(model), batches(6), [snapshot, gating])
    assert sum(map(len, gating.method.removed.values())) == 3
    removed_query = gating.method.report.num_removed
    assert removed_query % 2 == 0 and removed_query < 3  # whole key/value groups only
    assert sum(len(kept) for kept in gating.method.report.kept.values()) == 3 - removed_query
    # a query head costs its q_proj rows and o_proj columns, a key/value group its k_proj and v_proj rows
    assert count(model) == original - removed_query * 2 * 8 * 32 - removed_query // 2 * 2 * 8 * 32
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(snapshot.model, gating.method.removed), batch)
    assert (outputs(model, batch) - expected).abs().max() <= 1e-5


def test_l1_threshold_removes_exactly_the_small_gates():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    gating = HeadGating(gates=L1Gates(weight=2.0, normalize=False), removal=Removal(threshold=0.8))
    snapshot = Snapshot(gating)
    fit(Classifier(model, lr=0.05), batches(6), [snapshot, gating])
    gates = attnreg.hub_of(snapshot.model).gates
    small = {layer: [h for h, g in enumerate(gate.tolist()) if abs(g) < 0.8] for layer, gate in gates.items()}
    small = {layer: heads for layer, heads in small.items() if heads}
    assert small and gating.method.removed == small


def test_pruning_mid_training_goes_on_with_the_schedule():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=5, after_steps=3))
    trainer = fit(Classifier(model, decay=0.9), batches(6), [gating])
    assert (
        gating.method.pruned
        and trainer.global_step == 6
        and count(model) == count(tiny_model("bert", head="classification")) - 3 * PARAMETERS_PER_HEAD
    )
    optimizer = trainer.optimizers[0]
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]  # gates dropped
    query = model.bert.encoder.layer[0].attention.self.query.weight
    assert optimizer.state[query]["step"] == 6 and optimizer.state[query]["exp_avg"].shape == query.shape
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**6)


def test_adam_state_of_kept_heads_is_the_sliced_state_at_pruning():
    model = tiny_model("gpt2", head="classification", initializer_range=0.2)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=6, after_steps=2))

    class After(L.Callback):
        state = None

        def on_train_batch_end(self, trainer, pl_module, *args):
            if gating.method.pruned and self.state is None:
                optimizer = trainer.optimizers[0]
                self.state = {n: copy.deepcopy(optimizer.state[p]) for n, p in pl_module.model.named_parameters()}

    before, after = Snapshot(gating, at_step=2), After()
    fit(Classifier(model), batches(4), [before, gating, after])
    for layer in (0, 1):
        kept = [h for h in range(4) if h not in gating.method.removed.get(layer, [])]
        columns = (torch.tensor(kept)[:, None] * 8 + torch.arange(8)).reshape(-1)
        fused = torch.cat([columns, 32 + columns, 64 + columns])
        c_attn = f"transformer.h.{layer}.attn.c_attn.weight"
        c_proj = f"transformer.h.{layer}.attn.c_proj.weight"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after.state[c_attn][key], before.optimizer_state[c_attn][key][:, fused])
            assert torch.equal(after.state[c_proj][key], before.optimizer_state[c_proj][key][columns])


def test_resume_from_a_checkpoint_taken_after_pruning(tmp_path):
    options = dict(gates=HardConcreteGates(), removal=Removal(keep=5, after_steps=3))
    gating = HeadGating(**options)
    module = Classifier(tiny_model("bert", head="classification"), decay=0.9)
    trainer = make_trainer(tmp_path, 5, enable_checkpointing=False, callbacks=[gating])
    trainer.fit(module, DataLoader(batches(8), batch_size=None))
    path = tmp_path / "pruned.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint[pruning.PRUNED_HEADS] == {str(k): v for k, v in gating.method.removed.items()}

    class Check(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # weights restored, optimizer not yet
            state = pl_module.state_dict()
            assert state.keys() == checkpoint["state_dict"].keys()
            assert all(torch.equal(state[k], checkpoint["state_dict"][k]) for k in state)

        def on_train_start(self, trainer, pl_module):  # optimizer and scheduler restored
            restored = trainer.optimizers[0].state_dict()["state"]
            saved = checkpoint["optimizer_states"][0]["state"]
            assert restored.keys() == saved.keys()
            assert all(torch.equal(restored[i]["exp_avg"], saved[i]["exp_avg"]) for i in saved)

    resumed_gating = HeadGating(**options)
    fresh = Classifier(tiny_model("bert", head="classification", seed=7), decay=0.9)
    resumed = make_trainer(tmp_path, 7, enable_checkpointing=False, callbacks=[Check(), resumed_gating])
    resumed.fit(fresh, DataLoader(batches(8), batch_size=None), ckpt_path=path)
    assert resumed.global_step == 7 and resumed_gating.method.pruned
    assert pruning.pruned_heads(fresh.model) == pruning.pruned_heads(module.model)
    assert count(fresh.model) == count(module.model)
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**7)
    assert "head_gating" not in fresh.attnreg_terms


def test_resume_from_a_checkpoint_taken_while_gating(tmp_path):
    options = dict(gates=HardConcreteGates(), removal=Removal(keep=4))
    every_two = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[HeadGating(**options), every_two],
    )
    trainer.fit(Classifier(tiny_model("bert", head="classification")), DataLoader(batches(8), batch_size=None))
    path = tmp_path / "epoch=0-step=2.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert any(key.endswith("attnreg_gate.log_alpha") for key in checkpoint["state_dict"])

    class Check(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # gates and weights restored
            state = pl_module.state_dict()
            assert state.keys() == checkpoint["state_dict"].keys()
            assert all(torch.equal(state[k], checkpoint["state_dict"][k]) for k in state)

    resumed_gating = HeadGating(**options)
    fresh = Classifier(tiny_model("bert", head="classification", seed=3))
    resumed = make_trainer(tmp_path, 4, enable_checkpointing=False, callbacks=[Check(), resumed_gating])
    resumed.fit(fresh, DataLoader(batches(8), batch_size=None), ckpt_path=path)
    assert resumed.global_step == 4 and resumed_gating.method.pruned
    assert sum(map(len, resumed_gating.method.removed.values())) == 4
    assert count(fresh.model) == count(tiny_model("bert", head="classification")) - 4 * PARAMETERS_PER_HEAD


def test_removal_after_epochs_and_a_weight_schedule_of_progress(tmp_path):
    gating = HeadGating(gates=L1Gates(weight=Warmup(0.5, Constant(0.5))), removal=Removal(keep=6, after_epochs=1))
    # 3 batches an epoch: two epochs, 6 estimated steps
    trainer = make_trainer(tmp_path, 6, enable_checkpointing=False, callbacks=[gating])
    trainer.fit(Classifier(tiny_model("bert", head="classification")), DataLoader(batches(3), batch_size=None))
    assert gating.method.pruned and gating.method.pruned_at_step == 3 and trainer.global_step == 6
    # the last logged penalty (step 2, progress 1/3): 0.5 ramped over half of training to 1/3, times the
    # mean |g|, near 1 after 3 steps
    assert float(trainer.callback_metrics["attnreg/head_gating"]) == pytest.approx(1 / 3, rel=0.05)


def test_a_weight_given_as_a_function_of_progress():
    gating = HeadGating(gates=L1Gates(weight=lambda progress: 0.2 * progress), removal=Removal(keep=8))

    class Weights(L.Callback):
        used = []

        def on_train_batch_start(self, trainer, pl_module, *args):
            self.used.append(gating.current_weight())

    fit(Classifier(tiny_model("bert", head="classification")), batches(4), [gating, Weights()])
    assert gating.method.length.total == 4 and Weights.used == pytest.approx([0.0, 0.05, 0.1, 0.15])  # steps 0-3 of 4
    negative = HeadGating(gates=L1Gates(weight=lambda progress: -1.0))
    with pytest.raises(ValueError, match=r"HeadGating weight at step 0: weight must be a finite number >= 0"):
        fit(Classifier(tiny_model("bert", head="classification")), batches(1), [negative])


def test_progressive_pruning_at_milestones_keeps_training_and_adam_state():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    original = count(model)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(milestones=[(0.25, 6), (0.5, 4), (0.75, 3)]))
    assert gating.method.removal.keep == 3

    class AfterRound(L.Callback):  # placed after HeadGating: the model and optimizer right after round 2
        model = state = None

        def on_train_batch_end(self, trainer, pl_module, *args):
            if len(gating.method.rounds) == 2 and self.state is None:
                optimizer = trainer.optimizers[0]
                self.state = {n: copy.deepcopy(optimizer.state[p]) for n, p in pl_module.model.named_parameters()}
                self.model = copy.deepcopy(pl_module.model)

    before_round_2, before_final = Snapshot(gating, at_step=4), Snapshot(gating, at_step=6)
    after_round_2, at_final, record = AfterRound(), AtFinalRound(gating), Record()
    trainer = fit(
        Classifier(model), batches(8), [before_round_2, before_final, gating, after_round_2, at_final, record]
    )
    assert trainer.global_step == 8 and [r.step for r in gating.method.rounds] == [2, 4, 6]
    assert [r.final for r in gating.method.rounds] == [False, False, True] and gating.method.pruned_at_step == 6
    # the model shrinks at each milestone and keeps training at its new size (with one gate per head
    # until the last round folds them)
    kept_after = {1: 8, 2: 6, 3: 6, 4: 4, 5: 4, 6: 3, 7: 3, 8: 3}
    assert record.counts == {
        step: original - (8 - kept) * PARAMETERS_PER_HEAD + (kept if step < 6 else 0)
        for step, kept in kept_after.items()
    }
    assert [sum(heads for heads, _ in r.report.heads.values()) for r in gating.method.rounds] == [6, 4, 3]
    assert sum(map(len, gating.method.removed.values())) == 5 and count(model) == original - 5 * PARAMETERS_PER_HEAD
    assert attnreg.hub_of(model).gates == {} and not any(GATE in name for name in model.state_dict())
    assert "head_gating" not in trainer.lightning_module.attnreg_terms
    # round 2 removed the 2 lowest |g| of the 6 heads left, and sliced (did not reset) the Adam moments
    # of the kept heads, the gates' included: gates go on training between milestones
    hub = attnreg.hub_of(before_round_2.model)
    scores = {layer: gate.detach().abs() for layer, gate in hub.gates.items()}
    chosen = pruning.to_original_numbers(before_round_2.model, pruning.select_heads(scores, keep=4))
    assert gating.method.rounds[1].chosen == {layer: heads for layer, heads in chosen.items() if heads}
    for layer in (0, 1):
        numbers = pruning.head_numbers(before_round_2.model, layer)
        kept = [i for i, head in enumerate(numbers) if head not in gating.method.rounds[1].chosen.get(layer, [])]
        rows = (torch.tensor(kept, dtype=torch.long)[:, None] * 8 + torch.arange(8)).reshape(-1)
        query = f"bert.encoder.layer.{layer}.attention.self.query.weight"
        output = f"bert.encoder.layer.{layer}.attention.output.dense.weight"
        gate = f"bert.encoder.layer.{layer}.attention.self.{GATE}"
        if not kept:
            assert gate not in after_round_2.state  # a layer left without heads loses its gate
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after_round_2.state[query][key], before_round_2.optimizer_state[query][key][rows])
            assert torch.equal(after_round_2.state[output][key], before_round_2.optimizer_state[output][key][:, rows])
            assert torch.equal(after_round_2.state[gate][key], before_round_2.optimizer_state[gate][key][kept])
        assert torch.equal(attnreg.hub_of(after_round_2.model).gates[layer], hub.gates[layer][kept])
    # the last round folds the gates: the pruned model equals the gated one with the chosen gates at 0
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(before_final.model, gating.method.rounds[2].chosen), batch)
    assert (outputs(at_final.model, batch) - expected).abs().max() <= 1e-5


def test_progressive_grouped_query_rounds_choose_silenced_heads_again():
    model = tiny_model("llama", head="classification", initializer_range=0.2)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(milestones=[(0.25, 5), (0.75, 3)]))
    snapshot, at_final = Snapshot(gating, at_step=3), AtFinalRound(gating)
    with pytest.warns(UserWarning, match="kept requested heads"):
        fit(Classifier(model), batches(4), [snapshot, gating, at_final])
    first, last = gating.method.rounds
    assert sum(map(len, first.chosen.values())) == 3  # 8 heads down to 5
    silenced = {layer: heads for layer, heads in first.report.kept.items() if heads}
    assert silenced  # 3 of 4 groups of 2 heads chosen: one group keeps a head, and the other is silenced
    for layer, heads in silenced.items():  # chosen again in the last round, whatever their gates learned
        assert set(heads) <= set(last.chosen[layer])
    assert sum(map(len, gating.method.removed.values())) == 5  # 3 heads left doing anything
    removed_query = sum(len(heads) for heads in pruning.pruned_heads(model).values())
    assert removed_query % 2 == 0 and 8 - removed_query >= 3
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(snapshot.model, gating.method.removed), batch)
    assert (outputs(at_final.model, batch) - expected).abs().max() <= 1e-5


def test_resume_between_milestones(tmp_path):
    options = dict(gates=HardConcreteGates(), removal=Removal(milestones=[(0.25, 6), (0.75, 4)]))
    every_four = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    gating = HeadGating(**options)
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[gating, every_four],
    )
    module = Classifier(tiny_model("bert", head="classification"))
    trainer.fit(module, DataLoader(batches(8), batch_size=None))
    checkpoint = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=False)  # after round 1 of 2
    assert checkpoint[pruning.PRUNED_HEADS] == {str(k): v for k, v in gating.method.rounds[0].chosen.items()}
    resumed_gating = HeadGating(**options)
    fresh = Classifier(tiny_model("bert", head="classification", seed=3))
    resumed = make_trainer(tmp_path, 8, enable_checkpointing=False, callbacks=[resumed_gating])
    resumed.fit(fresh, DataLoader(batches(8), batch_size=None), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert [r.step for r in resumed_gating.method.rounds] == [6] and resumed_gating.method.pruned
    assert sum(map(len, resumed_gating.method.removed.values())) == 4
    assert (
        count(fresh.model)
        == count(module.model)
        == count(tiny_model("bert", head="classification")) - 4 * (PARAMETERS_PER_HEAD)
    )


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="gates must be L1Gates or HardConcreteGates"):
        HeadGating(gates="l2")
    with pytest.raises(ValueError, match="stretch"):
        HeadGating(gates=HardConcreteGates(stretch=(0.1, 1.1)))
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        HeadGating(gates=L1Gates(weight=-0.1))
    with pytest.raises(ValueError, match="target_warmup must be a fraction"):
        HeadGating(gates=HardConcreteGates(target_warmup=1.0), removal=Removal(keep=3))
    with pytest.raises(ValueError, match=r"rise in progress and fall in heads kept; \(0.4, 6\) follows \(0.5, 7\)"):
        HeadGating(removal=Removal(milestones=[(0.5, 7), (0.4, 6)]))
    with pytest.raises(ValueError, match=r"progress must be in \(0, 1\]"):
        HeadGating(removal=Removal(milestones=[(0.0, 7)]))
    with pytest.raises(ValueError, match="keep=4 disagrees with the last milestone's 3 heads"):
        HeadGating(removal=Removal(milestones=[(0.5, 3)], keep=4))
    with pytest.raises(ValueError, match="not both"):
        HeadGating(removal=Removal(milestones=[(0.5, 3)], after_steps=2))
    model = tiny_model("bert", head="classification")
    with pytest.raises(ValueError, match=r"keep=9 heads, but the gated layers \[0, 1\] have only 8"):
        fit(Classifier(model), batches(1), [HeadGating(removal=Removal(keep=9))])
    assert count(model) == count(tiny_model("bert", head="classification"))
    with pytest.raises(ValueError, match=r"the first milestone keeps 9 heads, but the gated layers \[0, 1\]"):
        fit(Classifier(model), batches(1), [HeadGating(removal=Removal(milestones=[(0.5, 9), (0.7, 2)]))])
    assert count(model) == count(tiny_model("bert", head="classification"))


def test_head_importance_callback_scores_and_prunes():
    model = tiny_model("bert", head="classification", initializer_range=0.3)
    data = batches(2, seed=20)
    importance = HeadImportance(
        data, metric_fn=lambda m: float(torch.exp(-m(**data[0]).loss)), fraction=0.25, stop_ratio=0.5
    )
    snapshot = Snapshot(HeadGating())
    fit(Classifier(model), batches(3), [snapshot, importance])
    expected = pruning.head_importance(snapshot.model, data)
    assert all(torch.allclose(importance.method.scores[layer], expected[layer]) for layer in expected)
    curve = importance.method.curve
    assert curve[0].heads_removed == 0 and len(curve) >= 2
    good = [step for step in curve if step.metric >= 0.5 * curve[0].metric]
    assert pruning.pruned_heads(model) == good[-1].removed


def test_protected_heads_stay_whatever_their_gates_and_the_prior_keeps_its_head():
    """keep=1 with one protected head: that head is the one kept, so the syntax prior on it never loses it."""
    import warnings

    model = tiny_model("bert", head="classification", initializer_range=0.2)
    prior = attnreg.SyntaxPriorKL(weight=1.0, heads={0: [1]})
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=1, protect={0: [1]}))
    data = batches(4)
    for batch in data:
        length = batch["input_ids"].shape[1]
        parents = (torch.arange(length) - 1).expand(len(batch["input_ids"]), length)
        batch["attnreg_prior"] = parents.masked_fill(batch["attention_mask"] == 0, -1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was pruned")  # the term would say it lost its head
        fit(Classifier(model), data, [prior, gating])
    assert gating.method.removed == {0: [0, 2, 3], 1: [0, 1, 2, 3]}
    assert pruning.head_numbers(model, 0) == (1,)


def test_protect_is_checked_against_the_model_and_the_head_count():
    with pytest.raises(ValueError, match="protect holds 2 heads, more than keep=1"):
        Removal(milestones=[(0.5, 4), (0.8, 1)], protect={0: [0, 1]})
    with pytest.raises(ValueError, match=r"protect\[0\] must list head numbers"):
        Removal(protect={0: [-1]})
    with pytest.raises(TypeError, match="protect must map layers"):
        Removal(protect=[0, 1])
    model = tiny_model("bert", head="classification")
    with pytest.raises(ValueError, match=r"protect names heads \[7\] of layer 1, which has heads \[0, 1, 2, 3\]"):
        fit(Classifier(model), batches(1), [HeadGating(removal=Removal(keep=2, protect={1: [7]}))])
    with pytest.raises(ValueError, match="protect names layer 0, not a gated layer"):
        fit(Classifier(model), batches(1), [HeadGating(layers=[1], removal=Removal(keep=2, protect={0: [1]}))])


def test_choose_keeps_a_protected_head_even_with_the_smallest_gate():
    from attnreg.methods import HeadGating as GatingMethod

    gating = GatingMethod(L1Gates(), Removal(keep=2, protect={0: [1]}))
    gating.bind(tiny_model("bert", head="classification"), taken=set())
    with torch.no_grad():
        gating.hub.gate(0).copy_(torch.tensor([0.9, 0.0, 0.2, 0.1]))  # the protected head scores lowest
        gating.hub.gate(1).copy_(torch.tensor([0.3, 0.8, 0.4, 0.5]))
    # kept: L0H1 (protected) and L0H0 (the best gate); without protect, L0H0 and L1H1
    assert gating.choose(keep=2) == {0: [2, 3], 1: [0, 1, 2, 3]}
