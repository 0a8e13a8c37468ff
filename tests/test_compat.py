"""The private names of torch, transformers and Lightning that attnreg uses (`attnreg.compat`) still exist
and still mean what attnreg reads from them; a new version that moves one fails here, naming it."""

import inspect
import os
import socket
from contextlib import contextmanager
from types import SimpleNamespace

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import PreTrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from attnreg import compat
from attnreg.tiny import tiny_model


def test_torch_names():
    assert callable(torch._C._current_graph_task_id), "torch._C._current_graph_task_id moved"
    seen = []
    leaf = torch.ones(1, requires_grad=True)
    out = leaf * 2
    out.register_hook(lambda grad: seen.append(compat.graph_task_id()))
    out.sum().backward()
    assert compat.graph_task_id() == -1 and seen and seen[0] != -1  # -1 outside backward, an id inside
    module = torch.nn.Linear(2, 2)
    handle = module.register_forward_pre_hook(lambda m, args: None)
    assert handle.id in compat.forward_pre_hooks(module)
    compat.assert_in_graph(torch.tensor(True), "holds")  # torch._assert_async: passes a true value ...
    try:
        compat.assert_in_graph(torch.tensor(False), "the prior's row")
    except RuntimeError as error:
        assert "the prior's row" in str(error)  # ... and raises with the message on a false one
    else:
        raise AssertionError("torch._assert_async no longer raises on False")
    with_kwargs = module.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    assert with_kwargs.id in compat.forward_pre_hooks_with_kwargs(module)
    module.register_load_state_dict_pre_hook(lambda *args: None)
    assert len(compat.load_state_dict_pre_hooks(module)) == 1
    assert compat.parameters_of(module)["weight"] is module.weight
    module.register_buffer("scale", torch.ones(2))
    assert compat.buffers_of(module)["scale"] is module.scale


def test_transformers_names():
    model = tiny_model("bert")
    assert "_attn_implementation" in dir(PreTrainedConfig) or hasattr(model.config, "_attn_implementation")
    assert compat.attention_implementation(model.config) == "sdpa"
    model.set_attn_implementation("eager")
    assert compat.attention_implementation(model.config) == "eager"
    assert callable(PreTrainedModel._can_set_attn_implementation)
    assert compat.interface_capable(model)
    assert callable(Trainer._set_signature_columns_if_needed), "Trainer._set_signature_columns_if_needed moved"


class Rows(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return {"input_ids": torch.tensor([5, 6]), "labels": torch.tensor(0), "extra": "kept"}


def test_trainer_keeps_the_columns_asked_for(tmp_path):
    class Keeping(compat.KeepColumns, Trainer):
        def kept_columns(self):
            return ("extra",)

    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, remove_unused_columns=True)
    trainer = Keeping(model=tiny_model("bert", head="classification"), args=args, train_dataset=Rows())
    trainer._set_signature_columns_if_needed()
    assert "extra" in trainer._signature_columns and "input_ids" in trainer._signature_columns


def test_lightning_names():
    module = L.LightningModule()
    assert compat.lightning_trainer(module) is None
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=0)
    module.trainer = trainer
    assert compat.lightning_trainer(module) is trainer
    callback = L.Callback()
    assert compat.callback_state_key(callback, layers=[1]) == "Callback{'layers': [1]}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def one_process_group():
    """A gloo process group of one process (DDP needs one, even alone); afterwards it is gone, and so are the
    variables Lightning's DDP puts in the environment (LOCAL_RANK, WORLD_SIZE, ...: later tests would take them
    for a distributed launch)."""
    environment = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


class Rebuilt(L.LightningModule):
    """Rebuilds Lightning's DDP wrapper after step 1 and records the wrapper each step ran through."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.wrappers = []

    def training_step(self, batch, batch_idx):
        self.wrappers.append(self.trainer.strategy.model)
        return self.layer(batch).sum()

    def on_train_batch_end(self, *args):
        if self.trainer.global_step == 1:
            compat.lightning_rewrap(self.trainer.strategy)()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_distributed_wrapper_names():
    """What rebuilding a DDP wrapper mid-training relies on: DDP's `no_sync` clears `require_backward_grad_sync`;
    Lightning's fit loop runs each step through `strategy.model`, which `configure_ddp` rebuilds; accelerate's
    `prepare_model` lists the model in `Accelerator._models`; the Trainer's loop hands `training_step` a model of
    its own (a local variable), which `AttnRegTrainerMixin.training_step` replaces by a rebuilt wrapper."""
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    with one_process_group():
        stale, current = DistributedDataParallel(torch.nn.Linear(2, 2)), DistributedDataParallel(torch.nn.Linear(2, 2))
        with stale.no_sync():
            assert stale.require_backward_grad_sync is False, "DDP.no_sync no longer clears require_backward_grad_sync"
            with compat.no_sync_as(stale, current):
                assert current.require_backward_grad_sync is False
        with compat.no_sync_as(stale, current):
            assert current.require_backward_grad_sync is True

        module = Rebuilt()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy="ddp", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(torch.ones(3, 2), batch_size=1))
        first, second, third = module.wrappers  # rebuilt after the first optimizer step
        assert second is third and second is not first, "Lightning's loop no longer reads strategy.model"
        assert isinstance(second, DistributedDataParallel) and second.module is module
    assert compat.lightning_rewrap(L.Trainer(accelerator="cpu", devices=1).strategy) is None  # nothing wrapped

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    accelerator.prepare_model(model)
    assert any(entry is model for entry in accelerator._models), "Accelerator._models moved"
    source = inspect.getsource(Trainer._run_epoch)
    assert "self.training_step(model," in source, "the Trainer's loop no longer hands training_step its own model"
    assert compat.trainer_rewrap(SimpleNamespace(model_wrapped=model), []) is None  # not DDP
    assert not dist.is_initialized()


def test_private_names_appear_only_in_the_compatibility_module():
    """Every private name of `compat.PRIVATE_NAMES` (`LightningModule._trainer`, ...) is used in `attnreg/compat.py`
    alone: no other module's code reads or writes an attribute of that name, even one of its own (a docstring example
    may show one, as a reader would check it)."""
    import re
    from pathlib import Path

    package = Path(compat.__file__).parent
    names = {name.rsplit(".", 1)[-1] for names in compat.PRIVATE_NAMES.values() for name in names}
    names = {name for name in names if name.startswith("_") and not name.startswith("__")}
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    found = [
        f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.strip().startswith((">>>", "..."))
    ]
    assert not found, found
