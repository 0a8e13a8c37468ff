"""Loggers of the training app beyond Lightning's own configs: MLflow on a local store (`logger=mlflow`)."""

from __future__ import annotations

import importlib
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger

from attnreg.app.cli import checked


def mlflow_logger(save_dir: str, experiment_name: str = "attnreg", run_name: str | None = None) -> MLFlowLogger:
    """Lightning's `MLFlowLogger` on a local SQLite store, `save_dir/mlflow.db`, artifacts under `save_dir/mlruns`
    (no tracking server: works offline; MLflow 3 keeps its old `./mlruns` file store in maintenance mode and refuses
    it by default). `mlflow ui --backend-store-uri sqlite:///<save_dir>/mlflow.db` shows it.

    Example:
        >>> import tempfile                                 # creating the store takes 10-20 s (its schema)
        >>> logger = mlflow_logger(tempfile.mkdtemp(), run_name="seed0")   # doctest: +SKIP
        >>> logger.log_metrics({"val/loss": 1.5}, step=0)                 # doctest: +SKIP

    `tests/test_app_decoders.py` runs it (slow). Without MLflow the run stops here with the line that installs it
    (`attnreg.app.cli.MissingExtra`), before Lightning's logger fails on its first use.
    """
    with checked("logger=mlflow"):
        for package in ("mlflow", "sqlalchemy", "alembic"):  # MLflow, then what its SQLite store needs
            importlib.import_module(package)
    folder = Path(save_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return MLFlowLogger(
        experiment_name=experiment_name,
        run_name=run_name,
        tracking_uri=f"sqlite:///{folder / 'mlflow.db'}",
        artifact_location=(folder / "mlruns").as_uri(),
    )
