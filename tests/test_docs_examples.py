"""Every python code block of the README and the docs runs, as a reader pastes them: the blocks of a page in order,
in one namespace, with the names the surrounding text asks the reader to supply (`model`, `tokenizer`, `loader`,
`texts`, ...) given tiny by that page's fixture below, in a folder holding the files the page names
(`en_ewt-ud-dev.conllu`, ...). Trainers are cut to 2 steps (`lightning.Trainer`, `transformers.TrainingArguments`),
nothing else is changed. A block preceded by `<!-- docs-test: skip REASON -->` is not run (say why).

The repository's weight is checked here too: the README stays a front door, committed results stay summaries."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
import transformers
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if "api" not in p.parts)]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)")
SKIP = re.compile(r"<!-- docs-test: skip (?P<reason>.+?) -->")
STEPS = 2  # what every trainer in a block is cut to


def code_blocks(page: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of each ```python block of `page`."""
    lines = (ROOT / page).read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        end = index + 1
        while not lines[end].strip().startswith("```"):
            end += 1
        if match["lang"] == "python":
            indent = len(match["indent"])
            code = "\n".join(line[indent:] for line in lines[index + 1 : end])
            before = next((line for line in reversed(lines[:index]) if line.strip()), "")
            skip = SKIP.search(before)
            found.append((index + 1, code, skip["reason"] if skip else None))
        index = end + 1
    return found


# -- what the pages ask the reader to supply, tiny ---------------------------------------------------------
TEXTS = [
    "The keys to the cabinet are on the table.",
    "The dog that the children love barks.",
    "She reads the book that her friend wrote.",
    "The authors of the paper were right.",
    "A man with two dogs walks in the park.",
    "The cat sleeps.",
    "We saw the movie that everyone liked.",
    "The students in the class write essays.",
]
LABELS = [1, 1, 0, 1, 0, 1, 0, 0]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"


@functools.cache
def minilm_tokenizer():
    from attnreg.app.models import load_tokenizer, minilm_directory

    return load_tokenizer(str(minilm_directory()))


@functools.cache
def parsed_texts():
    from attnreg.syntax.parse import parse_texts

    return parse_texts(TEXTS)


def encoder(tokenizer):
    """A BERT classifier with MiniLM's vocabulary, 6 layers x 12 heads as the pages' head numbers assume."""
    from attnreg.tiny import tiny_model

    return tiny_model("bert", head="classification", vocab=len(tokenizer), layers=6, heads=12, hidden=48).train()


def write_trees(folder: Path) -> None:
    """en_ewt-ud-dev.conllu and en_ewt-ud-train.conllu.gz as the pages name them: sentences of the built-in grammar."""
    import gzip

    from attnreg.app.task import generate

    blocks = []
    for number, example in enumerate(generate(24, seed=0)):
        s = example.sentence
        rows = [
            f"{i}\t{w}\t_\t_\t_\t_\t{h}\t{r}\t_\t_"
            for i, (w, h, r) in enumerate(zip(s.words, s.heads, s.relations, strict=True), 1)
        ]
        blocks.append(f"# sent_id = s{number}\n# text = {s.text}\n" + "\n".join(rows) + "\n")
    text = "\n".join(blocks) + "\n"
    (folder / "en_ewt-ud-dev.conllu").write_text(text)
    with gzip.open(folder / "en_ewt-ud-train.conllu.gz", "wt") as handle:
        handle.write(text)


def encoder_names(folder: Path) -> dict:
    """What the encoder pages use: a tokenizer, a model, texts and labels, a loader of them with the prior."""
    from attnreg.app.modules import SequenceClassifier
    from attnreg.syntax import SyntaxCollator, SyntaxDataset

    tokenizer = minilm_tokenizer()
    model = encoder(tokenizer)
    data = SyntaxDataset(parsed_texts(), LABELS)
    loader = DataLoader(data, batch_size=4, collate_fn=SyntaxCollator(tokenizer))
    batch = dict(tokenizer(TEXTS[:2], padding=True, return_tensors="pt"))
    batch_all = tokenizer(TEXTS, padding=True, return_tensors="pt")
    return {
        "tokenizer": tokenizer,
        "model": model,
        "texts": TEXTS,
        "labels": LABELS,
        "loader": loader,
        "unlabeled_loader": loader,
        "batch": batch,
        "batches": list(loader),
        "module": SequenceClassifier(model),
        "data": [  # a tokenized dataset, as the Trainer's default collator takes it
            {"input_ids": ids, "attention_mask": mask, "labels": label}
            for ids, mask, label in zip(batch_all["input_ids"], batch_all["attention_mask"], LABELS, strict=True)
        ],
        "args": transformers.TrainingArguments("out", max_steps=STEPS),
        "sentences": SyntaxDataset.from_conllu(folder / "en_ewt-ud-dev.conllu").sentences,
        "ids": batch["input_ids"][:1],
        "dev_accuracy": lambda model: 0.5,  # the reader's metric: any function of the model
        "folder": folder,
        "unpruned": copy.deepcopy(model),
    }


def readme_names(folder: Path) -> dict:
    """The README's TRL example adds a decoder with a chat template and a parsed corpus."""
    import datasets

    from attnreg.app.task import build_tokenizer, generate, vocabulary
    from attnreg.tiny import tiny_model

    decoder_tokenizer = build_tokenizer([*vocabulary(), "<|user|>", "<|assistant|>", "<|end|>"])
    decoder_tokenizer.chat_template = CHAT_TEMPLATE
    rows = [
        {"words": list(s.words), "heads": list(s.heads), "relations": list(s.relations), "text": s.text}
        for s in (example.sentence for example in generate(8, seed=1))
    ]
    decoder = tiny_model("llama", head="causal_lm", vocab=len(decoder_tokenizer), layers=12, hidden=32, heads=4)
    return {
        **encoder_names(folder),
        "decoder": decoder,
        "decoder_tokenizer": decoder_tokenizer,
        "corpus": datasets.Dataset.from_list(rows),
    }


def app_names(folder: Path) -> dict:
    """docs/app.md's block reads `cfg`, a user's own app composed with attnreg's presets."""
    from hydra import compose, initialize_config_dir

    (folder / "app.yaml").write_text(
        "hydra:\n  searchpath: [pkg://attnreg.app.configs]\ndefaults:\n  - _self_\n  - attnreg: syntax_prior_kl\n"
    )
    with initialize_config_dir(str(folder), version_base="1.3"):
        return {"cfg": compose("app")}


def distributed_names(folder: Path) -> dict:
    """docs/distributed.md's loop runs in a process group (one process of gloo here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{folder / 'process-group'}", rank=0, world_size=1)
    return {**encoder_names(folder), "__own_group__": True}


FIXTURES = {"README.md": readme_names, "docs/app.md": app_names, "docs/distributed.md": distributed_names}
ENCODER_NAMES = {
    "tokenizer", "model", "texts", "labels", "loader", "unlabeled_loader", "batch", "batches", "module", "data",
    "args", "sentences", "ids", "dev_accuracy", "folder", "unpruned",
}  # fmt: skip
SUPPLIED = {"README.md": ENCODER_NAMES | {"decoder", "decoder_tokenizer", "corpus"}, "docs/app.md": {"cfg"}}
SLOW_PAGES = {
    "README.md",
    "docs/getting-started.md",
    "docs/head-view.md",
    "docs/methods/pruning.md",
    "docs/methods/your-own.md",
}
"""Pages whose blocks train several methods or draw the head view (20-60 s each on 2 shared cores): run whole by
`make test-slow`; the default suite checks their names (`test_every_name_a_block_uses_is_imported_or_supplied`)."""


# -- trainers cut to a few steps -----------------------------------------------------------------------------
@pytest.fixture
def short_trainers(monkeypatch, tmp_path):
    lightning_init = lightning.Trainer.__init__

    def short_lightning(self, *args, **kwargs):
        kwargs.update(max_steps=STEPS, limit_val_batches=0, accelerator="cpu", devices=1, num_sanity_val_steps=0)
        kwargs.setdefault("logger", False)
        kwargs.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        lightning_init(self, *args, default_root_dir=str(tmp_path), **kwargs)

    arguments_post_init = transformers.TrainingArguments.__post_init__

    def short_arguments(self):
        self.max_steps, self.save_strategy, self.report_to, self.disable_tqdm = STEPS, "no", [], True
        arguments_post_init(self)

    monkeypatch.setattr(lightning.Trainer, "__init__", short_lightning)
    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", short_arguments)


@pytest.mark.parametrize("page", [page for page in PAGES if code_blocks(page)])
def test_every_name_a_block_uses_is_imported_or_supplied(page):
    """What a reader pastes names nothing undefined (ruff's F821 over the page's blocks in order, after the
    names the page asks the reader to supply): a missing import or a wrong variable fails here, in no time."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    supplied = "".join(f"{name} = None\n" for name in sorted(SUPPLIED.get(page, ENCODER_NAMES)))
    code = supplied + "\n".join(code for _, code, skip in code_blocks(page) if not skip)
    done = subprocess.run(
        [
            ruff,
            "check",
            "--isolated",
            "--select",
            "F821",
            "--output-format",
            "concise",
            "--stdin-filename",
            "page.py",
            "-",
        ],
        input=code,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{page}: a block names what nothing defines:\n{done.stdout}"


PAGE_RUNS = [
    pytest.param(page, marks=pytest.mark.slow) if page in SLOW_PAGES else page for page in PAGES if code_blocks(page)
]


@pytest.mark.parametrize("page", PAGE_RUNS)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch, short_trainers):
    monkeypatch.chdir(tmp_path)
    write_trees(tmp_path)
    namespace = {"__name__": "__docs__", **FIXTURES.get(page, encoder_names)(tmp_path)}
    try:
        for line, code, skip in code_blocks(page):
            if skip:
                continue
            try:
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"{page}:{line}: the block fails: {type(error).__name__}: {error}") from error
    finally:
        if namespace.get("__own_group__"):
            torch.distributed.destroy_process_group()


def test_a_block_can_be_skipped_only_with_a_reason():
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert len(SKIP.findall(text)) == text.count("<!-- docs-test:"), (
            f"{page}: write <!-- docs-test: skip REASON -->"
        )


# -- weight in the repository --------------------------------------------------------------------------------
def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to its docs page"
    assert not any(line.startswith("| bert |") for line in lines), "the family table lives in docs/hub.md"
    assert any("make demo" in line for line in lines) and any("make test" in line for line in lines)


def test_committed_results_are_summaries():
    heavy = [
        f"{path.relative_to(ROOT)}: {path.stat().st_size // 1000} kB"
        for path in (ROOT / "benchmarks" / "results").rglob("*")
        if path.suffix in (".json", ".md", ".csv") and path.stat().st_size > 200_000
    ]
    assert not heavy, "results over 200 kB (keep results.md and a compact summary JSON; a command regenerates the rest)"


README_RATIOS = {  # the README's performance rows: the overhead variant each quotes, at 512 tokens
    "attached, idle": "idle",
    "per-head gates": "gates",
    "syntax-prior KL, one head per layer (blockwise, the default)": "kl_head",
    "entropy on every head of every layer (blockwise)": "entropy_all",
}


def test_the_readmes_time_ratios_are_the_results_medians_with_their_range_and_never_below_one():
    """Each cell is the median of the per-repetition ratios to SDPA (range in brackets) of the run it cites; a
    median below 1.00 reads 1.00*: every variant runs SDPA's kernels and more, so a lower figure is noise."""
    results = json.loads((ROOT / "benchmarks/results/overhead/stop_check/results.json").read_text())
    configs = {(c["model"], c["tokens"]): c["times_s"] for c in results["configs"]}
    rows = {
        cells[0]: cells[1:3]
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| ")
        and (cells := [cell.strip() for cell in line.strip("|").split("|")])[0] in README_RATIOS
    }
    assert rows.keys() == README_RATIOS.keys()
    for row, variant in README_RATIOS.items():
        for model, cell in zip(("bert", "gpt2"), rows[row], strict=True):
            times = configs[(model, 512)]
            ratios = [own / sdpa for own, sdpa in zip(times[variant], times["sdpa"], strict=True)]
            median = statistics.median(ratios)
            shown = f"{max(median, 1.0):.2f}" + ("\\*" if median < 1.0 else "")
            assert cell == f"{shown} ({min(ratios):.2f}-{max(ratios):.2f})", f"README {row}, {model}: {cell}"
