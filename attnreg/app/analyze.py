r"""`attnreg-analyze`: analyze the attention heads of a model on some sentences and write a report folder.

    attnreg-analyze MODEL DATA --out report/

MODEL is a local model directory (`save_pretrained`, or `attnreg.methods.pruning.save_pruned` for a pruned
model), a Lightning checkpoint (`.ckpt`) of `attnreg.app.modules.SequenceClassifier` together with
`--base`, the model it was fine-tuned from, or a Hugging Face Hub name (which needs a download); a directory
holding a GGUF file instead of `config.json` (SmolLM2 as `model=smollm2` loads it) with `--gguf-file NAME`.
DATA is a CoNLL-U file (`.conllu`, `.conllu.gz`: gold trees) or a text file with one sentence per
line (parsed with spaCy, `pip install 'attnreg[parse]'`). The tokenizer is the model's (its directory,
or `--base` for a checkpoint) unless `--tokenizer` names one; a directory without tokenizer files, or
a tokenizer that reads most words of DATA as unknown, is refused (the report would be wrong).

The report folder gets `statistics.csv` and `statistics.json` (every per-head statistic, role and
parent accuracy), `roles.csv` (the role table), `relations.csv` (best head per relation, both
directions, against the best fixed-offset baseline: Clark et al. 2019's Table 1), PNGs (entropy,
roles, parent accuracy, the attention of one example) and `summary.md`. For instance:

    attnreg-analyze ./minilm ../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu --out report --limit 500
    attnreg-analyze run.ckpt sentences.txt --base ./minilm --out report

Inputs longer than `attnreg.analysis.BLOCKWISE_LENGTH` tokens (`--max-length` above it) are reduced from each
layer's queries and keys in blocks of `--block-size` query rows, never building `[T, T]` attention;
`--blockwise on` / `off` chooses for every batch (the figures are the same).

`--html FILE` also writes the interactive head view of the first `--html-sentences` sentences (one self-contained
HTML file, `attnreg.analysis.head_view`), with `--compare MODEL` a second checkpoint beside the first (analyzed on
the same sentences):

    attnreg-analyze ./pruned ../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu --html heads.html --compare ./minilm

The view's arcs are taken from the report's own pass (`attnreg.analysis.head_view.HeadViewRecorder`): `--html`
adds no forward of MODEL, and the view's grid shows the report's statistics. Progress goes to stderr: a bar on a
terminal, else a line now and then (a log file, a batch job).

The example runs `main` (it takes the command line's arguments) on a tiny random model and one tree.

Example:
    >>> import tempfile
    >>> from attnreg.app.task import build_tokenizer, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> folder = Path(tempfile.mkdtemp())
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> tiny_model("bert", vocab=len(tokenizer)).save_pretrained(folder / "model")   # 2 layers x 4 heads
    >>> _ = tokenizer.save_pretrained(folder / "model")
    >>> words = [("the", 2, "det"), ("dogs", 3, "nsubj"), ("see", 0, "root"), ("the", 5, "det"), ("cat", 3, "obj")]
    >>> rows = [f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (word, head, rel) in enumerate(words, 1)]
    >>> _ = Path(folder, "dev.conllu").write_text("# text = the dogs see the cat\n" + "\n".join(rows) + "\n\n")
    >>> main([str(folder / "model"), str(folder / "dev.conllu"), "--out", str(folder / "report")])
    analyzed 1 sentences in ... s; report in .../report
    0
    >>> sorted(path.name for path in (folder / "report").iterdir())
    ['attention_example.png', 'entropy.png', 'parent_accuracy.png', 'relations.csv', 'roles.csv', 'roles.png',
     'statistics.csv', 'statistics.json', 'summary.md']
    >>> import csv
    >>> heads = list(csv.DictReader((folder / "report" / "statistics.csv").read_text().splitlines()))
    >>> len(heads), heads[0]["layer"], heads[0]["head"], 0 <= float(heads[0]["parent_accuracy"]) <= 1  # per head
    (8, '0', '0', True)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import pickle
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from attnreg.analysis import (
    ATTENTION_STATISTICS,
    BLOCKWISE_LENGTH,
    STATISTICS,
    Analysis,
    RoleThresholds,
    analyze,
    check_tokenizer,
    token_importance,
)
from attnreg.analysis.blocks import BLOCK_SIZE
from attnreg.analysis.head_view import HeadViewRecorder
from attnreg.app.inputs import check_model_folder, check_vocabulary
from attnreg.app.models import clear_quantizer
from attnreg.hub import attach
from attnreg.structure import load_pruned, read_record, restore_record
from attnreg.structure.saving import AdapterLeftOutWarning
from attnreg.syntax.trees import ConlluError, Sentence, read_conllu

SUMMARY_STATISTICS = tuple(name for name in ATTENTION_STATISTICS if not name.startswith("argmax"))  # the report table


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files of which a tokenizer directory has at least one."""

SAFE_CHECKPOINT_TYPES = (pathlib.PosixPath, pathlib.WindowsPath, AttributeDict)
"""What a Lightning checkpoint may hold beyond tensors and plain data and still load with `weights_only=True`
(a path or Lightning's hyperparameter dict among the hyperparameters); anything else needs --trust-checkpoint."""


class InputError(ValueError):
    """A model or data argument that cannot be used, with the reason.

    Example:
        >>> import tempfile
        >>> missing = Path(tempfile.mkdtemp(), "dev.conllu")
        >>> try:
        ...     load_sentences(missing)
        ... except ValueError as error:                       # an InputError is a ValueError
        ...     print(type(error).__name__, "-", error)
        InputError - data file /.../dev.conllu does not exist
    """


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_model(
    spec: str,
    base: str | None = None,
    tokenizer: str | None = None,
    trust_checkpoint: bool = False,
    gguf_file: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, fast tokenizer) from a directory, a `.ckpt` (with `base`) or a hub name.

    A `.ckpt` is read with `torch.load(weights_only=True)`: tensors, plain data and `SAFE_CHECKPOINT_TYPES`;
    one holding anything else is refused unless `trust_checkpoint` (unpickling it can run code from the file).
    `gguf_file` (`--gguf-file`) names a GGUF file in the directory (or hub repository) `spec` (for a `.ckpt`:
    `base`), as `model=smollm2` loads it: dequantized to float32, its tokenizer read from the same file unless
    `tokenizer` names another (see `load_folder`).

    Example:
        >>> import tempfile
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> folder = Path(tempfile.mkdtemp())
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> tiny_model("bert", vocab=len(tokenizer)).save_pretrained(folder / "base")   # ./minilm, say
        >>> _ = tokenizer.save_pretrained(folder / "base")
        >>> model, tokenizer = load_model(str(folder / "base"))
        >>> type(model).__name__, model.training, tokenizer.is_fast
        ('BertModel', False, True)
        >>> classifier = tiny_model("bert", head="classification", vocab=len(tokenizer), num_labels=3)
        >>> state = {f"model.{key}": value for key, value in classifier.state_dict().items()}
        >>> torch.save({"state_dict": state}, folder / "run.ckpt")    # as SequenceClassifier's checkpoints hold it
        >>> model, tokenizer = load_model(str(folder / "run.ckpt"), base=str(folder / "base"))
        >>> type(model).__name__, model.num_labels, torch.equal(model.classifier.weight, classifier.classifier.weight)
        ('BertForSequenceClassification', 3, True)
        >>> load_model(str(folder / "run.ckpt"))
        Traceback (most recent call last):
        ...
        attnreg.app.analyze.InputError: .../run.ckpt is a Lightning checkpoint: give --base, the model directory ...
    """
    path = Path(spec)
    if path.suffix == ".ckpt":
        if not path.is_file():
            raise InputError(f"checkpoint {spec} does not exist")
        if base is None:
            raise InputError(
                f"{spec} is a Lightning checkpoint: give --base, the model directory (or name) it was fine-tuned "
                "from, so the architecture can be rebuilt"
            )
        model = _from_checkpoint(path, base, trust_checkpoint, gguf_file)
        source = tokenizer or base
    elif path.is_dir():
        model = load_folder(path, gguf_file)
        source = tokenizer or spec
    elif path.exists():
        raise InputError(f"{spec} is a file but not a Lightning checkpoint (.ckpt); give a model directory instead")
    else:
        try:
            check_model_folder(spec)  # a path that does not exist is no hub name
        except FileNotFoundError as error:
            raise InputError(str(error)) from error
        model = _from_hub(spec, AutoModel, **_gguf_options(gguf_file))
        model = clear_quantizer(model) if gguf_file else model
        source = tokenizer or spec
    from_gguf = gguf_file if gguf_file and (source in (spec, base) or (Path(source) / gguf_file).is_file()) else None
    loaded = _tokenizer(source, from_gguf)
    try:
        check_vocabulary(loaded, model)
    except ValueError as error:
        raise InputError(f"{error} (the tokenizer of {source})") from error
    return model.eval(), loaded


def load_folder(path: Path, gguf_file: str | None = None) -> PreTrainedModel:
    """The model a folder holds, as the run that wrote it had it: a transformers model (`save_pretrained`, a run's
    `model/` or `merged_model/`), a pruned one (a folder with a structure record, `attnreg.structure.read_record`,
    whichever attnreg wrote it: `save_pruned`, a run's `pruned_model/`; read with `load_pruned`), either with the LoRA
    adapter saved beside it (`adapter_config.json`) merged in; an adapter folder alone (a run's `adapter/`) on the base
    model its `adapter_config.json` names; with `gguf_file`, the model of that GGUF file in the folder (dequantized to
    float32, quantizer flags cleared as `attnreg.app.models.clear_quantizer` clears them). A folder holding GGUF
    files but no `config.json` is refused without `gguf_file`, naming the files.

    Example:
        >>> import tempfile
        >>> from attnreg.app.models import add_lora
        >>> from attnreg.methods.pruning import prune_heads, save_pruned
        >>> from attnreg.tiny import tiny_model
        >>> model = add_lora(tiny_model("llama", head="causal_lm"), r=2, seed=0, task_type="CAUSAL_LM")
        >>> _ = prune_heads(model, {0: [0, 1]}); folder = save_pruned(model, tempfile.mkdtemp())
        >>> ids = torch.tensor([[3, 4, 5]])
        >>> torch.allclose(load_folder(folder)(ids).logits, model.eval()(ids).logits, atol=1e-5)   # with its adapter
        True
    """
    if gguf_file:
        _check_gguf(path, gguf_file)
        return clear_quantizer(AutoModel.from_pretrained(path, **_gguf_options(gguf_file)))
    adapter = (path / "adapter_config.json").is_file()
    if not (path / "config.json").is_file():
        if adapter:
            return _adapter_on_its_base(path)
        _check_gguf(path, None)
        raise InputError(f"{path} is a directory without config.json: not a saved transformers model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdapterLeftOutWarning)  # merged in just below
        model = load_pruned(path) if read_record(path) is not None else AutoModel.from_pretrained(path)
    if adapter:
        import peft

        model = peft.PeftModel.from_pretrained(model, path).merge_and_unload()
    return model


def _check_gguf(path: Path, gguf_file: str | None) -> None:
    """Refuse a `gguf_file` that is not a file of the folder `path`, and (`gguf_file` None) a folder without
    `config.json` that holds GGUF files: the model is in one of them, which `--gguf-file` must name.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp()); _ = (folder / "SmolLM2.Q4_1.gguf").write_bytes(b"")
        >>> _check_gguf(folder, None)
        Traceback (most recent call last):
        ...
        attnreg.app.analyze.InputError: /... has no config.json but holds the GGUF file SmolLM2.Q4_1.gguf: ...
        >>> _check_gguf(folder, "model.gguf")
        Traceback (most recent call last):
        ...
        attnreg.app.analyze.InputError: --gguf-file model.gguf: no such file in /... (its GGUF files: SmolLM2.Q4_1.gguf)
    """
    found = sorted(file.name for file in path.glob("*.gguf") if file.is_file())
    if gguf_file is None:
        if found and not (path / "config.json").is_file():
            files = f"GGUF file {found[0]}" if len(found) == 1 else f"GGUF files {', '.join(found)}"
            raise InputError(
                f"{path} has no config.json but holds the {files}: name the one to load with --gguf-file NAME "
                f"(for instance --gguf-file {found[0]}), as model=smollm2 names its gguf_file"
            )
        return
    if Path(gguf_file).name != gguf_file:
        raise InputError(f"--gguf-file {gguf_file}: give a file name in the model directory {path}, not a path")
    if not (path / gguf_file).is_file():
        held = f"its GGUF files: {', '.join(found)}" if found else "it holds no .gguf file"
        raise InputError(f"--gguf-file {gguf_file}: no such file in {path} ({held})")


def _gguf_options(gguf_file: str | None) -> dict[str, Any]:
    """`from_pretrained` keywords reading the model of `gguf_file` dequantized to float32 (none without one)."""
    if not gguf_file:
        return {}
    from transformers import GgufConfig

    return {"gguf_file": gguf_file, "dtype": torch.float32, "quantization_config": GgufConfig(dequantize=True)}


def _adapter_on_its_base(path: Path) -> PreTrainedModel:
    import peft

    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise InputError(
            f"{path} holds a LoRA adapter alone, and its base model ({base!r}, from adapter_config.json) is no folder "
            "with config.json: open the run's merged_model/ or pruned_model/ instead (they hold the whole model), or "
            "save the base model with save_pretrained and set base_model_name_or_path to it"
        )
    return peft.PeftModel.from_pretrained(AutoModel.from_pretrained(base), path).merge_and_unload()


def _from_hub(name: str, loader: Any, **kwargs: Any) -> Any:
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as error:
        raise InputError(
            f"{name!r} is not a local directory or checkpoint, and loading it from the Hugging Face Hub failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). This needs a download "
            "(and network access); otherwise save the model with save_pretrained and pass its directory"
        ) from error


def _tokenizer(source: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    path = Path(source)
    if gguf_file:  # the vocabulary the GGUF file carries
        options = {"gguf_file": gguf_file}
        loaded = (
            AutoTokenizer.from_pretrained(source, **options)
            if path.is_dir()
            else _from_hub(source, AutoTokenizer, **options)
        )
        if not loaded.is_fast:
            raise InputError(
                f"the tokenizer of {source}/{gguf_file} is not a fast tokenizer; the analysis needs character offsets"
            )
        return loaded
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            f"{source} has no tokenizer files ({', '.join(TOKENIZER_FILES)}), and the tokenizer transformers "
            "builds for it reads every word as unknown: pass the model's tokenizer with --tokenizer DIR_OR_NAME "
            "(attnreg.methods.pruning.save_pruned(model, directory, tokenizer=tokenizer) saves one beside a "
            "pruned model)"
        )
    loaded = AutoTokenizer.from_pretrained(source) if path.is_dir() else _from_hub(source, AutoTokenizer)
    if not loaded.is_fast:
        raise InputError(f"the tokenizer of {source} is not a fast tokenizer; the analysis needs character offsets")
    return loaded


def _from_checkpoint(path: Path, base: str, trust: bool = False, gguf_file: str | None = None) -> PreTrainedModel:
    """A `SequenceClassifier` checkpoint's model: rebuilt from `base`'s config (that of its GGUF file `gguf_file`),
    pruning re-applied, weights loaded."""
    checkpoint = _load_checkpoint(path, trust)
    if "state_dict" not in checkpoint:
        raise InputError(f"{path} has no state_dict: not a Lightning checkpoint")
    state = {key[len("model.") :]: value for key, value in checkpoint["state_dict"].items() if key.startswith("model.")}
    if not state:
        raise InputError(
            f"{path}: no weights under 'model.'; expected a checkpoint of attnreg.app.modules.SequenceClassifier"
        )
    options = {"gguf_file": gguf_file} if gguf_file else {}
    if Path(base).is_dir():
        _check_gguf(Path(base), gguf_file)
        config = AutoConfig.from_pretrained(base, **options)
    else:
        config = _from_hub(base, AutoConfig, **options)
    model = AutoModelForSequenceClassification.from_config(config)
    prefix = f"{model.base_model_prefix}."
    for key, value in model.state_dict().items():
        saved = state.get(key)
        if not key.startswith(prefix) and saved is not None and saved.shape != value.shape:
            config.num_labels = saved.shape[0]  # the classification head's size
            model = AutoModelForSequenceClassification.from_config(config)
            break
    attach(model)  # gates and temperatures in the state_dict are created on load
    restore_record(model, checkpoint)  # refused before anything changes where the weights disagree
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputError(
            f"{path} does not match {base}: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    return model


def _load_checkpoint(path: Path, trust: bool) -> dict[str, Any]:
    """`torch.load` with weights only (tensors, plain data, `SAFE_CHECKPOINT_TYPES`) unless `trust`; an
    InputError names what else the file holds."""
    if trust:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(list(SAFE_CHECKPOINT_TYPES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (EOFError, RuntimeError) as error:  # empty, truncated, or not written by torch.save
        raise InputError(f"{path} is not a readable PyTorch checkpoint ({type(error).__name__}: {error})") from error
    except pickle.UnpicklingError as error:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except ValueError:  # not a torch.save zip file at all
            raise InputError(f"{path} is not a readable PyTorch checkpoint (not written by torch.save)") from error
        raise InputError(
            f"{path} holds more than weights and plain data ({', '.join(unsafe[:5]) or str(error).splitlines()[0]}); "
            "loading it would run code from the file, so it is refused. If you trust who made it, pass "
            "--trust-checkpoint"
        ) from error


def load_sentences(path: str | Path, data_format: str = "auto", limit: int | None = None) -> list[Sentence]:
    r"""Sentences with trees: gold from CoNLL-U, or parsed with spaCy from a text file (one per line).

    Example:
        >>> import tempfile
        >>> words = [("the", 2, "det"), ("dogs", 3, "nsubj"), ("bark", 0, "root")]
        >>> rows = [f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (word, head, rel) in enumerate(words, 1)]
        >>> path = Path(tempfile.mkdtemp(), "dev.conllu")
        >>> _ = path.write_text(("# text = the dogs bark\n" + "\n".join(rows) + "\n\n") * 3)   # 3 sentences
        >>> sentences = load_sentences(path, limit=2)
        >>> len(sentences), sentences[0].words, sentences[0].heads, sentences[0].text
        (2, ('the', 'dogs', 'bark'), (2, 3, 0), 'the dogs bark')
        >>> load_sentences(path, data_format="csv")
        Traceback (most recent call last):
        ...
        attnreg.app.analyze.InputError: unknown data format 'csv'; use conllu, text or auto
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file {path} does not exist")
    if data_format == "auto":
        data_format = "conllu" if path.name.endswith((".conllu", ".conllu.gz")) else "text"
    if data_format == "conllu":
        try:
            sentences = read_conllu(path)
        except ConlluError as error:  # malformed or empty: named by file and line
            raise InputError(str(error)) from error
    elif data_format == "text":
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        lines = lines[:limit] if limit is not None else lines
        if not lines:
            raise InputError(f"{path} has no sentences (one per line expected)")
        from attnreg.syntax.parse import parse_texts

        try:
            sentences = parse_texts(lines)
        except ImportError as error:
            raise InputError(f"parsing {path} needs spaCy: {error}") from error
    else:
        raise InputError(f"unknown data format {data_format!r}; use conllu, text or auto")
    return sentences[:limit] if limit is not None else sentences


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, sentences: Sequence[Sentence]) -> None:
    try:
        check_tokenizer(tokenizer, [sentence.text for sentence in sentences])
    except ValueError as error:
        raise InputError(f"{error}: pass it with --tokenizer DIR_OR_NAME") from error


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def write_report(
    analysis: Analysis,
    out: str | Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    example: Sentence,
    meta: dict[str, Any],
    thresholds: RoleThresholds | None = None,
    min_relation_words: int = 20,
    collapse_threshold: float = 0.9,
    plots: bool = True,
) -> Path:
    """Write the report files of `analysis` into `out` (see the module docstring); returns `out`.

    The example leaves out the PNGs (`main` draws them).

    Example:
        >>> import tempfile
        >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(vocabulary()); model = tiny_model("bert", vocab=len(tokenizer)).eval()
        >>> sentences = [example.sentence for example in generate(4, seed=0)]     # with gold trees
        >>> meta = {"model": "tiny_bert", "data": "agreement"}
        >>> out = write_report(analyze(model, tokenizer, sentences), tempfile.mkdtemp(), model, tokenizer,
        ...                    sentences[0], meta, min_relation_words=1, plots=False)
        >>> sorted(path.name for path in out.iterdir())
        ['relations.csv', 'roles.csv', 'statistics.csv', 'statistics.json', 'summary.md']
        >>> (out / "summary.md").read_text().splitlines()[0]
        '# Attention analysis: tiny_bert'
        >>> report = json.loads((out / "statistics.json").read_text())
        >>> report["sequences"], report["tokens"], len((out / "statistics.csv").read_text().splitlines())  # 8 heads
        (4, 48, 9)
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    roles = analysis.roles(thresholds)
    statistics = analysis.statistics
    syntax = analysis.syntax
    rows = []
    for role in roles.heads:
        row: dict[str, Any] = {"layer": role.layer, "head": role.head, "role": role.primary}
        row.update({name: _round(statistics[name][role.layer, role.head]) for name in STATISTICS})
        if syntax is not None:
            row["parent_accuracy"] = _round(syntax.accuracy[role.layer, role.head])
            row["reverse_parent_accuracy"] = _round(syntax.reverse_accuracy[role.layer, role.head])
        rows.append(row)
    _write_csv(out / "statistics.csv", rows)
    _write_csv(out / "roles.csv", roles.table())
    relations = syntax.relation_table(min_words=min_relation_words) if syntax is not None else []
    if relations:
        _write_csv(out / "relations.csv", relations)
    importance = _importance(model, tokenizer, example)
    collapsed = analysis.similarity.collapsed(collapse_threshold) if analysis.similarity is not None else []
    report = {
        **meta,
        **analysis.to_dict(thresholds, min_relation_words=min_relation_words),
        "thresholds": vars(roles.thresholds),
        "collapse": {"threshold": collapse_threshold, "collapsed": collapsed},
        "token_importance": importance["top"],
    }
    (out / "statistics.json").write_text(json.dumps(report, indent=1) + "\n")
    images = _plots(analysis, roles.grid(), importance, out) if plots else []
    (out / "summary.md").write_text(
        _summary(analysis, roles, relations, meta, collapsed, collapse_threshold, importance, images)
    )
    return out


def _importance(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, example: Sentence) -> dict[str, Any]:
    """Attention maps of one example and its tokens ranked by the summary token's attention."""
    hub = attach(model)
    encoding = tokenizer(example.text, return_tensors="pt", truncation=True, max_length=512)
    device = next(model.parameters()).device
    with torch.no_grad(), hub.capture() as probs:
        model(**{key: value.to(device) for key, value in encoding.items() if key in ("input_ids", "attention_mask")})
    maps = {layer: probs[layer][0].float().cpu() for layer in probs}
    scores = token_importance({layer: m[None] for layer, m in maps.items()}, causal=hub.family.causal)[0]
    tokens = tokenizer.convert_ids_to_tokens(encoding["input_ids"][0])
    order = scores.argsort(descending=True).tolist()
    top = [{"token": tokens[i], "position": i, "importance": round(float(scores[i]), 4)} for i in order[:8]]
    return {"maps": maps, "tokens": tokens, "top": {"sentence": example.text, "tokens": top}}


def _plots(analysis: Analysis, grid: list[list[str]], importance: dict[str, Any], out: Path) -> list[str]:
    from attnreg.analysis.plots import attention_grid, head_grid

    images = ["entropy.png", "roles.png", "attention_example.png"]
    head_grid(analysis.statistics["entropy"], "normalized entropy", out / images[0], vmin=0, vmax=1)
    head_grid(grid, "head roles", out / images[1])
    attention_grid(importance["maps"], path=out / images[2], title=f"attention: {importance['top']['sentence'][:80]}")
    if analysis.syntax is not None:
        images.append("parent_accuracy.png")
        title = "parent accuracy (dependent to head)"
        head_grid(analysis.syntax.accuracy, title, out / images[-1], cmap="magma", vmin=0, vmax=1)
    return images


def _summary(
    analysis: Analysis,
    roles: Any,
    relations: list[dict[str, Any]],
    meta: dict[str, Any],
    collapsed: list[int],
    collapse_threshold: float,
    importance: dict[str, Any],
    images: list[str],
) -> str:
    rate = analysis.tokens / analysis.seconds if analysis.seconds else math.nan
    lines = [
        f"# Attention analysis: {meta['model']}",
        "",
        f"Data: {meta['data']}: {analysis.sequences} sentences, {analysis.tokens} tokens. "
        f"Analysis pass: {analysis.seconds:.1f} s ({rate:.0f} tokens/s). Heads are `layer-head`, 0-based.",
        "",
    ]
    syntax = analysis.syntax
    if syntax is not None:
        summary = syntax.summary()
        forward, reverse = summary["dependent_to_head"], summary["head_to_dependent"]
        best = f"best fixed offset {summary['best_offset']['offset']:+d} with {summary['best_offset']['accuracy']}%."
        if syntax.causal:
            text = (
                "A causal model: a word attends only to words at or before it, so a dependent can find its head "
                f"only to its left ({forward['words']} of {syntax.words} words, {forward['share']}%) and a head its "
                f"dependent only to its left ({reverse['words']} words, {reverse['share']}%); each accuracy is over "
                f"those words. Best single head, dependent to head: {forward['head']} with {forward['accuracy']}%; "
                f"head to dependent: {reverse['head']} with {reverse['accuracy']}%. Left-branching baseline "
                f"{summary['left_branching']}%, {best.replace('fixed offset', 'left offset')}"
            )
        else:
            text = (
                f"Best single head, dependent to head: {forward['head']} with {forward['accuracy']}% parent accuracy "
                f"over {syntax.words} words; head to dependent: {reverse['head']} with {reverse['accuracy']}%. "
                f"Right-branching baseline {summary['right_branching']}%, left-branching {summary['left_branching']}%, "
                f"{best}"
            )
        reachable = " (reachable: dependent → head, head → dependent)" if syntax.causal else ""
        lines += [
            "## Syntax (word-level, Clark et al. 2019)",
            "",
            text,
            "",
            f"| relation | words{reachable} | dependent → head | head → dependent | best offset baseline |",
            "|---|---:|---|---|---|",
        ]
        for row in relations:
            words = f"{row['words']}"
            if syntax.causal:
                words += f" ({row['dependent_to_head_words']}, {row['head_to_dependent_words']})"
            lines.append(
                f"| {row['relation']} | {words} | {row['dependent_to_head_head']}: "
                f"{row['dependent_to_head_accuracy']} | {row['head_to_dependent_head']}: "
                f"{row['head_to_dependent_accuracy']} | {row['baseline_accuracy']} ({row['baseline_offset']:+d}) |"
            )
        lines.append("")
    counts = ", ".join(f"{name} {count}" for name, count in roles.counts().items() if count)
    lines += ["## Head roles", "", f"{counts} (thresholds: {vars(roles.thresholds)}).", ""]
    notable = [role for role in roles.heads if role.primary not in ("other", "pruned")]
    for role in notable[:24]:
        lines.append(f"- {role.layer}-{role.head} **{role.primary}**: {role.evidence}")
    if len(notable) > 24:
        lines.append(f"- ... {len(notable) - 24} more in roles.csv")
    statistics = analysis.statistics
    similarity = analysis.similarity.mean.tolist() if analysis.similarity is not None else None
    header = " | ".join(name.replace("_", " ") for name in SUMMARY_STATISTICS)
    lines += ["", "## Per layer (mean over heads)", "", f"| layer | {header} | token similarity |"]
    lines.append("|---" + "|---:" * (len(SUMMARY_STATISTICS) + 1) + "|")
    for layer in range(statistics["entropy"].shape[0]):
        values = " | ".join(f"{float(statistics[name][layer].nanmean()):.3f}" for name in SUMMARY_STATISTICS)
        tail = f"{similarity[layer + 1]:.3f}" if similarity is not None else ""
        lines.append(f"| {layer} | {values} | {tail} |")
    if similarity is not None:
        flagged = ", ".join("embeddings" if i == 0 else f"layer {i - 1}" for i in collapsed) or "none"
        lines += [
            "",
            f"Representation collapse (mean cosine similarity between token states above {collapse_threshold}): "
            f"{flagged}. Embedding output: {similarity[0]:.3f}.",
        ]
    top = importance["top"]
    ranked = ", ".join(f"`{item['token']}` {item['importance']:.3f}" for item in top["tokens"])
    lines += ["", "## Token importance (attention of the summary token)", "", f'"{top["sentence"]}": {ranked}', ""]
    if images:
        lines += ["## Figures", ""] + [f"![{Path(name).stem}]({name})" for name in images] + [""]
    return "\n".join(lines)


def _round(value: torch.Tensor) -> float | None:
    number = float(value)
    return None if math.isnan(number) else round(number, 4)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command line of `attnreg-analyze`, with an option per role threshold (`--broad 0.9`).

    Example:
        >>> args = build_parser().parse_args(["run.ckpt", "dev.conllu", "--base", "./minilm", "--limit", "500",
        ...                                   "--broad", "0.9"])
        >>> args.model, args.data, args.base, args.limit, args.data_format, args.out, args.broad, args.no_plots
        ('run.ckpt', 'dev.conllu', './minilm', 500, 'auto', 'attnreg-report', 0.9, False)
    """
    parser = argparse.ArgumentParser(
        prog="attnreg-analyze",
        description="Analyze the attention heads of a model on sentences and write a report folder.",
    )
    parser.add_argument("model", help="model directory, Lightning .ckpt (with --base), or Hugging Face Hub name")
    parser.add_argument("data", help="CoNLL-U file (.conllu, .conllu.gz) or text file with one sentence per line")
    parser.add_argument("--out", default="attnreg-report", help="report folder (created)")
    parser.add_argument("--base", help="for a .ckpt: the model directory or name it was fine-tuned from")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="for a .ckpt holding more than weights and plain data: unpickle it anyway (it can run code; only "
        "for a file you trust)",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory or name (default: the model's)")
    parser.add_argument(
        "--gguf-file",
        metavar="NAME",
        help="a GGUF file in the MODEL directory (or hub repository) to load, dequantized, with its tokenizer "
        "(as model=smollm2 loads SmolLM2-135M-Instruct.Q4_1.gguf)",
    )
    parser.add_argument("--format", choices=["auto", "conllu", "text"], default="auto", dest="data_format")
    parser.add_argument("--limit", type=int, help="analyze only the first N sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128, help="token limit per sentence")
    parser.add_argument(
        "--blockwise",
        choices=["auto", "on", "off"],
        default="auto",
        help="reduce each layer from its queries and keys in blocks, never building [T, T] attention (on), capture "
        "the attention of all layers (off), or blockwise for batches longer than "
        f"{BLOCKWISE_LENGTH} tokens (auto, the default); the figures are the same",
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="query rows per block (blockwise)")
    parser.add_argument("--example", type=int, default=0, help="index of the sentence drawn as heatmaps")
    parser.add_argument("--table-min-words", type=int, default=20, help="relations in the table need this many words")
    parser.add_argument("--collapse-threshold", type=float, default=0.9, help="token cosine similarity flagged")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    parser.add_argument(
        "--html", metavar="FILE", help="also write the interactive head view (attnreg.analysis.head_view), one file"
    )
    parser.add_argument("--html-sentences", type=int, default=50, help="sentences in the head view (the first N)")
    parser.add_argument(
        "--compare", metavar="MODEL", help="a second checkpoint shown beside MODEL in the head view (same --base)"
    )
    group = parser.add_argument_group("role thresholds (attnreg.analysis.RoleThresholds)")
    for name, value in vars(RoleThresholds()).items():
        group.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=f"default {value}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `attnreg-analyze`: returns 0, or exits with status 2 and the reason when MODEL or DATA
    cannot be used (the module docstring shows a full run).

    Example:
        >>> import contextlib, sys, tempfile
        >>> folder = tempfile.mkdtemp()                                # no saved model in it
        >>> with contextlib.redirect_stderr(sys.stdout):
        ...     try:
        ...         main([folder, folder + "/dev.conllu"])
        ...     except SystemExit as stop:
        ...         print("exit status", stop.code)
        attnreg-analyze: error: /... is a directory without config.json: not a saved transformers model
        exit status 2
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    try:
        model, tokenizer = load_model(args.model, args.base, args.tokenizer, args.trust_checkpoint, args.gguf_file)
        sentences = load_sentences(args.data, args.data_format, args.limit)
        _check_tokenizer(tokenizer, sentences)
        compare = None
        if args.compare:
            gguf = args.gguf_file if args.gguf_file and (Path(args.compare) / args.gguf_file).is_file() else None
            compare = load_model(args.compare, args.base, args.tokenizer, args.trust_checkpoint, gguf)[0]
    except InputError as error:
        parser.exit(2, f"attnreg-analyze: error: {error}\n")
    if not 0 <= args.example < len(sentences):
        parser.exit(
            2, f"attnreg-analyze: error: --example {args.example} is not among the {len(sentences)} sentences\n"
        )
    model.to(args.device)
    thresholds = RoleThresholds(**{name: getattr(args, name) for name in vars(RoleThresholds())})
    recorder = None
    if args.html:  # the view's arcs come from the report's own pass: no second pass, no forward per sentence
        models = [model] + ([compare.to(args.device)] if compare is not None else [])
        names = [args.model] + ([args.compare] if compare is not None else [])
        shown = sentences[: args.html_sentences]
        recorder = HeadViewRecorder(
            tokenizer, shown, models, names, max_length=args.max_length, block_size=args.block_size
        )
    blockwise = {"auto": None, "on": True, "off": False}[args.blockwise]
    started = time.perf_counter()
    analysis = analyze(
        model,
        tokenizer,
        sentences,
        batch_size=args.batch_size,
        max_length=args.max_length,
        blockwise=blockwise,
        block_size=args.block_size,
        observe=recorder.observer(0) if recorder is not None else None,
        progress=True,  # lines on stderr where it is no terminal: a long run says how far it is
    )
    meta = {"model": args.model, "data": str(args.data), "device": args.device, "threads": torch.get_num_threads()}
    out = write_report(
        analysis,
        args.out,
        model,
        tokenizer,
        sentences[args.example],
        meta,
        thresholds,
        min_relation_words=args.table_min_words,
        collapse_threshold=args.collapse_threshold,
        plots=not args.no_plots,
    )
    print(f"analyzed {analysis.sequences} sentences in {time.perf_counter() - started:.1f} s; report in {out}")
    if recorder is not None:
        analyses = [analysis]
        if compare is not None:  # the same sentences, so that the difference grid compares like with like
            print(f"analyzing {args.compare} for the head view", file=sys.stderr, flush=True)
            analyses.append(
                analyze(
                    compare,
                    tokenizer,
                    sentences,
                    batch_size=args.batch_size,
                    max_length=args.max_length,
                    similarity=False,
                    blockwise=blockwise,
                    block_size=args.block_size,
                    observe=recorder.observer(1),
                    progress=True,
                )
            )
        view = recorder.view(analyses)
        print(f"head view of {len(view.documents)} sentences in {view.save(args.html)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
