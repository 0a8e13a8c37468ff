"""The hard-concrete Lagrangian (CoFi's, Xia et al. 2022) of `HeadGating(HardConcreteGates(...), Removal(keep=K))`:
its target schedule, multipliers trained by gradient ascent with their own Adam, log-alpha kept within
bounds, a short run on a tiny model that ends at its target, and exact resuming of the multipliers."""

import copy
import json

import lightning as L
import pytest
import torch
from conftest import Classifier, trainer
from torch.utils.data import DataLoader

from attnreg.callbacks.pruning import HeadGating as GatingCallback
from attnreg.methods import HardConcreteGates, HeadGating, L1Gates, Removal, pruning
from attnreg.tiny import tiny_model


def batches(count, seed=0, size=8, length=10):
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        ids = torch.randint(3, 99, (size, length), generator=generator)
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": (ids[:, 3] > 50).long()})
    return items


def bound(gates=None, keep=4, steps=100, **model_options):
    """A HeadGating bound to a tiny BERT (2 layers x 4 heads unless told), its training length fixed."""
    gating = HeadGating(gates or HardConcreteGates(), Removal(keep=keep))
    gating.bind(tiny_model("bert", head="classification", **model_options), taken=set())
    gating.start(estimated_steps=steps)
    return gating


def set_log_alpha(gating, value):
    with torch.no_grad():
        for layer in gating.gated_layers:
            pruning.hard_concrete(gating.hub, layer).log_alpha.fill_(value)


def train(gating, data, gate_lr=0.1, lr=1e-3):
    """Plain PyTorch training as an adapter drives the method: the term on every batch, the dual step
    before every optimizer step. Returns the expected number of open heads after each step."""
    model = gating.model.train()
    gates = pruning.gate_parameters(model)
    ids = {id(p) for p in gates}
    rest = [p for p in model.parameters() if id(p) not in ids]
    optimizer = torch.optim.Adam([{"params": rest, "lr": lr}, {"params": gates, "lr": gate_lr}])
    counts = []
    for step, batch in enumerate(data):
        value, figures = gating.term(None, batch, step)
        (model(**batch).loss + value).backward()
        gating.dual_step()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(float(figures[f"{gating.name}/expected_heads"]))
    return counts


# -- the target ----------------------------------------------------------------------------------------------------
def test_target_falls_linearly_from_the_initial_expected_count_to_keep_then_stays():
    gating = bound(HardConcreteGates(target_warmup=0.4, initial_log_alpha=2.0), keep=3, steps=50)
    start = gating.initial_heads()
    set_log_alpha(gating, 2.0)
    expected = float(torch.cat([pruning.hard_concrete(gating.hub, i).expected_l0().detach() for i in (0, 1)]).sum())
    assert start == pytest.approx(expected) and 7 < start < 8  # 8 heads, each open with P = 0.973
    for step in range(51):
        assert gating.target(step) == pytest.approx(start - (start - 3) * min(1.0, step / 20))
    assert bound(HardConcreteGates(target_warmup=0.0), keep=3).target(0) == 3  # no warmup: K from the start
    # a head count above where the gates start is the target from the start
    assert bound(HardConcreteGates(target_warmup=0.5), keep=8).target(0) == 8


# -- the multipliers ---------------------------------------------------------------------------------------------
def test_multipliers_are_trained_by_gradient_ascent_with_their_own_adam():
    gating = bound(HardConcreteGates(lagrangian_lr=0.1), keep=2)
    model = gating.model
    assert gating.multipliers.requires_grad and not any(p is gating.multipliers for p in model.parameters())
    assert all(p is not gating.multipliers for p in pruning.gate_parameters(model))
    assert gating.dual_optimizer.defaults["maximize"] and gating.dual_optimizer.defaults["lr"] == 0.1

    # too many heads open (8 expected against 2): l1 and l2 rise, and the penalty pushes the gates shut
    set_log_alpha(gating, 3.0)
    value, _ = gating.term(None, None, step=0)
    gap = gating._gaps[-1].item()
    assert gap > 0
    gating.dual_step()
    assert torch.allclose(gating.lambdas, torch.tensor([0.1, 0.1]))  # Adam's first step: lr x the gradient's sign
    probe = copy.deepcopy(gating)
    value, _ = probe.term(None, None, step=1)
    value.backward()
    for layer in (0, 1):
        assert (pruning.hard_concrete(probe.hub, layer).log_alpha.grad > 0).all()  # descent closes every gate

    # the same steps by hand: Adam ascent on the gradient of the Lagrangian in (l1, l2), [g, g^2]
    reference = torch.zeros(2, requires_grad=True)
    adam = torch.optim.Adam([reference], lr=0.1)
    reference.grad = -torch.tensor([gap, gap**2])  # ascent = descent on minus the gradient
    adam.step()
    set_log_alpha(gating, -3.0)  # now too few: l1 falls, l2 still rises (its gradient g^2 is never negative)
    before = gating.lambdas
    for step in range(2, 42):
        gating.term(None, None, step)
        gap = gating._gaps[-1].item()
        gating.dual_step()
        reference.grad = -torch.tensor([gap, gap**2])
        adam.step()
        assert gap < 0
    assert torch.equal(gating.lambdas, reference.detach())
    assert gating.lambdas[0] < before[0] and gating.lambdas[1] > before[1]  # (after Adam's momentum has turned)


def test_the_dual_step_averages_the_micro_batches_of_one_optimizer_step():
    one, accumulated = bound(), bound()
    for gating in (one, accumulated):
        set_log_alpha(gating, 3.0)
    one.term(None, None, 0)
    accumulated.term(None, None, 0)
    accumulated.term(None, None, 0)
    one.dual_step()
    accumulated.dual_step()
    assert torch.equal(one.lambdas, accumulated.lambdas) and accumulated._gaps == []
    accumulated.dual_step()  # no micro-batch since: no step
    assert torch.equal(one.lambdas, accumulated.lambdas)


def test_l1_gates_and_plain_l0_penalties_have_no_multipliers():
    for gates, removal in ((L1Gates(), Removal(keep=2)), (HardConcreteGates(weight=0.1), Removal())):
        gating = HeadGating(gates, removal)
        gating.bind(tiny_model("bert", head="classification"), taken=set())
        gating.start(10)
        assert not gating.lagrangian
        gating.term(None, None, 0)
        gating.dual_step()
        assert torch.equal(gating.lambdas, torch.zeros(2))


# -- log-alpha bounds ----------------------------------------------------------------------------------------------
def test_log_alpha_is_clamped_to_its_bounds_at_every_dual_step():
    gating = bound(HardConcreteGates(log_alpha_bounds=(-2.0, 3.0)))
    gate = pruning.hard_concrete(gating.hub, 0)
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor([-9.0, 0.5, 2.0, 9.0]))
    gating.dual_step()
    assert gate.log_alpha.tolist() == [-2.0, 0.5, 2.0, 3.0]
    free = bound(HardConcreteGates(log_alpha_bounds=None))
    set_log_alpha(free, 9.0)
    free.dual_step()
    assert (pruning.hard_concrete(free.hub, 0).log_alpha == 9.0).all()
    with pytest.raises(ValueError, match="log_alpha_bounds must be"):
        HardConcreteGates(log_alpha_bounds=(1.0, -1.0))


# -- a short run on a tiny model ---------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and a loaded machine stalls several)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_lagrangian_ends_at_its_target_on_a_tiny_model(one_thread):
    torch.manual_seed(0)
    keep = 6
    gating = bound(HardConcreteGates(target_warmup=0.5), keep=keep, steps=120, layers=4, heads=4, hidden=32)
    counts = train(gating, batches(120))  # counts[i]: after optimizer step i, i.e. at step i + 1
    assert counts[0] > 15  # 16 heads, nearly all open at the start
    # the count follows the falling target within 2.5 heads, and ends within a head of K and stays there
    assert max(abs(count - gating.target(step + 1)) for step, count in enumerate(counts)) <= 2.5
    assert abs(counts[-1] - keep) <= 1.0
    assert max(abs(count - keep) for count in counts[-40:]) <= 1.0
    assert min(counts) >= keep - 1.0  # no overshoot past the target
    assert gating.lambdas[1] > 0  # the quadratic term's multiplier, which only grows, holds it there


# -- checkpoints -----------------------------------------------------------------------------------------------------
def test_method_state_restores_the_multipliers_and_their_adam_exactly_through_json():
    gating = bound(HardConcreteGates(lagrangian_lr=0.05), keep=3)
    set_log_alpha(gating, 2.0)
    for step in range(5):
        gating.term(None, None, step)
        gating.dual_step()
    state = json.loads(json.dumps(gating.state_dict()))  # as the Hugging Face adapter writes it
    resumed = bound(HardConcreteGates(lagrangian_lr=0.05), keep=3)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.lambdas, gating.lambdas)
    saved = gating.dual_optimizer.state[gating.multipliers]
    restored = resumed.dual_optimizer.state[resumed.multipliers]
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    set_log_alpha(resumed, 2.0)
    for step in range(5, 12):  # the same gaps give the same multipliers, step for step
        for method in (gating, resumed):
            method.term(None, None, step)
            method.dual_step()
        assert torch.equal(resumed.lambdas, gating.lambdas)


def test_a_lightning_checkpoint_resumes_the_multipliers_and_their_adam_exactly(tmp_path):
    options = dict(gates=HardConcreteGates(target_warmup=0.5, lagrangian_lr=0.05), removal=Removal(keep=4))
    every_two = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    gating = GatingCallback(**options)
    seen = {}

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            state = copy.deepcopy(gating.method.dual_optimizer.state[gating.method.multipliers])
            seen[trainer.global_step] = (gating.method.lambdas, state)

    first = trainer(tmp_path, 4, [gating, Watch(), every_two])
    first.fit(Classifier(tiny_model("bert", head="classification")), DataLoader(batches(4), batch_size=None))
    lambdas, state = seen[2]
    assert lambdas.abs().sum() > 0 and state["step"] == 2

    resumed_gating = GatingCallback(**options)
    checked = []

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            restored = resumed_gating.method.dual_optimizer.state[resumed_gating.method.multipliers]
            assert torch.equal(resumed_gating.method.lambdas, lambdas)
            assert restored.keys() == state.keys() and all(torch.equal(restored[k], state[k]) for k in state)
            checked.append(True)

    again = trainer(tmp_path, 4, [resumed_gating, Check()])
    fresh = Classifier(tiny_model("bert", head="classification", seed=3))
    again.fit(fresh, DataLoader(batches(4), batch_size=None), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert checked and again.global_step == 4 and resumed_gating.method.pruned
    assert resumed_gating.method.dual_optimizer.state[resumed_gating.method.multipliers]["step"] == 4


def test_state_saved_before_the_multipliers_had_an_optimizer_still_loads():
    old = {**bound().state_dict(), "lambdas": [0.5, 0.25]}
    del old["dual_optimizer"]  # checkpoints written before issue 18
    resumed = bound()
    resumed.load_state_dict(old)
    assert resumed.lambdas.tolist() == [0.5, 0.25] and not resumed.dual_optimizer.state
