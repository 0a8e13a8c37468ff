"""The one structure record (issue 47): folders an older attnreg wrote still load to the model it saved, and a
record the weights beside it contradict is refused, naming the layer and the tensor, before anything changes.

The folders under `tests/data/previous_release/` were written by 0.1.0's and 0.2.0's own code
(`tests/data/make_old_folders.py` says how), each with the output it gave for fixed input ids."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attnreg
from attnreg import methods
from attnreg.app.analyze import _from_checkpoint, load_folder
from attnreg.hub import is_attached
from attnreg.structure import (
    RECORD_FILE,
    StructureRecord,
    load_pruned,
    prune_heads,
    pruned_heads,
    read_record,
    record_of,
    restore_record,
    save_pruned,
    silence_heads,
    silenced_heads,
)
from attnreg.tiny import tiny_model

OLD = Path(__file__).parent / "data" / "previous_release"
FOLDERS = {  # folder: (heads removed, heads silenced) the record gives back
    "0.1.0/bert_pruned": ({0: (1, 3), 1: (0,)}, {}),
    "0.1.0/llama_pruned_silenced": ({0: (0, 1)}, {}),  # 0.1.0 recorded no silencing: its columns are zero
    "0.2.0/llama_hard_concrete": ({0: (0, 1)}, {0: (2,)}),
    "0.2.0/llama_trainer_checkpoint": ({0: (2, 3)}, {}),
}


def expected(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    saved = load_file(folder / "expected.safetensors")
    return saved["input_ids"], saved["output"]


def first_output(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids)[0]


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_a_folder_an_older_attnreg_wrote_loads_to_the_model_it_saved(name):
    folder = OLD / name
    ids, output = expected(folder)
    model = load_pruned(folder)
    removed, silenced = FOLDERS[name]
    assert pruned_heads(model) == removed and silenced_heads(model) == silenced
    torch.testing.assert_close(first_output(model, ids), output, rtol=0, atol=1e-5)
    if name.endswith("hard_concrete"):  # the gate, with its settings, as 0.2.0 saved it
        gate = attnreg.hub_of(model).gates[1]
        assert (gate.temperature, gate.stretch) == (0.5, (-0.1, 1.1))
    torch.testing.assert_close(first_output(load_folder(folder), ids), output, rtol=0, atol=1e-5)


def test_a_0_2_0_trainer_checkpoint_resumes_through_the_runner():
    folder = OLD / "0.2.0" / "llama_trainer_checkpoint"
    ids, output = expected(folder)
    model = tiny_model("llama", head="causal_lm", hidden=16, layers=2, heads=4, vocab=32, positions=16)
    runner = methods.Runner([methods.HeadGating(methods.L1Gates(), layers=[1])])
    runner.bind(model)
    runner.load_structure(folder)
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    assert attnreg.hub_of(model).gate(1).tolist() == [1.0, 0.5, 0.0, 2.0]
    torch.testing.assert_close(first_output(model, ids), output, rtol=0, atol=1e-5)


def test_a_0_1_0_lightning_checkpoint_loads_in_attnreg_analyze():
    folder = OLD / "0.1.0" / "gpt2_lightning"
    ids, output = expected(folder)
    model = _from_checkpoint(folder / "last.ckpt", str(folder))  # a classifier: its body's output was stored
    assert pruned_heads(model) == {1: (0, 2)}
    torch.testing.assert_close(first_output(model.transformer, ids), output, rtol=0, atol=1e-5)


def test_one_record_whatever_wrote_it(tmp_path):
    model = tiny_model("llama", head="causal_lm")
    prune_heads(model, {0: [0, 1]})
    silence_heads(model, {1: [3]})
    attnreg.attach(model).gate(1)
    save_pruned(model, tmp_path / "saved")
    runner = methods.Runner([])
    runner.bind(model)
    runner.save_structure(tmp_path)
    record = record_of(model)
    assert read_record(tmp_path / "saved") == read_record(tmp_path) == record
    assert StructureRecord.from_dict(runner.structure()) == StructureRecord.from_dict(record.to_dict()) == record
    assert json.loads((tmp_path / RECORD_FILE).read_text())["format"] == 2
    assert not (tmp_path / "attnreg_structure.json").exists()  # one file beside the weights


def save_bert(folder: Path, removed: dict) -> torch.nn.Module:
    model = tiny_model("bert", head="classification")
    prune_heads(model, removed)
    save_pruned(model, folder)
    return model


def test_a_record_the_weights_contradict_is_refused_naming_layer_and_tensor(tmp_path):
    save_bert(tmp_path / "a", {1: [0, 2]})
    save_bert(tmp_path / "b", {1: [1]})
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")  # weights swapped
    message = (
        r"the structure record disagrees with the weights: layer 1: attention.self.query.weight has 24 rows in "
        r"model.safetensors, the record gives 2 heads x 8 = 16 "
    )
    with pytest.raises(ValueError, match=message):
        load_pruned(tmp_path / "a")
    fresh = tiny_model("bert", head="classification")
    before = {key: value.clone() for key, value in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=message + r".*layer 1: attention.output.dense.weight has 24 columns"):
        restore_record(fresh, tmp_path / "a")
    assert pruned_heads(fresh) == {} and not is_attached(fresh)  # nothing changed
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)


def test_an_edited_record_is_refused_before_the_model_changes(tmp_path):
    trained = save_bert(tmp_path, {0: [1, 3]})
    record = json.loads((tmp_path / RECORD_FILE).read_text())
    record["heads"][0] = [3, 3]  # edited by hand: heads and removed no longer agree
    (tmp_path / RECORD_FILE).write_text(json.dumps(record))
    fresh = tiny_model("bert", head="classification")
    with pytest.raises(ValueError, match=r"re-applying the structure record gives heads \[\[2, 2\], \[4, 4\]\]"):
        restore_record(fresh, tmp_path)
    record["heads"][0], record["pruned_heads"] = [3, 3], {"0": [1]}
    (tmp_path / RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"layer 0: attention.self.query.weight has 16 rows in model.safetensors, "):
        restore_record(fresh, tmp_path)
    assert pruned_heads(fresh) == {}
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in trained.state_dict().items()}}
    checkpoint.update(StructureRecord.from_dict(record).to_checkpoint())  # a Lightning checkpoint, edited
    with pytest.raises(ValueError, match=r"layer 0: .* in the checkpoint's state_dict, the record gives 3 heads"):
        restore_record(fresh, checkpoint)
    assert pruned_heads(fresh) == {}


def test_a_gpt2_record_names_its_fused_projection(tmp_path):
    model = tiny_model("gpt2", head="causal_lm")
    prune_heads(model, {0: [1]})
    weights = model.state_dict()
    fresh = tiny_model("gpt2", head="causal_lm")
    record = {"attnreg_pruned_heads": {"0": [1, 2]}, "state_dict": weights}
    with pytest.raises(
        ValueError, match=r"layer 0: attn.c_attn.weight has 72 columns in the checkpoint's state_dict, "
    ):
        restore_record(fresh, record)
    assert pruned_heads(fresh) == {}


def test_load_pruned_warns_where_a_lora_adapter_lies_beside_the_model(tmp_path):
    """A run's `pruned_model/` of a LoRA run holds the adapter beside the pruned base: `load_pruned` returns the base
    alone and says so, naming the call that gives the trained model; `load_folder` merges it, without the warning."""
    from attnreg.app.models import add_lora
    from attnreg.structure.saving import AdapterLeftOutWarning

    model = add_lora(tiny_model("llama", head="causal_lm"), r=2, seed=0, task_type="CAUSAL_LM")
    prune_heads(model, {0: [0, 1]})
    for layer in model.modules():  # a trained adapter: B is zero at start, which would make it add nothing
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    folder = save_pruned(model, tmp_path / "pruned_model")
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.warns(AdapterLeftOutWarning, match=r"holds a LoRA adapter .* PeftModel.from_pretrained\(load_pruned"):
        base = load_pruned(folder)
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
        assert not torch.allclose(base(ids).logits, trained, atol=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdapterLeftOutWarning)
            assert torch.allclose(load_folder(folder)(ids).logits, trained, atol=1e-5)
