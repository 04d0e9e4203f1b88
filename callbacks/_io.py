"""Run-directory helpers shared by lnstab's callbacks and CLI: where a run writes, atomic files, the summary file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

SUMMARY_FILE = "summary.json"


def run_dir(trainer: pl.Trainer) -> Path:
    """The run's directory: the logger's ``log_dir`` where there is one, else ``trainer.default_root_dir``.

    Same rule as ``trainer.log_dir`` but without its ``strategy.broadcast``: this is called from rank-zero-only
    code, where a collective would hang (or crash) the other ranks.
    """
    if trainer.loggers:
        logger = trainer.loggers[0]
        directory = getattr(logger, "log_dir", None) or logger.save_dir
        if directory:
            return Path(directory)
    return Path(trainer.default_root_dir)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_summary(directory: str | os.PathLike) -> dict[str, Any]:
    """The run summary in ``directory`` (``{}`` when there is none yet)."""
    path = Path(directory) / SUMMARY_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


@rank_zero_only
def update_summary(trainer: pl.Trainer, **fields: Any) -> None:
    """Merge ``fields`` into the run's ``summary.json`` (rank zero, atomic); nested dicts are merged one level."""
    directory = run_dir(trainer)
    summary = read_summary(directory)
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key] = {**summary[key], **value}
        else:
            summary[key] = value
    atomic_write_text(directory / SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
