r"""Readers for the sentence-classification sets used by benchmarks and the training app: CoLA and SST-2
in their original local formats (no download).

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())                   # the SST-2 folder, as GLUE ships it
    >>> _ = (folder / "dev.tsv").write_text("sentence\tlabel\na fine film \t1\ndull .\t0\n")
    >>> read_sst2(folder, "dev")                           # read_cola(folder, "train") for CoLA
    (['a fine film', 'dull .'], [1, 0])
"""

from __future__ import annotations

import csv
from pathlib import Path

COLA_FILES = {"train": "in_domain_train.tsv", "dev": "in_domain_dev.tsv", "dev_out": "out_of_domain_dev.tsv"}
SST2_FILES = {"train": "train.tsv", "dev": "dev.tsv"}


def read_cola(directory: str | Path, split: str = "train") -> tuple[list[str], list[int]]:
    r"""CoLA 1.1 raw TSV (source, label, original mark, sentence): texts and 0/1 acceptability labels.

    `directory` is the CoLA folder (holding `raw/`) or the `raw/` folder itself.

    Example:
        >>> import tempfile
        >>> raw = Path(tempfile.mkdtemp(), "raw"); raw.mkdir()
        >>> _ = (raw / "in_domain_dev.tsv").write_text("gj04\t1\t\tThe keys are here.\ngj04\t0\t*\tThe keys is here.\n")
        >>> read_cola(raw.parent, "dev")
        (['The keys are here.', 'The keys is here.'], [1, 0])
    """
    path = _split_file(directory, split, COLA_FILES, "raw")
    texts, labels = [], []
    for line, row in enumerate(_rows(path), start=1):
        if len(row) != 4 or row[1] not in ("0", "1"):
            raise ValueError(f"{path}:{line}: expected 4 tab-separated fields with label 0 or 1, got {row!r}")
        texts.append(row[3])
        labels.append(int(row[1]))
    return texts, labels


def read_sst2(directory: str | Path, split: str = "train") -> tuple[list[str], list[int]]:
    """SST-2 in GLUE format (header `sentence<TAB>label`): texts and 0/1 sentiment labels.

    Example:
        >>> import tempfile
        >>> read_sst2(tempfile.mkdtemp(), "test")
        Traceback (most recent call last):
        ...
        ValueError: split must be one of ['dev', 'train'], got 'test'
    """
    path = _split_file(directory, split, SST2_FILES)
    rows = _rows(path)
    if not rows or rows[0] != ["sentence", "label"]:
        raise ValueError(f"{path}:1: expected the header 'sentence<TAB>label', got {rows[:1]!r}")
    texts, labels = [], []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != 2 or row[1] not in ("0", "1"):
            raise ValueError(f"{path}:{line}: expected a sentence and a label 0 or 1, got {row!r}")
        texts.append(row[0].strip())
        labels.append(int(row[1]))
    return texts, labels


def _split_file(directory: str | Path, split: str, files: dict[str, str], subfolder: str | None = None) -> Path:
    if split not in files:
        raise ValueError(f"split must be one of {sorted(files)}, got {split!r}")
    directory = Path(directory)
    if subfolder and (directory / subfolder).is_dir():
        directory = directory / subfolder
    path = directory / files[split]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (looked for the {split!r} split in {directory})")
    return path


def _rows(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        return list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
