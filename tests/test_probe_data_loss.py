"""Data that must not be lost (issue 36): the run lock never writes through a link, a number too long to read is a
damaged file rather than a traceback, a full disk outside checkpoint writes is one line, and a file where a sweep's
directory goes is refused before anything is written.

The full disk is real: a 64 KB tmpfs filled to the brim (``mount`` needs root; the tests say so and skip where it is
refused). ``lnstab check --validate --overwrite`` is in ``test_check_validate``, ``--compare``'s malformed cards in
``test_check_compare``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.probes import small_tmpfs
from support.runs import tiny_config

from lnstab import runlock
from lnstab.cli import main
from lnstab.errors import ConfigError, MachineError
from lnstab.rundir import read_summary, write_json
from lnstab.safeload import MAX_NUMBER_CHARS, DataFileError, load_json, load_json_text, load_yaml, load_yaml_text

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")
HUGE = "1" + "0" * 5000  # past Python's 4,300-digit limit of int(): a ValueError traceback before
ENOSPC = "cannot be written: No space left on device (errno 28 ENOSPC)"


def files_of(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 64 KB tmpfs, every byte taken by a file (directories and empty files can still be made in it)."""
    with small_tmpfs(tmp_path / "disk", "64k") as mounted:
        if not mounted:
            pytest.skip("mount -t tmpfs is refused here (it needs root): no real full disk to test against")
        fd = os.open(tmp_path / "disk" / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield tmp_path / "disk"


# ---------------------------------------------------------------------------------------------------- the run lock


@pytest.mark.parametrize("kind", ["link to a file", "dangling link", "hard link"])
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(kind, tmp_path) -> None:
    run, target = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    if kind != "dangling link":
        target.write_text("a file of the user's\n")
    if kind == "hard link":
        os.link(target, run / runlock.LOCK_FILE)
    else:
        (run / runlock.LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError) as info:
        runlock.hold(run)
    message = str(info.value)
    assert "\n" not in message and f"its lock file {run / runlock.LOCK_FILE} is " in message, message
    assert ("a file with 2 hard links" if kind == "hard link" else "a symbolic link") in message
    if kind == "dangling link":
        assert not target.exists()  # before: O_CREAT made it, wherever the link pointed
    else:
        assert target.read_text() == "a file of the user's\n"  # before: the holder's record written over it
    assert not runlock.holds(run)


def test_lnstab_fit_refuses_a_linked_lock_file_in_one_line(tmp_path, capsys) -> None:
    run, target = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    target.write_text("a file of the user's\n")
    (run / runlock.LOCK_FILE).symlink_to(target)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(tiny_config(tmp_path)), "--run_dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("lnstab: error: --run_dir ") and "symbolic link" in err[-1]
    assert target.read_text() == "a file of the user's\n"
    assert sorted(p.name for p in run.iterdir()) == [runlock.LOCK_FILE]  # nothing written beside it


@pytest.mark.system
def test_a_full_disk_under_the_lock_is_one_line(full_disk) -> None:
    run = full_disk / "run"
    with pytest.raises(MachineError) as info:
        runlock.hold(run)
    assert str(info.value) == f"{run / runlock.LOCK_FILE} {ENOSPC}"
    assert not runlock.holds(run)


# ------------------------------------------------------------------------------------------- numbers too long


def test_the_bounded_reader_refuses_a_number_too_long_in_one_line(tmp_path) -> None:
    path = tmp_path / "summary.json"
    path.write_text(f'{{"final_step": {HUGE}}}')
    with pytest.raises(DataFileError) as info:
        load_json(path)
    assert str(info.value) == (f"{path} holds a number of 5001 characters (100000000000…); lnstab reads numbers of "
                               f"at most {MAX_NUMBER_CHARS}")
    for text in (f"[{'9' * (MAX_NUMBER_CHARS + 1)}]", f"[0.{'5' * (MAX_NUMBER_CHARS - 1)}]"):  # ints and floats alike
        with pytest.raises(DataFileError, match="holds a number of 301 characters"):
            load_json_text(text, "x.json")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  n_layer: {HUGE}\n")
    with pytest.raises(DataFileError, match=f"{config} holds a number of 5001 characters at line 2"):
        load_yaml(config)
    honest = [2**63, -0.5, 1e-300, 1.7976931348623157e308, int("9" * MAX_NUMBER_CHARS)]
    assert load_json_text(json.dumps(honest), "x.json") == honest
    assert load_yaml_text(f"a: {'7' * MAX_NUMBER_CHARS}\nb: '{HUGE}'\nc: 0x1f", "x.yaml") == {
        "a": int("7" * MAX_NUMBER_CHARS), "b": HUGE, "c": 31}  # a quoted one is a string


def test_lnstab_report_counts_a_run_with_a_number_too_long_as_damaged(grid, tmp_path, capsys) -> None:
    summary = grid / "pre_s0" / "summary.json"
    summary.write_text(summary.read_text().replace('"final_step": 100', f'"final_step": {HUGE}'))
    events = grid / "peri_s1" / "divergence_events.jsonl"
    events.write_text(f'{{"step": {HUGE}, "kind": "loss_spike"}}\n')
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])  # before: ValueError, no report
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert any(f"{summary} is damaged: holds a number of 5001 characters" in line and "pre_s0 is counted as a "
               "damaged run" in line for line in lines), lines
    assert any(f"{events} is damaged: line 1 holds a number of 5001 characters" in line for line in lines), lines
    assert "8 runs in 3 configuration(s): 3 completed, 2 damaged, 1 diverged," in (out / "report.md").read_text()


def test_sweep_status_shows_a_run_with_a_number_too_long_as_damaged(tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0, 1]}}))
    runs = tmp_path / "runs" / "g"
    write_json(runs / "s0" / "summary.json", {"status": "completed", "final_step": 9})
    (runs / "s1").mkdir()
    (runs / "s1" / "summary.json").write_text(f'{{"status": "completed", "final_step": {HUGE}}}')
    main(["sweep", str(grid_file), "--status", "--root", str(tmp_path / "runs")])  # before: ValueError
    out = capsys.readouterr().out
    assert "2 runs: 1 completed, 1 damaged" in out
    assert f"damaged: s1: {runs / 's1' / 'summary.json'} is damaged: holds a number of 5001 characters" in out


@pytest.mark.system
def test_a_resume_past_a_summary_with_a_number_too_long_keeps_it_and_trains_on(tmp_path) -> None:
    """``--ckpt_path last`` with such a summary: a damaged summary, which the resume sets aside byte for byte and
    repairs (as it does a truncated one), instead of a ValueError after a new event file was written."""
    cfg, run = tiny_config(tmp_path), tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    fit = [sys.executable, "-m", "lnstab.cli", "fit", "--config", str(cfg), "--run_dir", str(run)]
    done = subprocess.run([*fit, "--trainer.max_steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = run / "summary.json"
    damaged = summary.read_text().replace('"final_step": 2', f'"final_step": {HUGE}')
    summary.write_text(damaged)
    done = subprocess.run([*fit, "--ckpt_path", "last"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (run / "summary.damaged-1.json").read_text() == damaged  # nothing lost
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 4


# ------------------------------------------------------------------------------------ a full disk: one line


@pytest.mark.system
def test_lnstab_report_on_a_full_disk_is_one_line_and_exit_1(grid, full_disk, capsys) -> None:
    out = full_disk / "report"
    with pytest.raises(SystemExit) as info:
        main(["report", str(grid), "--out", str(out)])  # before: an OSError traceback
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1 and "\n" not in err, err
    assert err.startswith(f"lnstab: error: {out}/") and err.endswith(ENOSPC), err
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())  # no partial file left


@pytest.mark.system
def test_lnstab_sweep_on_a_full_disk_is_one_line_and_exit_1(full_disk, tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    (full_disk / "runs" / "g" / "s0").mkdir(parents=True)  # made before the disk filled: nothing to train
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(grid_file), "--no-validate", "--root", str(full_disk / "runs")])
    err = capsys.readouterr().err.strip()
    manifest = full_disk / "runs" / "g" / ".sweep" / "manifest.json"
    assert info.value.code == 1 and err == f"lnstab: error: {manifest} {ENOSPC}", err


@pytest.mark.system
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the event writer's thread too
def test_lnstab_check_on_a_full_disk_ends_in_one_line_naming_the_file_and_exit_3(full_disk, capsys) -> None:
    """A check is a gate: a full disk is a failure with no verdict (3), never "a criterion fails" (1)."""
    from support.check import GPT, TINY

    out = full_disk / "check"
    with pytest.raises(SystemExit) as info:
        main(["check", *GPT, *TINY, "--lrs", "1e-2", "--out", str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert info.value.code == 3 and last.startswith("lnstab: error: lnstab check: ") and ENOSPC in last, last
    assert "Traceback" not in err and "Exception in thread" not in err, err  # nor the event writer's thread
    assert f"{out}/" in last, last  # a file of the check's directory is named


# ------------------------------------------------------------------------- a file where the sweep's directory goes


@pytest.mark.parametrize(("where", "mode"), [(".sweep", []), (".sweep", ["--prepare", "s0"]),
                                             (".sweep", ["--slurm", "--gpus-per-node", "0"]),
                                             (".sweep/locks", []), (".sweep/logs", [])])
def test_a_file_where_the_sweeps_directory_goes_is_one_line_and_exit_2(where, mode, tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    path = tmp_path / "runs" / "g" / where
    path.parent.mkdir(parents=True)
    path.write_text("a file of the user's\n")
    before = files_of(tmp_path / "runs")
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(grid_file), "--no-validate", "--root", str(tmp_path / "runs"), *mode])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err  # before: a FileExistsError or NotADirectoryError traceback
    assert err.startswith(f"lnstab: error: {path} is a file, not a directory; lnstab sweep keeps its "), err
    assert files_of(tmp_path / "runs") == before  # nothing written
