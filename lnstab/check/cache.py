"""The reference runs of ``lnstab check``, kept between cards on one machine: a run is reused when its key (everything
it depends on, :func:`run_key`) is the same; the checked model's runs are never kept (docs/check/README.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lnstab.check.runspec import RunResult
from lnstab.check.subjects import REFERENCES
from lnstab.safeload import load_json

REFERENCE_KEYS = tuple(REFERENCES)  # the subjects whose runs are kept
ENV = "LNSTAB_CHECK_CACHE"
RESULT = "result.json"


def cache_root(no_cache: bool = False) -> Path | None:
    """Where the reference runs are kept: ``$LNSTAB_CHECK_CACHE`` (``off`` or ``0``: nowhere), else
    ``$XDG_CACHE_HOME/lnstab/check`` (``~/.cache/lnstab/check``); ``None`` with ``no_cache``."""
    value = os.environ.get(ENV, "")
    if no_cache or value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lnstab" / "check"


@functools.cache
def source_digest() -> str:
    """sha256 of lnstab's Python source (the package and its callbacks and data modules), in path order."""
    digest = hashlib.sha256()
    for name in ("lnstab", "lnstab.callbacks", "lnstab.datamodules"):
        spec = importlib.util.find_spec(name)
        for where in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(where).glob("*.py")) if name != "lnstab" else sorted(Path(where).rglob("*.py")):
                digest.update(str(path.relative_to(where)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def run_key(job: Any, threads: int) -> str | None:
    """The key of ``job``'s run (a :class:`~lnstab.check.workers.Job`); ``None``: no ``job.cache`` or no reference."""
    subject = job.subject
    if job.cache is None or subject.key not in REFERENCE_KEYS or subject.config is None:
        return None
    tokens = job.tokens.contiguous()
    what = {
        "config": dataclasses.asdict(subject.config), "shape": dataclasses.asdict(subject.shape),
        "sites": dataclasses.asdict(subject.sites), "z_loss": subject.z_loss, "lr": job.lr, "seed": job.seed,
        "settings": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in job.settings.items()},
        "tokens": [list(tokens.shape), str(tokens.dtype), hashlib.sha256(tokens.numpy().tobytes()).hexdigest()],
        "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "threads": threads,
        "source": source_digest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def log_dir(job: Any) -> Path:
    """Where :func:`~lnstab.check.training.stress_run` writes ``job``'s logs (TensorBoardLogger's layout)."""
    return Path(job.log_root) / job.subject.key / f"lr{job.lr:g}_seed{job.seed}"


def load(job: Any, key: str) -> RunResult | None:
    """The run of ``key`` in ``job.cache``, its logs copied to ``job``'s log directory, or ``None``: absent, unreadable
    (the entry is removed, to be written anew) or not copied (a full disk: the run trains; its own write says so)."""
    entry = job.cache / key
    if not (entry / RESULT).is_file():
        return None
    try:
        data = load_json(entry / RESULT)
        data["metrics"] = {int(step): values for step, values in data["metrics"].items()}
        result = RunResult(**{**data, "log_dir": str(log_dir(job)), "cached": True})
        same = (result.subject, result.lr, result.seed) == (job.subject.key, job.lr, job.seed)
        if not same or not (entry / "logs").is_dir():
            raise ValueError(f"{entry} is not the run of its key")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        shutil.rmtree(entry, ignore_errors=True)
        return None
    try:
        shutil.copytree(entry / "logs", log_dir(job), dirs_exist_ok=True)
    except OSError:
        shutil.rmtree(log_dir(job), ignore_errors=True)
        return None
    return result


def store(root: Path, key: str, result: RunResult) -> None:
    """Keep ``result`` and its logs under ``key`` (written aside, then renamed into place: a reader never sees half
    an entry). Best effort: a cache that cannot be written costs only the next card's time."""
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=root))
        try:
            shutil.copytree(result.log_dir, stage / "logs")
            fields = {**dataclasses.asdict(result), "log_dir": "", "cached": False}
            (stage / RESULT).write_text(json.dumps(fields))
            os.rename(stage, root / key)
        except OSError:
            shutil.rmtree(stage, ignore_errors=True)
