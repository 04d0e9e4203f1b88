"""Reading nanoGPT-style prepared token files: ``DIR/train.bin``, ``DIR/val.bin`` (raw uint16) and ``DIR/meta.json``.

``meta.json`` (written last, atomically, by ``lnstab prepare``)::

    {"format": "lnstab-prepared/1", "tokenizer": "gpt2", "dtype": "uint16", "eot": 50256,
     "source": {...the TextSpec...}, "split": {"method": "nanogpt", "test_size": 0.0005, "seed": 2357},
     "invalid_utf8_documents": 0, "blank_documents": 0,
     "inputs": {"files": F, "bytes": B, "sha256": "..."},   # --source files only: the files' names and sizes
     "splits": {"train": {"file": "train.bin", "tokens": N, "documents": D, "bytes": 2N, "sha256": "..."},
                "val":   {...}}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from lnstab.datamodules.text import DataError
from lnstab.rundir import sha256_file  # noqa: F401  (this module's API since lnstab prepare)

META_FORMAT = "lnstab-prepared/1"


def read_meta(directory: str | os.PathLike) -> dict:
    """``DIR/meta.json``, checked for format.

    Raises:
        DataError: If the directory or meta.json is missing, unreadable or of another format.
    """
    path = Path(directory) / "meta.json"
    if not Path(directory).is_dir():
        raise DataError(f"--data.path {directory} is not a directory; prepare one with `lnstab prepare --out DIR`")
    if not path.is_file():
        raise DataError(f"--data.path {directory} has no meta.json; it is not (fully) prepared by `lnstab prepare`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not valid JSON ({type(exc).__name__}); re-run `lnstab prepare`") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise DataError(
            f"{path} has format {meta.get('format') if isinstance(meta, dict) else None!r}; allowed: {META_FORMAT!r}"
        )
    return meta


def verify_split(directory: str | os.PathLike, meta: dict, split: str, checksum: bool = True) -> Path:
    """The path of ``split``'s token file after checking its size (and sha256) against ``meta``.

    Raises:
        DataError: If the file is missing, truncated/extended, or its checksum differs.
    """
    entry = meta.get("splits", {}).get(split)
    if not entry:
        raise DataError(f"{Path(directory) / 'meta.json'} has no split {split!r}; allowed: train, val")
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise DataError(f"{path} is missing; meta.json lists it with {entry['tokens']} tokens")
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = path.stat().st_size
    if size != entry["tokens"] * itemsize:
        raise DataError(
            f"{path} is {size} bytes; meta.json expects {entry['tokens'] * itemsize} "
            f"({entry['tokens']} tokens): the file is truncated or corrupt, re-run `lnstab prepare`"
        )
    if checksum and sha256_file(path) != entry["sha256"]:
        raise DataError(
            f"{path} has a sha256 that differs from meta.json: the file is corrupt, re-run `lnstab prepare`"
        )
    return path
