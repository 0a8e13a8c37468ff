"""Every save a user reaches for reloads to the trained model (issues 46.2 and 47): `save_pretrained`, the
`Trainer`'s `save_model` and PEFT's `save_pretrained` on the wrapped model, with or without a LoRA adapter, after
gates (live or folded into the weights), silencing or removal, on an encoder and a grouped-query decoder. Each folder
is reloaded the way its kind reloads (transformers' `from_pretrained`, PEFT's `PeftModel.from_pretrained` or
`AutoPeftModel...`, `load_pruned` where heads were removed) and compared with the in-memory model's logits."""

import pytest
import torch
from conftest import sgd_arguments
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import attnreg
from attnreg import methods
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.structure import fold_gates, load_pruned, prune_heads, silence_heads
from attnreg.tiny import tiny_model

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")

FAMILIES = {  # model, LoRA targets, heads to silence, heads to remove (whole key/value groups on Llama)
    "bert": ("classification", ["query", "key", "value"], {0: [1]}, {0: [0, 1], 1: [3]}),
    "llama": ("causal_lm", ["q_proj", "k_proj", "v_proj", "o_proj"], {0: [1]}, {0: [0, 1], 1: [2, 3]}),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


class Rows(torch.utils.data.Dataset):
    def __init__(self, head: str):
        self.head = head

    def __len__(self):
        return 4

    def __getitem__(self, index):
        row = IDS[index % 2]
        label = row if self.head == "causal_lm" else torch.tensor(index % 2)
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": label}


def build(family: str, lora: bool):
    head, targets, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = tiny_model(family, head=head, num_labels=2) if head == "classification" else tiny_model(family, head=head)
    if lora:  # random A and B: the adapter's path is not zero
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
        config.task_type = "SEQ_CLS" if head == "classification" else "CAUSAL_LM"
        model = peft.get_peft_model(model, config)
    return model


def change(model, family: str, what: str) -> None:
    """What a run does to the model's shape, done by hand after training: gates left on, gates folded into the
    weights (HeadGating's end of fit), heads silenced, heads removed."""
    _, _, silenced, removed = FAMILIES[family]
    if what in ("gates", "folded"):
        hub = attnreg.attach(model)
        with torch.no_grad():
            hub.gate(0).copy_(torch.tensor([1.0, 0.5, 0.0, 1.5]))
            hub.gate(1).copy_(torch.tensor([0.25, 1.0, 2.0, 0.0]))
        if what == "folded":
            fold_gates(model)
    elif what == "silenced":
        silence_heads(model, silenced)
    else:
        prune_heads(model, removed)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits


def reload(folder, family: str, lora: bool):
    base_class = AutoModelForSequenceClassification if FAMILIES[family][0] == "classification" else AutoModelForCausalLM
    removed = getattr(AutoConfig.from_pretrained(folder), "attnreg_pruned_heads", None)
    base = load_pruned(folder) if removed else base_class.from_pretrained(folder)
    return peft.PeftModel.from_pretrained(base, folder) if lora else base


@pytest.mark.parametrize("what", ["gates", "folded", "silenced", "removed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("save", ["trainer", "save_pretrained"])
def test_a_save_after_a_run_reloads_to_the_trained_model(family, lora, what, save, tmp_path):
    model = build(family, lora)
    args = sgd_arguments(tmp_path / "run", max_steps=1, learning_rate=0.05)
    trainer = AttnRegTrainer(
        model=model,
        args=args,
        train_dataset=Rows(FAMILIES[family][0]),
        methods=[methods.EntropyRegularizer(weight=0.1, mode="max", layers=[1])],
    )
    trainer.train()
    change(model, family, what)
    expected = logits(model)
    folder = tmp_path / "saved"
    if save == "trainer":
        trainer.save_model(str(folder))
    else:
        model.save_pretrained(folder)
    torch.testing.assert_close(logits(reload(folder, family, lora)), expected, rtol=1e-5, atol=1e-5)


def test_an_adapter_folder_whose_base_changed_reloads_alone_with_peft_s_auto_class(tmp_path):
    """Gates folded into the base of a LoRA decoder: the folder holds the base as trained and its adapter config
    points at it, so PEFT's own `AutoPeftModelForCausalLM.from_pretrained(folder)` gives the trained model."""
    model = build("llama", lora=True)
    args = sgd_arguments(tmp_path / "run", max_steps=1, learning_rate=0.05)
    trainer = AttnRegTrainer(model=model, args=args, train_dataset=Rows("causal_lm"), methods=[])
    trainer.train()
    change(model, "llama", "folded")
    trainer.save_model(str(tmp_path / "saved"))
    again = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(logits(again), logits(model), rtol=1e-5, atol=1e-5)
    original = peft.PeftModel.from_pretrained(build("llama", lora=False), tmp_path / "saved")
    assert not torch.allclose(logits(original), logits(model), atol=1e-3)  # the adapter alone: another model
