"""pytest runs the docstring examples of the `attnreg` package as doctests (pyproject: `--doctest-modules`).

The modules below still hold examples that need objects the example does not build (`model`, `batch`,
data files): their doctests are collected, so every module is still imported, but skipped. Take a module
off the list once its examples run.
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).parent

PENDING_DOCTESTS = {
    "attnreg/__init__.py",
    "attnreg/analyze.py",
    "attnreg/methods/gating.py",
    "attnreg/models.py",
    "attnreg/plots.py",
    "attnreg/pruning/gates.py",
    "attnreg/train.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="docstring examples not runnable yet (conftest.PENDING_DOCTESTS)")
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.path.relative_to(ROOT).as_posix() in PENDING_DOCTESTS:
            item.add_marker(skip)
