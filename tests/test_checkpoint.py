"""``lnstab.checkpoint``'s writes when the operating system refuses one: a full disk, or a file-size limit.

Real OS failures, not mocks: a small tmpfs filled to the brim (ENOSPC) where ``mount`` is allowed (root), and
``RLIMIT_FSIZE`` with SIGXFSZ ignored (EFBIG) in a child process, which needs no privilege. Either way the error
is one line naming the checkpoint and the OS's reason, the previous checkpoint survives and no temporary file is
left; through ``lnstab fit`` that line is what ``summary.json`` records.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.hostile import small_tmpfs
from support.runs import tiny_config

pytestmark = pytest.mark.system  # a mounted tmpfs and a file-size rlimit, in child processes

SAVE_TWICE = r"""
import json, resource, signal, sys, torch
from lnstab.checkpoint import AtomicCheckpointIO, CheckpointWriteError
path, limit = sys.argv[1], int(sys.argv[2])
io = AtomicCheckpointIO()
io.save_checkpoint({"state_dict": {"w": torch.ones(8)}}, path)
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    io.save_checkpoint({"state_dict": {"w": torch.zeros(400_000)}}, path)
    print(json.dumps({"error": None}))
except CheckpointWriteError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def save_twice(path: Path, limit: int) -> str | None:
    """Save a small checkpoint, then a 1.6 MB one under ``limit`` bytes per file (0: none); the second's error."""
    done = subprocess.run([sys.executable, "-c", SAVE_TWICE, str(path), str(limit)], capture_output=True, text=True,
                          cwd=path.parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["error"]


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_survives(tmp_path) -> None:
    import torch

    from lnstab.checkpoint import load_checkpoint

    with small_tmpfs(tmp_path / "disk") as mounted:
        path = tmp_path / "disk" / "ckpts" / "last.ckpt"
        error = save_twice(path, 0 if mounted else 300_000)
        reason = "No space left on device (errno 28 ENOSPC)" if mounted else "File too large (errno 27 EFBIG)"
        assert error == (f"checkpoint {path} cannot be written: {reason}; the previous checkpoint is kept and no "
                         f"partial file is left"), error
        assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file
        assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(8))


def test_a_file_size_limit_is_one_line_too(tmp_path) -> None:
    path = tmp_path / "ckpts" / "last.ckpt"
    error = save_twice(path, 300_000)
    assert error is not None and f"checkpoint {path} cannot be written: File too large (errno 27 EFBIG)" in error
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_refused_first_write_does_not_claim_a_previous_checkpoint(tmp_path) -> None:
    """The first save of a name refused (a run's final ``last.ckpt`` on a disk that filled during training) said
    "the previous checkpoint is kept" of a file that never existed."""
    path = tmp_path / "ckpts" / "last.ckpt"
    script = SAVE_TWICE.replace('io.save_checkpoint({"state_dict": {"w": torch.ones(8)}}, path)\n', "")
    assert script != SAVE_TWICE
    done = subprocess.run([sys.executable, "-c", script, str(path), "300000"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error == (f"checkpoint {path} cannot be written: File too large (errno 27 EFBIG); there was no earlier "
                     "file of that name and no partial file is left"), error
    assert list(path.parent.iterdir()) == []


def test_lnstab_fit_records_the_refused_write_in_one_line(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"

    def limit_file_size() -> None:  # in the child: checkpoints (~1.3 MB) fail, the run's small files do not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, 512 * 1024))

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lnstab.cli", "fit", "--config", str(cfg), "--run_dir", str(run)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, preexec_fn=limit_file_size,
                          timeout=600)
    last = done.stderr.strip().splitlines()[-1]
    ckpt = run / "checkpoints" / "epoch=0-step=2.ckpt"
    assert done.returncode == 1, done.stderr[-3000:]  # the machine refused, not the input: a failed run
    assert last.startswith(f"lnstab: error: checkpoint {ckpt} cannot be written: File too large"), last
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith(f"CheckpointWriteError: checkpoint {ckpt} cannot be written: File too large")
    assert not any(p.name.endswith(".tmp") for p in (run / "checkpoints").iterdir())
