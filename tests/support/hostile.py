"""Hostile inputs several test files share: a small tmpfs to fill (a full disk) and the one line a full disk is
reported in, a YAML bomb as inline text, a number too long to read, and a file cut short."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

HUGE = "1" + "0" * 5000  # past Python's 4,300-digit limit of int(): a ValueError traceback before
ENOSPC = "cannot be written: No space left on device (errno 28 ENOSPC)"


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "512k") -> Iterator[bool]:
    """A tmpfs of ``size`` mounted at ``where`` (yields True), or False where mounting is refused."""
    where.mkdir()
    if os.geteuid() != 0:
        yield False
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def read_only_view(source: Path, where: Path) -> Iterator[bool]:
    """``source`` bind-mounted read-only at ``where`` (yields True; root ignores mode bits, so a read-only mount is
    the real thing), or False where mounting is refused."""
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(source), str(where)],
                                           capture_output=True).returncode != 0:
        yield False
        return
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(where)], capture_output=True).returncode != 0:
            yield False
            return
        yield True
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def inline_laughs(levels: int = 9, width: int = 10) -> str:
    """A billion-laughs YAML bomb (nested anchors, ``width`` ** ``levels`` items) as one flow sequence: a value on a
    command line, or inside a string."""
    items = ["&a0 [lol]"] + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut ``path`` to the first ``keep`` of its bytes, as a write ended half-way leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
