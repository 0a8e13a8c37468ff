"""attnreg under torch's FSDP2 (`fully_shard`), two gloo processes on CPU: the methods run unchanged through
`attnreg.methods.Runner` and every rank ends where a one-process run on the same global batch ends (losses and
all weights, gates included); the heads chosen for removal are rank 0's on every rank."""

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
from attnreg.tiny import tiny_model

STEPS, WORLD = 3, 2
IDS = torch.randint(3, 99, (4, 8), generator=torch.Generator().manual_seed(1))


def chosen():
    return [
        methods.EntropyRegularizer(weight=1.0, mode="max"),
        methods.SyntaxPriorKL(heads={1: [0]}, weight=1.0),
        methods.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=8)),
    ]


def batch(ids):
    return {"input_ids": ids, "labels": ids, "attnreg_prior": (torch.arange(ids.shape[1]) - 1).expand(ids.shape)}


def train(model, runner, rows, loop, optimizer) -> list[float]:
    losses = []
    runner.start(STEPS)
    runner.fit_start(loop)
    for step in range(STEPS):
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


def worker(rank, port, folder):
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = tiny_model("llama", head="causal_lm").train()
        runner = Runner(chosen())
        runner.bind(model)  # gates exist before sharding
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def broadcast(value):
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        loop = Loop(optimizers=[optimizer], world_size=WORLD, is_main=rank == 0, broadcast=broadcast)
        rows = IDS[rank * 2 : (rank + 1) * 2]
        losses = torch.tensor(train(model, runner, rows, loop, optimizer))
        dist.all_reduce(losses)
        weights = {name: value.full_tensor().detach() for name, value in model.state_dict().items()}
        choice = runner.methods[-1].choose(keep=6)  # from the gathered gates
        torch.save(
            {"losses": losses / WORLD, "weights": weights, "choice": broadcast(choice) == choice}, folder / f"{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_two_processes_equal_one_process_on_the_global_batch(tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("torch was built without gloo")
    mp.spawn(worker, args=(free_port(), tmp_path), nprocs=WORLD)
    model = tiny_model("llama", head="causal_lm").train()
    runner = Runner(chosen())
    runner.bind(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = train(model, runner, IDS, Loop(optimizers=[optimizer]), optimizer)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"{rank}.pt")
        torch.testing.assert_close(result["losses"], torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert result["choice"]
        for name, value in model.state_dict().items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_hugging_face_trainer_under_ddp_equals_one_process(tmp_path):
    """`AttnRegTrainer` in two DDP processes (torchrun, gloo): both ranks remove rank 0's choice of heads and end
    on the same weights as one process trained on the same global batches."""
    script = Path(__file__).with_name("distributed_hf.py")
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={free_port()}"]
    run = subprocess.run([*launch, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    one = subprocess.run([sys.executable, str(script), str(tmp_path), "one"], env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    expected = torch.load(tmp_path / "one0.pt")
    assert sum(map(len, expected["removed"].values())) == 3
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["removed"] == expected["removed"]
        assert result["weights"].keys() == expected["weights"].keys()
        for name, value in expected["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
