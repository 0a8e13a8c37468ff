"""The app's `export=` setting: a real `attnreg-train` run of the tiny Llama pruning recipe writes its pruned model
in each format, and each export is read back by a reader attnreg does not own (plain `from_pretrained`, transformers'
GGUF reader, ONNX Runtime) against the run's own `pruned_model/` with its LoRA adapter merged
(`attnreg.app.analyze.load_folder`), the reference."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from attnreg.app.analyze import load_folder
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.train import train
from attnreg.export import ExportError, head_layout

pytest.importorskip("gguf", reason='the export extra: pip install ".[export]"')

QUIET = ["trainer.enable_progress_bar=false", "~logger", "data.train=32", "data.val=16", "control=false"]
UNIFORM = ["attnreg.importance_removal.fraction=0.5", "attnreg.importance_removal.uniform=true"]


def composed(*overrides, experiment="tiny_llama_pruning"):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", [f"experiment={experiment}", *QUIET, *overrides])


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_pruning_run_exports_every_format_and_each_reads_back(tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason='the export extra: pip install ".[export]"')
    import onnxruntime

    summary = train(composed(*UNIFORM, "export=[transformers,gguf,onnx]"), tmp_path)
    assert set(summary["exports"]) == {"transformers", "gguf", "onnx"}
    assert "export gguf: " in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["exports"] == summary["exports"]
    reference = load_folder(tmp_path / "pruned_model").eval()  # the pruned base with its LoRA adapter merged
    assert head_layout(reference) == [(2, 1), (2, 1)]  # one group of two left in each layer: uniform
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    expected = logits(reference, ids)

    plain = AutoModelForCausalLM.from_pretrained(summary["exports"]["transformers"]).eval()
    assert not [name for name in (tmp_path / "export" / "transformers").iterdir() if "attnreg" in name.name]
    assert torch.allclose(logits(plain, ids), expected, atol=1e-5)

    gguf = tmp_path / "export" / "model.gguf"
    served = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    assert torch.allclose(logits(served, ids), expected, atol=1e-4)

    session = onnxruntime.InferenceSession(summary["exports"]["onnx"])
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}
    assert np.allclose(session.run(None, feeds)[0], expected.numpy(), atol=1e-4)


def test_an_export_the_heads_kept_rule_out_fails_the_run_after_saving_it(tmp_path):
    """The free choice of one group of four leaves the layers uneven: the plain checkpoint cannot hold them. The run
    saves its model and summary, names the refusal in both, writes nothing under export/, and fails."""
    with pytest.raises(ExportError, match=r"export: the trained model is saved in .*transformers: .*different numbers"):
        train(composed("export=transformers"), tmp_path)
    assert load_folder(tmp_path / "pruned_model") is not None
    assert "refused" in json.loads((tmp_path / "summary.json").read_text())["exports"]
    assert not (tmp_path / "export" / "transformers").exists()


@pytest.mark.parametrize(
    "experiment, override, message",
    [
        ("agreement_baseline", "export=[gguf]", r"export=\[gguf\]: cannot write BertForSequenceClassification as GGUF"),
        ("agreement_baseline", "export=transformers", r"BertForSequenceClassification .* derives the head size"),
        ("tiny_llama_pruning", "export=safetensors", r"export=safetensors: unknown format 'safetensors'"),
    ],
)
def test_exports_the_model_cannot_have_are_refused_before_training(experiment, override, message, tmp_path):
    with pytest.raises((ValueError, ExportError), match=message):
        train(composed(override, experiment=experiment), tmp_path)
    assert not (tmp_path / "checkpoints").exists()
