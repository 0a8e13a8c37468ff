"""HeadGating and HeadImportance in real Lightning fits: smaller models, optimizer state, resuming."""

import copy

import lightning as L
import pytest
import torch
from conftest import fit, main_output, padded_batch
from torch.utils.data import DataLoader

import attnreg
from attnreg import pruning
from attnreg.callbacks.pruning import HeadGating, HeadImportance
from attnreg.hub import GATE
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
        if self.at_step is not None and trainer.global_step == self.at_step and not self.gating.pruned:
            self._take(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if self.at_step is None:
            self._take(trainer, pl_module)


def close_gates(model, removed):
    """Set the gates of `removed` heads to 0 in a gated copy (hard-concrete: log-alpha to -100)."""
    hub = attnreg.hub_of(model)
    for layer, heads in removed.items():
        found = pruning.hard_concrete(hub, layer)
        tensor = found.log_alpha if found is not None else hub.gate(layer)
        with torch.no_grad():
            tensor[heads] = -100.0 if found is not None else 0.0
    return model


def outputs(model, batch):
    with torch.no_grad():
        return main_output(model.eval()(**{k: v for k, v in batch.items() if k != "labels"}))


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("family", "options"),
    [("bert", dict(kind="l1", weight=0.1, keep=5)), ("gpt2", dict(kind="hard_concrete", keep=5, warmup_steps=4))],
)
def test_fit_ends_with_a_smaller_model_equal_to_the_gated_one(family, options):
    model = tiny_model(family, head="classification", initializer_range=0.2)
    original = count(model)
    gating = HeadGating(**options)
    snapshot = Snapshot(gating)
    trainer = fit(Classifier(model), batches(8), [snapshot, gating])
    assert "attnreg/head_gating" in trainer.callback_metrics
    assert sum(map(len, gating.removed.values())) == 3 and gating.report.num_removed == 3
    assert count(model) == original - 3 * PARAMETERS_PER_HEAD
    assert pruning.pruned_heads(model) == {layer: tuple(heads) for layer, heads in gating.removed.items()}
    assert attnreg.hub_of(model).gates == {} and not any(GATE in name for name in model.state_dict())
    # the removed heads are those with the smallest gates at the end (|g|, or the deterministic L0 gate)
    hub = attnreg.hub_of(snapshot.model)
    if options["kind"] == "l1":
        scores = {layer: gate.detach().abs() for layer, gate in hub.gates.items()}
    else:
        scores = {layer: pruning.hard_concrete(hub, layer).deterministic().detach() for layer in (0, 1)}
    chosen = pruning.select_heads(scores, keep=5)
    assert gating.removed == {layer: heads for layer, heads in chosen.items() if heads}
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(snapshot.model, gating.removed), batch)
    assert (outputs(model, batch) - expected).abs().max() <= 1e-5
    if options["kind"] == "hard_concrete":
        assert "attnreg/head_gating/expected_heads" in trainer.callback_metrics
        assert gating.lambdas.abs().sum() > 0


def test_grouped_query_heads_the_rule_keeps_are_silenced():
    model = tiny_model("llama", head="classification", initializer_range=0.2)
    original = count(model)
    gating = HeadGating(kind="l1", weight=0.1, keep=5)
    snapshot = Snapshot(gating)
    with pytest.warns(UserWarning, match="kept requested heads"):  # 3 heads chosen: one group stays
        fit(Classifier(model), batches(6), [snapshot, gating])
    assert sum(map(len, gating.removed.values())) == 3
    removed_query = gating.report.num_removed
    assert removed_query % 2 == 0 and removed_query < 3  # whole key/value groups only
    assert sum(len(kept) for kept in gating.report.kept.values()) == 3 - removed_query
    # a query head costs its q_proj rows and o_proj columns, a key/value group its k_proj and v_proj rows
    assert count(model) == original - removed_query * 2 * 8 * 32 - removed_query // 2 * 2 * 8 * 32
    batch = batches(1, seed=50)[0]
    expected = outputs(close_gates(snapshot.model, gating.removed), batch)
    assert (outputs(model, batch) - expected).abs().max() <= 1e-5


def test_l1_threshold_removes_exactly_the_small_gates():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    gating = HeadGating(kind="l1", weight=2.0, threshold=0.8, normalize=False)
    snapshot = Snapshot(gating)
    fit(Classifier(model, lr=0.05), batches(6), [snapshot, gating])
    gates = attnreg.hub_of(snapshot.model).gates
    small = {layer: [h for h, g in enumerate(gate.tolist()) if abs(g) < 0.8] for layer, gate in gates.items()}
    small = {layer: heads for layer, heads in small.items() if heads}
    assert small and gating.removed == small


def test_pruning_mid_training_goes_on_with_the_schedule():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    gating = HeadGating(kind="l1", weight=0.1, keep=5, prune_after_steps=3)
    trainer = fit(Classifier(model, decay=0.9), batches(6), [gating])
    assert (
        gating.pruned
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
    gating = HeadGating(kind="l1", weight=0.1, keep=6, prune_after_steps=2)

    class After(L.Callback):
        state = None

        def on_train_batch_end(self, trainer, pl_module, *args):
            if gating.pruned and self.state is None:
                optimizer = trainer.optimizers[0]
                self.state = {n: copy.deepcopy(optimizer.state[p]) for n, p in pl_module.model.named_parameters()}

    before, after = Snapshot(gating, at_step=2), After()
    fit(Classifier(model), batches(4), [before, gating, after])
    for layer in (0, 1):
        kept = [h for h in range(4) if h not in gating.removed.get(layer, [])]
        columns = (torch.tensor(kept)[:, None] * 8 + torch.arange(8)).reshape(-1)
        fused = torch.cat([columns, 32 + columns, 64 + columns])
        c_attn = f"transformer.h.{layer}.attn.c_attn.weight"
        c_proj = f"transformer.h.{layer}.attn.c_proj.weight"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after.state[c_attn][key], before.optimizer_state[c_attn][key][:, fused])
            assert torch.equal(after.state[c_proj][key], before.optimizer_state[c_proj][key][columns])


def resume_trainer(tmp_path, steps, callbacks):
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


def test_resume_from_a_checkpoint_taken_after_pruning(tmp_path):
    options = dict(kind="hard_concrete", keep=5, prune_after_steps=3)
    gating = HeadGating(**options)
    module = Classifier(tiny_model("bert", head="classification"), decay=0.9)
    trainer = resume_trainer(tmp_path, 5, [gating])
    trainer.fit(module, DataLoader(batches(8), batch_size=None))
    path = tmp_path / "pruned.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint[pruning.PRUNED_HEADS] == {str(k): v for k, v in gating.removed.items()}

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
    resumed = resume_trainer(tmp_path, 7, [Check(), resumed_gating])
    resumed.fit(fresh, DataLoader(batches(8), batch_size=None), ckpt_path=path)
    assert resumed.global_step == 7 and resumed_gating.pruned
    assert pruning.pruned_heads(fresh.model) == pruning.pruned_heads(module.model)
    assert count(fresh.model) == count(module.model)
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**7)
    assert "head_gating" not in fresh.attnreg_terms


def test_resume_from_a_checkpoint_taken_while_gating(tmp_path):
    options = dict(kind="hard_concrete", keep=4)
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
    resumed = resume_trainer(tmp_path, 4, [Check(), resumed_gating])
    resumed.fit(fresh, DataLoader(batches(8), batch_size=None), ckpt_path=path)
    assert resumed.global_step == 4 and resumed_gating.pruned
    assert sum(map(len, resumed_gating.removed.values())) == 4
    assert count(fresh.model) == count(tiny_model("bert", head="classification")) - 4 * PARAMETERS_PER_HEAD


def test_prune_after_epochs_and_the_warmup_of_the_weight(tmp_path):
    gating = HeadGating(kind="l1", weight=0.5, warmup_steps=8, keep=6, prune_after_epochs=1)
    trainer = resume_trainer(tmp_path, 6, [gating])  # 3 batches an epoch: two epochs
    trainer.fit(Classifier(tiny_model("bert", head="classification")), DataLoader(batches(3), batch_size=None))
    assert gating.pruned and gating.pruned_at_step == 3 and trainer.global_step == 6
    # the last logged penalty (step 2): weight 0.5 ramped to 2/8, times the mean |g|, near 1 after 3 steps
    assert float(trainer.callback_metrics["attnreg/head_gating"]) == pytest.approx(0.5 * 2 / 8, rel=0.05)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="kind must be 'l1' or 'hard_concrete'"):
        HeadGating(kind="l2")
    with pytest.raises(ValueError, match="stretch"):
        HeadGating(kind="hard_concrete", stretch=(0.1, 1.1))
    model = tiny_model("bert", head="classification")
    with pytest.raises(ValueError, match=r"keep=9 heads, but the gated layers \[0, 1\] have only 8"):
        fit(Classifier(model), batches(1), [HeadGating(keep=9)])
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
    assert all(torch.allclose(importance.scores[layer], expected[layer]) for layer in expected)
    curve = importance.curve
    assert curve[0].heads_removed == 0 and len(curve) >= 2
    good = [step for step in curve if step.metric >= 0.5 * curve[0].metric]
    assert pruning.pruned_heads(model) == good[-1].removed
