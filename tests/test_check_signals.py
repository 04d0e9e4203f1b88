"""Signals and a killed parent under ``lnstab check``: real signals to a real ``lnstab check`` process whose stress
runs never end by themselves (``check_factories:waiting_lm``), so each signal lands in the middle of the ladder.

A signal ends a check at once with one line and ``128 + signal``, no traceback from any process, no verdict, the
run directory saying so, and no worker process left behind; the workers die with the parent however it dies; an
interrupted ``--validate --overwrite`` leaves the earlier validation as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.check import TINY, check

from lnstab.check.signals import Interrupted, deferred, interruptible
from lnstab.check.validation import run as validate
from lnstab.cli import main

TESTS = Path(__file__).parent
WAITING = ["--factory", "check_factories:waiting_lm", "--layer-pattern", r"layers\.(\d+)$", "--no-reference",
           "--lrs", "1e-3,1e-2,1e-1"]
SHAPE = ["--model.preset", "tiny", "--model.vocab_size", "128", "--model.block_size", "32"]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(condition, what: str, limit: float = 120.0) -> None:
    """Poll ``condition`` until it holds (a wait for a state, not a timing: the limit only stops a hung test)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def start(tmp_path: Path, workers: int) -> tuple[subprocess.Popen, Path, Path]:
    """``lnstab check`` on the waiting model in its own session; the process, its --out and the marks directory."""
    marks, out = tmp_path / "marks", tmp_path / "card"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1", "LNSTAB_TEST_MARKS": str(marks)}
    cmd = [str(Path(sys.executable).with_name("lnstab")), "check", *WAITING,
           *TINY, "--workers", str(workers), "--threads", str(workers), "--out", str(out)]  # the later flags win
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, out, marks


def running(marks: Path, n: int) -> list[int]:
    """Wait until ``n`` processes are in a stress run; their pids."""
    wait_for(lambda: len(list(marks.iterdir())) >= n, f"{n} stress run(s) to start")
    return [int(p.name) for p in marks.iterdir()]


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.parametrize(("signum", "group", "workers"), [
    (signal.SIGINT, True, 2),  # Ctrl-C: the terminal sends it to the whole process group, workers included
    (signal.SIGTERM, False, 2),  # kill, a scheduler's stop
    (signal.SIGTERM, True, 2),  # timeout(1), systemd: the whole group
    (signal.SIGHUP, False, 2),  # the terminal or ssh session closed
    (signal.SIGTERM, False, 1),  # the runs in the check's own process
])
def test_a_signal_ends_the_check_at_once_in_one_line_with_no_worker_left(tmp_path, capsys, signum, group,
                                                                         workers) -> None:
    proc, out, marks = start(tmp_path, workers)
    pids = running(marks, workers)  # every worker is inside a run that never ends by itself
    (os.killpg if group else os.kill)(proc.pid, signum)
    stdout, stderr = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert stderr.count("\n") == 1 and stderr.startswith(f"lnstab: lnstab check stopped by {name}; no verdict ("), \
        stderr[-3000:]
    assert f"0 of 3 stress runs finished; their logs are in {out}" in stderr and "Traceback" not in stdout + stderr
    assert not (out / "report.json").exists() and f"{name} ended this check" in (out / "interrupted.txt").read_text()
    wait_for(lambda: not any(alive(p) for p in pids if p != proc.pid), "the workers to end", limit=30)
    with pytest.raises(SystemExit) as again:
        main(["check", *SHAPE, *TINY, "--out", str(out)])
    said = capsys.readouterr().err
    assert again.value.code == 2 and "a check a signal ended" in said and "never overwrites" in said


@pytest.mark.slow
@pytest.mark.system
def test_the_workers_die_with_a_killed_parent(tmp_path) -> None:
    proc, _, marks = start(tmp_path, 2)
    pids = running(marks, 2)
    assert proc.pid not in pids and all(alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up code runs in the parent
    proc.communicate(timeout=120)
    wait_for(lambda: not any(alive(p) for p in pids), "the orphaned workers to end", limit=30)


@pytest.mark.system
def test_a_signal_inside_a_deferred_block_is_raised_once_the_block_is_done() -> None:
    written, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info, interruptible():
        with deferred():
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered here: held back
            written.append("all of it")
        written.append("never")
    assert info.value.signum == signal.SIGTERM and written == ["all of it"]
    assert signal.getsignal(signal.SIGTERM) == before


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.system
def test_an_interrupted_overwrite_leaves_the_earlier_validation_as_it_was(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "validation"
    args = ["check", "--validate", *SHAPE, *TINY, "--lrs", "1e-2", "--rows", "pre-ln,peri-ln", "--out", str(out)]
    with pytest.raises(SystemExit):
        main(args)
    before = tree(out)
    assert "pre-ln/report.json" in before and "README.md" in before
    real = validate.run_ladder

    def ladder_then_ctrl_c(*a, **k):
        runs = real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once the runs are done, before any card is written
        return runs

    monkeypatch.setattr(validate, "run_ladder", ladder_then_ctrl_c)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([*args, "--overwrite"])
    err = capsys.readouterr().err
    assert info.value.code == 130 and err.strip() == (
        f"lnstab: lnstab check --validate stopped by SIGINT; no verdict; nothing in {out} was replaced")
    assert tree(out) == before  # every card, summary and README byte for byte

    monkeypatch.setattr(validate, "run_ladder", real)
    real_write = validate.atomic_write_text

    def write_under_sigterm(path, text):
        if path.name == "summary.json":
            os.kill(os.getpid(), signal.SIGTERM)  # as the new cards are swapped in: held back until they all are
        real_write(path, text)

    monkeypatch.setattr(validate, "atomic_write_text", write_under_sigterm)
    with pytest.raises(SystemExit) as info:
        main([*args, "--overwrite", "--rows", "peri-ln"])
    err = capsys.readouterr().err
    assert info.value.code == 143 and f"after the new validation was written to {out}" in err
    after = tree(out)
    # the rows it ran are replaced; a row it did not run keeps its card (issue 36: --rows X --overwrite dropped them)
    assert after["pre-ln/report.json"] == before["pre-ln/report.json"] and "peri-ln/report.json" in after
    assert json.loads(after["summary.json"])["rows"].keys() == {"peri-ln"} and not list(out.glob(".incoming*"))


def test_a_check_in_this_process_gives_its_signal_handlers_back(tmp_path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    check(tmp_path / "card", *SHAPE, "--lrs", "1e-2", "--no-reference", *TINY)
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.system
def test_a_signal_while_the_card_is_written_leaves_no_card_beside_its_no_verdict(tmp_path, capsys,
                                                                                monkeypatch) -> None:
    """SIGTERM between report.md and report.json left a report.md with a verdict beside interrupted.txt saying
    'no verdict', and no report.json (so --compare refused the directory)."""
    from lnstab.check import report

    real = report.write_json

    def json_under_sigterm(path, data):
        os.kill(os.getpid(), signal.SIGTERM)  # report.md is written by now
        real(path, data)

    monkeypatch.setattr(report, "write_json", json_under_sigterm)
    out = tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", *SHAPE, "--lrs", "1e-2", "--no-reference", *TINY, "--out", str(out)])
    assert info.value.code == 143 and "no verdict" in capsys.readouterr().err
    assert not any((out / name).exists() for name in ("report.md", "report.json", "thresholds.yaml"))
    assert "the card not yet written; no verdict" in (out / "interrupted.txt").read_text()


@pytest.mark.parametrize("where", ["import", "print"])
def test_a_ctrl_c_outside_the_checks_handler_is_one_line_too(capsys, monkeypatch, tmp_path, where) -> None:
    """A Ctrl-C in the first second or two, while lnstab check imported torch (before its handler was installed),
    printed a 40-line KeyboardInterrupt traceback, exit 130; so did one while the card was printed."""
    import importlib

    import lnstab.check.cli as check_cli
    import lnstab.cli as cli

    if where == "import":
        real = importlib.import_module

        def importing(name: str, *args, **kwargs):
            if name == "lnstab.check.cli":
                raise KeyboardInterrupt
            return real(name, *args, **kwargs)

        monkeypatch.setattr(cli.importlib, "import_module", importing)
    else:
        monkeypatch.setattr(check_cli, "terminal", lambda card: (_ for _ in ()).throw(KeyboardInterrupt()))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["check", "--model.preset", "tiny", "--model.vocab_size", "128", "--model.block_size", "32", *TINY,
              "--lrs", "1e-2", "--no-reference", "--out", str(tmp_path / "card")])
    assert info.value.code == 130 and capsys.readouterr().err.strip() == "lnstab: lnstab check stopped by SIGINT"
