"""The private names of torch, transformers and Lightning that attnreg uses (`attnreg.compat`) still exist
and still mean what attnreg reads from them; a new version that moves one fails here, naming it."""

import lightning as L
import torch
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
