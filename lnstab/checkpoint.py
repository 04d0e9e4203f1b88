"""Checkpoints that cannot run code, cannot be left half-written, and are found again.

* :class:`AtomicCheckpointIO` — Lightning's checkpoint I/O, but the file is written to a temporary file *in the
  destination directory*, fsynced and renamed over the target (``os.replace``), and the temporary file is removed on
  any failure. Lightning's default writes through ``fsspec``'s transaction, whose temporary file lives in
  ``$TMPDIR``: where that is another filesystem (usual on clusters) the final move is a copy, and a kill during it
  leaves a truncated checkpoint. Loading is ``torch.load(..., weights_only=True)``: a checkpoint is data, never code.
* :func:`load_checkpoint` — the same safe load for lnstab's own tools, with one-line errors.
* :func:`newest_checkpoint` — the newest *complete* checkpoint of a run directory (``checkpoints/*.ckpt``, sharded
  checkpoint directories, Lightning's SLURM ``hpc_ckpt_*.ckpt``), so ``--ckpt_path last`` is never older than the
  newest step checkpoint even when a kill fell between the step checkpoint and ``last.ckpt``.
"""

from __future__ import annotations

import errno
import glob
import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

from lnstab.errors import LNStabError, MachineError, first_line
from lnstab.rundir import checkpoint_dir, fsync_dir


class CheckpointError(LNStabError):
    """A checkpoint that is missing, truncated, not a checkpoint, or holds something other than data."""


class CheckpointWriteError(CheckpointError, MachineError):
    """A checkpoint the operating system would not let us write (a full disk, a file-size limit, an I/O error):
    one line naming the file and the OS's reason, which ``torch.save`` itself does not keep."""


class _Writes:
    """The file ``torch.save`` writes into, keeping the ``OSError`` of a failed write (torch replaces it with an
    ``[enforce fail at inline_container.cc]`` message that names neither the file nor the reason)."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole checkpoint: a zip file whose central directory is intact (torch's format; a
    truncated file fails this), or a sharded-checkpoint directory whose ``.metadata`` was written (last)."""
    path = Path(path)
    if path.is_dir():
        return (path / ".metadata").is_file()
    return path.is_file() and zipfile.is_zipfile(path)


def load_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", field: str = "--ckpt_path", mmap: bool = False
) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with one-line errors naming ``field``.

    Args:
        path: A checkpoint file.
        map_location: Where tensors go.
        field: The argument name used in error messages.
        mmap: Map tensors instead of reading them (cheap when only metadata such as hyperparameters is needed).

    Raises:
        CheckpointError: Missing, a directory (sharded: load it through the strategy), truncated or not a torch
            checkpoint, or holding objects outside torch's weights-only allow-list (it would have to run code).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{field} {path} is a sharded checkpoint directory; load it through the trainer")
    if not path.is_file():
        raise CheckpointError(f"{field} {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{field} {path} is not a readable checkpoint (truncated, or not a torch checkpoint)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{field} {path} holds objects that are not plain data ({first_line(exc)[:200]}); lnstab loads checkpoints "
            f"with weights_only=True and will not run code from a file"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error here
        raise CheckpointError(f"{field} {path} is not a readable checkpoint ({type(exc).__name__})") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{field} {path} is not allowed; it must hold a Lightning checkpoint (a dict)")
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints atomically on every filesystem and loads them with ``weights_only=True``.

    Save: ``torch.save`` into ``.<name>.<random>.tmp`` in the destination directory, ``fsync``, ``os.replace`` onto
    the target (replacing a symlink rather than writing through it), ``fsync`` of the directory; on any exception
    (including a signal's ``KeyboardInterrupt``) the temporary file is removed and the previous checkpoint stays
    intact; a temporary file left by a writer that was killed (SIGKILL cannot be cleaned up after) is removed by
    the next save to the same path. A write the OS refuses (a full disk: ``ENOSPC``; a file-size limit: ``EFBIG``)
    raises :class:`CheckpointWriteError`, one line naming the checkpoint and the OS's reason. Load:
    ``weights_only`` defaults to ``True``; checkpoints holding other objects are refused in one line.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"storage_options is not supported by {type(self).__name__}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # left by a writer that was SIGKILLed
            stale.unlink(missing_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise _write_error(path, exc) from None
        writes = None
        try:
            with os.fdopen(fd, "wb") as f:
                writes = _Writes(f)
                torch.save(checkpoint, writes)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            cause = writes.error if writes is not None and writes.error is not None else exc
            if isinstance(cause, OSError) and isinstance(exc, Exception):
                raise _write_error(path, cause) from None
            raise
        fsync_dir(path.parent)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Callable | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:  # the caller explicitly trusts this file
            return super().load_checkpoint(path, map_location=map_location, weights_only=False)
        return load_checkpoint(path, map_location=map_location)


def _write_error(path: Path, exc: OSError) -> CheckpointWriteError:
    code = f"errno {exc.errno} {errno.errorcode.get(exc.errno, '')}".strip() if exc.errno else type(exc).__name__
    kept = "the previous checkpoint is kept" if path.exists() else "there was no earlier file of that name"
    return CheckpointWriteError(f"checkpoint {path} cannot be written: {exc.strerror or exc} ({code}); {kept} and "
                                "no partial file is left")


def checkpoints_of(directory: str | os.PathLike) -> list[Path]:
    """Every checkpoint of a run directory (complete or not), oldest first by modification time."""
    directory = Path(directory)
    found: list[Path] = []
    ckpts = checkpoint_dir(directory)
    if ckpts.is_dir():
        found += [p for p in ckpts.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith(".")]
    found += sorted(directory.glob("hpc_ckpt_*.ckpt"))  # Lightning's SLURM requeue checkpoints
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def newest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The most recently written complete checkpoint of a run directory (``None`` if there is none).

    A symlink (``last.ckpt`` saved as a link) counts as its target's time; truncated files are skipped.
    """
    candidates = [p for p in checkpoints_of(directory) if is_complete(p)]
    return candidates[-1] if candidates else None
