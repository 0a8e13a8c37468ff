"""The app's `export=` setting: the trained (pruned) model written where it is served, next to `pruned_model/`, in
`<run dir>/export/`: `transformers/` (a plain checkpoint, `attnreg.export.export_transformers`), `model.gguf`
(llama.cpp, `export_gguf`) and `model.onnx` (ONNX Runtime, `export_onnx`).

    attnreg-train experiment=tiny_llama_pruning 'export=[transformers,gguf]'

What the family alone rules out is refused before training (`check_exports`); what depends on the heads kept (one
count for all layers, for `transformers`) is checked by the export at the end, after the model is saved, so a refusal
there leaves the trained model and its summary in the run folder and then fails the run, naming the reason.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig
from torch import nn

from attnreg.export import FORMATS, ExportError, check_export, export_gguf, export_onnx, export_transformers

log = logging.getLogger(__name__)

WRITTEN = {"transformers": "transformers", "gguf": "model.gguf", "onnx": "model.onnx"}
"""Where each format goes, under `<run dir>/export/`."""


def export_formats(cfg: DictConfig) -> list[str]:
    """The formats `export=` asks for: a list, one name, or none (`null`, `[]`); an unknown name is refused.

    Example:
        >>> from omegaconf import OmegaConf
        >>> export_formats(OmegaConf.create({"export": ["gguf", "transformers"]})), export_formats(OmegaConf.create({}))
        (['gguf', 'transformers'], [])
        >>> export_formats(OmegaConf.create({"export": "onnxx"}))
        Traceback (most recent call last):
        ...
        ValueError: export=onnxx: unknown format 'onnxx'; the formats are ['transformers', 'gguf', 'onnx']
        >>> export_formats(OmegaConf.create({"export": 5}))
        Traceback (most recent call last):
        ...
        ValueError: export=5: give a format or a list of them, of ['transformers', 'gguf', 'onnx']
    """
    value = cfg.get("export")
    if not isinstance(value, str | ListConfig | list | type(None)):
        raise ValueError(f"export={value!r}: give a format or a list of them, of {list(FORMATS)}")
    formats = [] if value is None else [value] if isinstance(value, str) else [str(name) for name in value]
    for name in formats:
        if name not in FORMATS:
            raise ValueError(f"export={value}: unknown format {name!r}; the formats are {list(FORMATS)}")
    return formats


def check_exports(formats: Sequence[str], model: nn.Module) -> None:
    """Refuse before training the formats the model's family cannot be written in (`attnreg.export.check_export`),
    naming the setting.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> check_exports(["gguf"], tiny_model("bert"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        attnreg.export.ExportError: export=[gguf]: cannot write BertModel as GGUF: family 'bert' is not ...
    """
    try:
        check_export(model, formats)
    except ExportError as error:
        raise ExportError(f"export=[{','.join(formats)}]: {error}") from None


def write_exports(
    formats: Sequence[str], model: nn.Module, output_dir: str | Path, tokenizer: Any, gguf_file: str | Path | None
) -> dict[str, str]:
    """Write `model` in each of `formats` under `<output_dir>/export/`; returns {format: path}. The GGUF file takes
    its vocabulary from `gguf_file` (the model's own GGUF, as `model=smollm2` loads) where given, else from
    `tokenizer` where it is a byte-level BPE (llama.cpp's `gpt2` vocabulary), else none: llama.cpp then takes token
    ids, and the log says why. Every format is tried; refusals are raised together at the end, each naming its reason.
    """
    folder = Path(output_dir) / "export"
    written, refused = {}, []
    for name in formats:
        target = folder / WRITTEN[name]
        try:
            if name == "transformers":
                export_transformers(model, target, tokenizer=tokenizer)
            elif name == "gguf":
                export_gguf(model, target, **_vocabulary(tokenizer, gguf_file))
            else:
                export_onnx(model, target)
        except ExportError as error:
            refused.append(f"{name}: {error}")
        else:
            written[name] = str(target)
    if refused:
        raise ExportError(
            f"export: the trained model is saved in {output_dir} (see summary.json), but " + " | ".join(refused)
        )
    return written


def _vocabulary(tokenizer: Any, gguf_file: str | Path | None) -> dict[str, Any]:
    """The GGUF file's vocabulary source: the model's own GGUF file, else a byte-level BPE tokenizer, else none."""
    if gguf_file:
        return {"tokenizer_gguf": gguf_file}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = json.loads(backend.to_str()).get("model", {}).get("type") if backend is not None else None
    if kind == "BPE":
        return {"tokenizer": tokenizer}
    log.warning(
        "export=gguf: the tokenizer (%s, model %s) is not a byte-level BPE, which llama.cpp's vocabulary needs: the "
        "GGUF file holds no vocabulary, and llama.cpp takes token ids",
        type(tokenizer).__name__,
        kind,
    )
    return {}
