"""attnreg in two gloo processes on CPU, against one process on the same global batch.

- torch's FSDP2 (`fully_shard`) through `attnreg.methods.Runner`: losses and all weights (gates included) equal
  one process's; the heads chosen for removal are rank 0's on every rank; a checkpoint taken with
  torch.distributed.checkpoint resumes to the uninterrupted run's weights; the removal at the end gathers the
  model, and rank 0's unsharded copy, saved and loaded back, equals the one-process model pruned in place.
- `AttnRegTrainer` under DDP (torchrun), heads removed during training (a wrapper rebuilt) and at the end.
- Lightning's DDPStrategy with heads removed during training, and Lightning's ModelParallelStrategy (FSDP2 in
  `configure_model`) with a checkpoint, a resume and the removal at the end.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnreg import methods
from attnreg.methods import Loop, Runner
from attnreg.methods.pruning import load_pruned
from attnreg.methods.runner import full_value
from attnreg.tiny import tiny_model

STEPS, CUT, WORLD = 3, 2, 2
IDS = torch.randint(3, 99, (4, 8), generator=torch.Generator().manual_seed(1))


def chosen():
    return [
        methods.EntropyRegularizer(weight=1.0, mode="max"),
        methods.SyntaxPriorKL(heads={1: [0]}, weight=1.0),
        methods.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=6)),
    ]


def batch(ids):
    return {"input_ids": ids, "labels": ids, "attnreg_prior": (torch.arange(ids.shape[1]) - 1).expand(ids.shape)}


def new_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: state a checkpoint must keep


def train(model, runner, rows, loop, optimizer, steps: range) -> list[float]:
    losses = []
    runner.start(STEPS)
    runner.fit_start(loop)
    for step in steps:
        items = batch(rows)
        with runner.capture(model) as captured:
            loss = model(**runner.model_inputs(items)).loss
        total = loss + runner.loss(captured, items, step)
        total.backward()
        runner.before_optimizer_step(loop)
        optimizer.step()
        optimizer.zero_grad()
        loop.step += 1
        losses.append(float(total.detach()))
    return losses


def sharded_run(rank, folder):
    """A llama sharded per block and whole, with the methods bound (gates made) before sharding."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("llama", head="causal_lm").train()
    runner = Runner(chosen())
    runner.bind(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = new_optimizer(model)

    def broadcast(value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    loop = Loop(optimizers=[optimizer], world_size=WORLD, is_main=rank == 0, broadcast=broadcast, output_dir=folder)
    return model, runner, optimizer, loop


def full_weights(model):
    return {name: value.full_tensor().detach().clone() for name, value in model.state_dict().items()}


def worker(rank, port, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        rows = IDS[rank * 2 : (rank + 1) * 2]
        model, runner, optimizer, loop = sharded_run(rank, folder)
        losses = train(model, runner, rows, loop, optimizer, range(CUT))
        weights, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=str(folder / "checkpoint"))
        methods_state = json.loads(json.dumps(runner.state_dict()))  # as the HF adapter writes it
        losses += train(model, runner, rows, loop, optimizer, range(CUT, STEPS))
        losses = torch.tensor(losses)
        dist.all_reduce(losses)
        trained = full_weights(model)
        choice = runner.methods[-1].choose(keep=6)  # from the gathered gates
        agreed = loop.broadcast(choice) == choice
        runner.fit_end(loop)  # the removal: gathered, rank 0 prunes an unsharded copy and saves it
        gating = runner.methods[-1]
        gathered = None if gating.gathered is None else gating.gathered.state_dict()

        model, runner, optimizer, loop = sharded_run(rank, folder)  # a new run resumed from the checkpoint
        weights, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": weights, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(folder / "checkpoint"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        runner.load_state_dict(methods_state)
        loop.step = CUT
        train(model, runner, rows, loop, optimizer, range(CUT, STEPS))
        result = {
            "losses": losses / WORLD,
            "weights": trained,
            "resumed": full_weights(model),
            "choice": agreed,
            "removed": gating.removed,
            "gathered": gathered,
        }
        torch.save(result, folder / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_two_processes_equal_one_process_resume_and_remove_heads_at_the_end(tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("torch was built without gloo")
    mp.spawn(worker, args=(free_port(), tmp_path), nprocs=WORLD)
    model = tiny_model("llama", head="causal_lm").train()
    runner = Runner(chosen())
    runner.bind(model)
    optimizer = new_optimizer(model)
    loop = Loop(optimizers=[optimizer])
    expected = train(model, runner, IDS, loop, optimizer, range(STEPS))
    trained = {name: value.detach().clone() for name, value in model.state_dict().items()}
    runner.fit_end(loop)  # one process: the heads go in place
    removed = runner.methods[-1].removed
    assert sum(map(len, removed.values())) == 2
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        torch.testing.assert_close(result["losses"], torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert result["choice"] and result["removed"] == removed
        assert result["weights"].keys() == trained.keys() == result["resumed"].keys()
        for name, value in trained.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(result["resumed"][name], result["weights"][name], rtol=1e-6, atol=1e-7, msg=name)
    gathered = torch.load(tmp_path / "0.pt", weights_only=False)["gathered"]
    assert torch.load(tmp_path / "1.pt", weights_only=False)["gathered"] is None  # rank 0 alone holds the copy
    saved = load_pruned(tmp_path / "attnreg-pruned").state_dict()
    pruned = model.state_dict()
    assert gathered.keys() == pruned.keys() == saved.keys()
    for name, value in pruned.items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_removal_during_training_under_several_processes_renews_parameters_and_rewraps():
    """One process standing for one of several: the removal during training gives the sliced parameters fresh
    objects, moves the optimizer onto them and asks the loop to rebuild its wrapper, once; where the loop cannot,
    the method refuses at fit start, naming the engine and what works."""
    model = tiny_model("bert", head="classification").train()
    gating = methods.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=6, after_steps=1))
    gating.bind(model, taken=set())
    gating.start(estimated_steps=2)
    with pytest.raises(NotImplementedError, match="Lightning's FSDPStrategy offers attnreg no way to.*at the end"):
        gating.on_fit_start(Loop(world_size=2, engine="Lightning's FSDPStrategy"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {name: (parameter, parameter.shape) for name, parameter in model.named_parameters()}
    rewraps = []
    loop = Loop(optimizers=[optimizer], world_size=2, rewrap=lambda: rewraps.append(1))
    gating.on_fit_start(loop)
    batch = {"input_ids": torch.randint(3, 99, (2, 6)), "labels": torch.tensor([0, 1])}
    (model(**batch).loss + gating.term(None, batch, 0)[0]).backward()
    optimizer.step()
    loop.step = 1
    gating.on_step_end(loop)
    assert rewraps == [1] and gating.pruned and sum(map(len, gating.removed.values())) == 2
    after = dict(model.named_parameters())
    sliced = {name for name, parameter in after.items() if parameter.shape != before[name][1]}
    projections = {f"self.{p}.{w}" for p in ("query", "key", "value") for w in ("weight", "bias")}
    assert {name.split("attention.")[1] for name in sliced} == {*projections, "output.dense.weight"}
    assert all(after[name] is not before[name][0] for name in sliced)  # fresh objects where shapes changed
    assert all(after[name] is before[name][0] for name in after.keys() - sliced)
    grouped = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    assert grouped == {id(parameter) for parameter in model.parameters()}  # gates folded and dropped
    assert all(optimizer.state[after[name]]["momentum_buffer"].shape == after[name].shape for name in sliced)


def test_removal_during_training_of_a_sharded_model_is_refused():
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("llama", head="causal_lm").train()
    gating = methods.HeadGating(methods.L1Gates(), methods.Removal(keep=6, milestones=[(0.5, 6)]))
    gating.bind(model, taken=set())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        fully_shard(model)
        with pytest.raises(NotImplementedError, match="sharded model .FSDP2.*at the end of training"):
            gating.on_fit_start(Loop(rewrap=lambda: None))
        gate = gating.hub.gate(0)  # a DTensor; a term computed on it is added and logged whole
        value = full_value(gate.sum())
        assert type(gate.sum()).__name__ == "DTensor" and type(value) is torch.Tensor and value.item() == 4.0
    finally:
        dist.destroy_process_group()


def launch(script: str, folder: Path, *arguments: str) -> None:
    """`script` (beside this file) in two processes with torchrun, then with `one` in one process."""
    path = Path(__file__).with_name(script)
    env = {**os.environ, "PYTHONPATH": str(path.parent.parent), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={free_port()}"]
    one = [sys.executable, str(path), str(folder), *arguments, "one"]
    for command in ([*torchrun, str(path), str(folder), *arguments], one):
        # in `folder`: what a run writes to its working folder (Lightning's default_root_dir) stays out of the checkout
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=folder)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


def assert_same_weights(result, expected, rtol=1e-4, atol=1e-5):
    assert result.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result[name], value, rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_hugging_face_trainer_under_ddp_removes_heads_during_training_as_one_process(tmp_path):
    """`AttnRegTrainer` in two DDP processes (torchrun, gloo), gradient accumulation, heads removed at two
    milestones, the first mid-training (fresh parameters, accelerate's wrapper rebuilt): both ranks remove rank
    0's choice and end on the weights of one process trained on the same global batches."""
    launch("distributed_hf.py", tmp_path)
    expected = torch.load(tmp_path / "one0.pt")
    assert [sum(map(len, done.values())) for done in expected["rounds"]] == [2, 1]  # of 8 heads, 6 left, then 5
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["rounds"] == expected["rounds"] and result["removed"] == expected["removed"]
        assert result["rewrapped"] == 2  # a new wrapper after each round during training
        assert_same_weights(result["weights"], expected["weights"])


@pytest.mark.slow
@pytest.mark.distributed
def test_hugging_face_trainer_under_ddp_with_rows_of_different_lengths_as_one_process(tmp_path):
    """Two DDP processes with accumulation 2 (micro-batches of 1 row of 2, 5 or 8 real tokens) against one
    process on the global batches of 4: the entropy term is weighed by each micro-batch's share of the step's
    rows over both processes, so the weights agree (issue 38.2: 0.12 apart without it)."""
    launch("distributed_hf.py", tmp_path, "uneven")
    expected = torch.load(tmp_path / "one0.pt")
    for rank in range(WORLD):
        assert_same_weights(torch.load(tmp_path / f"rank{rank}.pt")["weights"], expected["weights"])


@pytest.mark.slow
@pytest.mark.distributed
def test_lightning_ddp_and_model_parallel_strategies_equal_one_process(tmp_path):
    """Lightning in two processes (torchrun, gloo): under DDPStrategy heads go at two milestones during training
    (Lightning's DDP wrapper rebuilt); under ModelParallelStrategy (FSDP2 in `configure_model`) the penalty is
    logged with sync_dist, a distributed checkpoint at step 2 resumes to the uninterrupted weights, and the
    removal at the end leaves rank 0 an unsharded, pruned copy; each equals one process on the same batches."""
    launch("distributed_lightning.py", tmp_path)
    expected = torch.load(tmp_path / "one0.pt", weights_only=False)
    assert [sum(map(len, done.values())) for done in expected["ddp_rounds"]] == [2, 1]
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["ddp_rounds"] == expected["ddp_rounds"] and result["ddp_rewrapped"] == 2
        assert_same_weights(result["ddp_weights"], expected["ddp_weights"])
        assert result["sharded_removed"] == expected["sharded_removed"] == result["resumed_removed"]
        assert_same_weights(result["resumed_weights"], result["sharded_weights"], rtol=1e-6, atol=1e-7)
        assert "attnreg/head_gating" in result["logged"]
    gathered = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert_same_weights(gathered["sharded_pruned"], expected["sharded_pruned"])
    assert_same_weights(gathered["resumed_pruned"], expected["sharded_pruned"])
