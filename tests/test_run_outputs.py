"""What a run saves opens, in attnreg-analyze and the head view, as the model the run ended with (issue 46, items 4, 8
and 17): a LoRA pruning run's `pruned_model/` with its adapter, its `merged_model/`, and a run shorter than an epoch."""

from pathlib import Path

import peft
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attnreg.app.analyze import load_model
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.train import train
from attnreg.app.view import main as view_main
from attnreg.app.view import view_run
from attnreg.methods.pruning import load_pruned, pruned_heads, silenced_heads

QUIET = ["trainer.enable_progress_bar=false", "~logger"]
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])


def composed(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides))


def hidden(model) -> torch.Tensor:
    model = model.eval()
    with torch.no_grad():
        inner = model.get_base_model() if isinstance(model, peft.PeftModel) else model
        body = getattr(inner, inner.base_model_prefix, inner)
        return body(input_ids=IDS).last_hidden_state


@pytest.fixture(scope="module")
def lora_pruning_run(tmp_path_factory):
    """Grouped-query Llama, LoRA, every gate below the threshold: heads removed and silenced, adapter beside them."""
    folder = tmp_path_factory.mktemp("run")
    overrides = ["data=agreement_lm", "peft=lora", "data.train=32", "data.val=16", "trainer.max_epochs=1", *QUIET]
    overrides += ["attnreg=[syntax_prior_kl,head_gating]", "attnreg.head_gating.removal.threshold=10"]
    return folder, hydra_run(folder, overrides)


def hydra_run(folder: Path, overrides: list[str]) -> dict:
    """`train` with the run folder Hydra would write (`.hydra/config.yaml`, which the view reads)."""
    cfg = composed(*overrides)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    return train(cfg, folder)


def test_analyze_opens_a_pruned_lora_folder_with_its_adapter(lora_pruning_run):
    folder, summary = lora_pruning_run
    saved = Path(summary["pruning"]["saved"])
    reference = peft.PeftModel.from_pretrained(load_pruned(saved), saved)  # PEFT's own loader on the pruned base
    base_only = load_pruned(saved)
    assert not torch.allclose(hidden(base_only), hidden(reference), atol=1e-4)  # the adapter matters here
    model, _ = load_model(str(saved))
    torch.testing.assert_close(hidden(model), hidden(reference), rtol=1e-5, atol=1e-5)
    merged, _ = load_model(str(folder / "merged_model"))  # the merged copy carries the pruning record too
    assert pruned_heads(merged) == pruned_heads(base_only) and silenced_heads(merged) == silenced_heads(base_only)
    torch.testing.assert_close(hidden(merged), hidden(reference), rtol=1e-5, atol=1e-5)


def test_the_view_shows_the_model_the_run_ended_with_not_a_checkpoint_before_the_silencing(lora_pruning_run):
    folder, summary = lora_pruning_run
    view, heads = view_run(folder, sentences=4)
    assert heads == "L0H0, L1H0"
    trained, start = view.models  # the trained model: its heads removed and silenced, as the summary says
    silenced = {int(k): v for k, v in summary["pruning"]["silenced"].items()}
    removed = {int(k): v for k, v in summary["pruning"]["removed"].items()}
    for layer, row in enumerate(trained["silenced"]):
        assert [head for head, flag in enumerate(row) if flag] == silenced.get(layer, [])
    for layer, row in enumerate(trained["removed"]):
        assert [head for head, flag in enumerate(row) if flag] == removed.get(layer, [])
    assert not any(any(row) for row in start["silenced"] + start["removed"])


def test_a_run_shorter_than_an_epoch_is_viewed_from_its_saved_model(tmp_path, capsys):
    overrides = ["data.train=64", "data.val=32", "data.test=16", "data.hard=16", "trainer.max_steps=1", *QUIET]
    summary = hydra_run(tmp_path, overrides)
    assert summary["steps"] == 1 and not (tmp_path / "checkpoints" / "best.ckpt").exists()
    assert summary["steps"] == 1 and Path(summary["model"]).is_dir()
    assert view_main([str(tmp_path), "--sentences", "4"]) == 0
    assert "head_view.html" in capsys.readouterr().out
