"""Kills and signals: a signalled run stops at a step boundary with a checkpoint it resumes from exactly; a
checkpoint is never half-written, whatever kills its writer; a checkpoint that would run code is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.runs import fit, tiny_config, weights

from lnstab.checkpoint import AtomicCheckpointIO, CheckpointError, is_complete, load_checkpoint
from lnstab.rundir import read_summary

LNSTAB = str(Path(sys.executable).with_name("lnstab"))


def start(cfg: Path, run: Path, *extra: str, new_session: bool = False) -> subprocess.Popen:
    cmd = [LNSTAB, "fit", "--config", str(cfg), "--run_dir", str(run), "--trainer.max_steps", "100000", *extra]
    # the legs run in this process are compared bitwise with this one: same thread count, same reduction order
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])  # both, whichever auto picks on this CPU
def test_sigterm_stops_at_a_step_boundary_and_resumes_exactly(tmp_path, precision: str) -> None:
    cfg = tiny_config(tmp_path, **{"evaluation.n_samples": 2})
    cfg.write_text(cfg.read_text().replace("precision: 32-true", f"precision: {precision}"))
    assert f"precision: {precision}" in cfg.read_text()
    run = tmp_path / "run"
    proc = start(cfg, run)
    wait_for(run / "checkpoints" / "last.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "weights_only" not in out, out[-3000:]  # Lightning's "`weights_only` was not set" on the stop's save
    summary = read_summary(run)
    step = summary["interrupted_step"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["final_step"] == step
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step
    assert not (run / "eval.json").exists()  # an interrupted run is resumed, not evaluated
    assert summary.get("val", {}).get("step") != step  # nor validated on the way out (SLURM's grace is short)
    target = str(step + 3)
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", target)
    fit("--config", str(cfg), "--run_dir", str(tmp_path / "straight"), "--trainer.max_steps", target)
    resumed, straight = weights(run / "checkpoints" / "last.ckpt"), weights(tmp_path / "straight" / "checkpoints" /
                                                                             "last.ckpt")
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
    assert read_summary(run)["status"] == "completed"


@pytest.mark.slow
@pytest.mark.system
def test_ctrl_c_to_the_whole_process_group_with_loader_workers(tmp_path) -> None:
    """A terminal's Ctrl-C reaches the DataLoader workers too; the run must still stop cleanly."""
    cfg = tiny_config(tmp_path)
    cfg.write_text(cfg.read_text().replace("num_workers: 0", "num_workers: 2"))
    run = tmp_path / "run"
    proc = start(cfg, run, new_session=True)
    wait_for(run / "checkpoints" / "last.ckpt", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == summary["final_step"]


def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    real_save = torch.save

    def save_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise KeyboardInterrupt  # a signal arriving during the write

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(3))
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_the_temporary_file_is_in_the_destination_whatever_tmpdir_says(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-dir"))  # another filesystem, or none at all
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    io, path = AtomicCheckpointIO(), tmp_path / "out" / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}}, path)
    assert is_complete(path) and torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.arange(4.0))


@pytest.mark.slow
@pytest.mark.system
def test_sigkill_during_writes_never_leaves_a_truncated_checkpoint(tmp_path) -> None:
    path = tmp_path / "last.ckpt"
    writer = (
        "import sys, torch\n"
        "from lnstab.checkpoint import AtomicCheckpointIO\n"
        "io = AtomicCheckpointIO()\n"
        "i = 0\n"
        "while True:\n"
        "    io.save_checkpoint({'i': i, 'w': torch.full((1_000_000,), float(i))}, sys.argv[1])\n"
        "    i += 1\n"
    )
    seen = set()
    for delay in (0.03, 0.11, 0.23):  # after the first complete write, at different points of later writes
        proc = subprocess.Popen([sys.executable, "-c", writer, str(path)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            path.exists() and any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        ):
            time.sleep(0.005)  # wait until one write is complete and the next one has begun
        time.sleep(delay)
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait()
        if path.exists():
            ckpt = load_checkpoint(path)  # complete, whatever moment the kill hit
            assert torch.all(ckpt["w"] == ckpt["i"])
            seen.add(ckpt["i"])
        leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert len(leftovers) <= 1  # at most the killed write's own; the next save removes it
    assert path.exists() and seen, "no checkpoint was ever completed"
    AtomicCheckpointIO().save_checkpoint({"i": -1}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(tmp_path, capsys) -> None:
    bad, marker = tmp_path / "evil.ckpt", tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match="holds objects that are not plain data"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError):
        AtomicCheckpointIO().load_checkpoint(bad)
    from lnstab.cli import main

    cfg = tiny_config(tmp_path)
    for sub in ("fit", "evaluate"):
        with pytest.raises(SystemExit) as info:
            main([sub, "--config", str(cfg), "--ckpt_path", str(bad)])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "holds objects that are not plain data" in err and "\n" not in err
    assert not marker.exists()  # the payload never ran


WORKERS_SCRIPT = """
import os, signal, sys
from lnstab.datamodules import OpenWebTextDataModule
from lnstab.datamodules import openwebtext

def parent_handler(signum, frame):  # what Lightning's SLURM requeue handler is to a forked worker
    if os.getpid() != main_pid:
        open(sys.argv[1], "a").write(f"{os.getpid()} ran the parent's handler for {signum}\\n")

main_pid = os.getpid()
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(s, parent_handler)
masks = []
def recording_init(worker_id):  # the mask a worker starts with, before ignore_stop_signals runs
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    open(sys.argv[1] + ".mask", "a").write(" ".join(sorted(str(int(s)) for s in blocked)) + "\\n")
    openwebtext.ignore_stop_signals(worker_id)
dm = OpenWebTextDataModule(block_size=16, batch_size=2, source="synthetic", synthetic_vocab_size=97,
                           synthetic_tokens=20_000, val_tokens=1_000, num_workers=2)
dm.setup("fit")
loader = dm.train_dataloader()
loader.worker_init_fn = recording_init
it = iter(loader)
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
sys.stdin.readline()  # the test signals the workers meanwhile
for _ in range(4):
    next(it)
print("ok", flush=True)
# leave with the iterator and its workers alive: multiprocessing terminates and joins them at exit
"""


@pytest.mark.system
def test_loader_workers_ignore_stop_signals_from_others_and_end_with_their_parent(tmp_path) -> None:
    """SIGINT, SIGTERM, SIGUSR1, SIGUSR2 and SIGHUP from another process (a terminal, a scheduler signalling every
    process of a job) leave the workers serving batches and never run a handler they inherited from the parent (a
    worker once ran Lightning's SLURM requeue handler on SIGUSR1 and died); workers start with those signals blocked,
    so none arrives before they are ignored; the parent's exit with a live iterator still ends them (a worker that
    ignored every SIGTERM hung it for ever)."""
    record = tmp_path / "record"
    proc = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT, str(record)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",  # workers killed at exit leave their
                                 "TMPDIR": str(tmp_path)})  # multiprocessing temp dirs: here, not in /tmp
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        for pid in pids:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
                os.kill(pid, s)
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "ok", err[-3000:]
    assert not record.exists(), record.read_text()
    masks = [set(map(int, line.split())) for line in Path(f"{record}.mask").read_text().splitlines()]
    expected = {int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)}
    assert len(masks) == 2 and all(expected <= m for m in masks), masks
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
