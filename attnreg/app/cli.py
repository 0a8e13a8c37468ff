"""The console commands (`[project.scripts]` in pyproject.toml): `attnreg-train`, `attnreg-analyze` and
`attnreg-collect`, each importing its module only once it knows the extras that module needs are there.

An install without an extra a command needs stops with the `pip install "attnreg[...]"` line to run, not an
ImportError from deep inside: the app (`attnreg-train`, `attnreg-analyze`, `python -m attnreg.app.view`) without
Lightning, `attnreg-analyze` without matplotlib for its PNGs (or `--no-plots`), `logger=mlflow` without MLflow
(`attnreg.app.loggers`). `EXTRAS` says which extra brings which package.

Example:
    >>> import sys
    >>> from unittest import mock
    >>> with mock.patch.dict(sys.modules, {"lightning": None}):   # as if Lightning were not installed
    ...     try:
    ...         with checked("attnreg-train"):
    ...             import lightning
    ...     except MissingExtra as stop:
    ...         print(stop)
    attnreg-train needs lightning (import of lightning halted; None in sys.modules): pip install "attnreg[lightning]"
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

EXTRAS = {
    # The app and the Lightning adapter. Hydra and OmegaConf are attnreg's own dependencies: the line reinstalls them.
    "lightning": "lightning",
    "lightning_fabric": "lightning",
    "lightning_utilities": "lightning",
    "torchmetrics": "lightning",
    "hydra": "lightning",
    "omegaconf": "lightning",
    "mlflow": "mlflow",  # logger=mlflow (mlflow-skinny, on a local SQLite store)
    "sqlalchemy": "mlflow",
    "alembic": "mlflow",
    "matplotlib": "plots",
    "spacy": "parse",
    "en_core_web_sm": "parse",
    "accelerate": "hf",
    "peft": "peft",
    "trl": "trl",
    "datasets": "hub",
    "tensorboard": "tensorboard",
    "gguf": "export",
    "onnx": "export",
    "onnxruntime": "export",
    "onnxscript": "export",
    "llama_cpp": "llamacpp",
    "playwright": "dev",
}
"""The top-level package of each import an extra provides, and that extra (`[project.optional-dependencies]`)."""


def pip_line(extra: str) -> str:
    """The line that installs `extra`.

    Example:
        >>> pip_line("mlflow")
        'pip install "attnreg[mlflow]"'
    """
    return f'pip install "attnreg[{extra}]"'


class MissingExtra(SystemExit):
    """A command needs an extra that is not installed: its message ends with the pip line to run. A `SystemExit`, so
    the command exits with status 1 and that message, without a traceback (Hydra and its `instantiate` let it
    through)."""


def missing_extra(what: str, error: ImportError) -> str | None:
    """The message saying that `what` needs the extra whose package `error` failed to import, with the pip line; None
    when that package is not one of an extra (`EXTRAS`).

    Example:
        >>> missing_extra("logger=mlflow", ModuleNotFoundError("No module named 'mlflow'", name="mlflow"))
        'logger=mlflow needs mlflow (No module named \\'mlflow\\'): pip install "attnreg[mlflow]"'
        >>> missing_extra("attnreg-train", ModuleNotFoundError("No module named 'foo'", name="foo")) is None
        True
    """
    package = (error.name or "").split(".")[0]
    extra = EXTRAS.get(package)
    return None if extra is None else f"{what} needs {package} ({error}): {pip_line(extra)}"


@contextmanager
def checked(what: str, exit: bool = True) -> Iterator[None]:
    """Around imports: an ImportError of an extra's package (`EXTRAS`) becomes `MissingExtra` (`exit`), else an
    ImportError whose message is `missing_extra`'s; any other ImportError goes on as it was."""
    try:
        yield
    except ImportError as error:
        message = missing_extra(what, error)
        if message is None:
            raise
        if exit:
            raise MissingExtra(message) from error
        raise ImportError(message, name=error.name) from error


def train() -> None:
    """`attnreg-train` (`attnreg.app.train.main`)."""
    with checked("attnreg-train"):
        from attnreg.app.train import main
    main()


def analyze(argv: Sequence[str] | None = None) -> int:
    """`attnreg-analyze` (`attnreg.app.analyze.main`): its PNGs need matplotlib, checked before the analysis runs
    unless `--no-plots` (or `--help`) is given."""
    with checked("attnreg-analyze"):
        from attnreg.app.analyze import main
    args = sys.argv[1:] if argv is None else list(argv)
    if not any(arg in ("-h", "--help") or arg.startswith("--no-p") for arg in args):  # --no-p: argparse's prefix
        with checked("attnreg-analyze (its PNGs; --no-plots writes none)"):
            import matplotlib  # noqa: F401
    return main(argv)


def collect(argv: Sequence[str] | None = None) -> None:
    """`attnreg-collect` (`attnreg.app.collect.main`)."""
    with checked("attnreg-collect"):
        from attnreg.app.collect import main
    main(argv)
