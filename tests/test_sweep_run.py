"""A real sweep, end to end: the smoke grid's three tiny runs as ``lnstab fit`` children; one diverges and the sweep
goes on; the sweep is stopped during the last run and the same command, rerun, skips the finished runs and resumes
the interrupted one from its ``last.ckpt``; ``lnstab report`` then reads the grid back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from paced_runs import PACE_CALLBACK, pace_env, set_pace

from lnstab.cli import main
from lnstab.rundir import read_summary

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "experiments" / "grids" / "mini-smoke.yaml"
pytestmark = [pytest.mark.slow, pytest.mark.system]


def paced_grid(tmp: Path) -> Path:
    """mini-smoke.yaml as it is, plus the Pace callback (tests/paced_runs.py) in every run, so the test can stop the
    sweep while its third run trains, on a machine of any speed."""
    grid = yaml.safe_load(GRID.read_text())
    grid["base"] = str((GRID.parent / grid["base"]).resolve())
    grid["name"] = "mini-smoke"
    grid["overrides"]["trainer.callbacks"] = [PACE_CALLBACK]
    path = tmp / "mini-smoke.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def lnstab_sweep(grid: Path, root: Path) -> list[str]:
    # --no-validate: test_sweep.py checks the grid against lnstab fit's parser; here the children do
    return [str(Path(sys.executable).with_name("lnstab")), "sweep", str(grid), "--root", str(root), "--no-validate"]


def wait_for(what: str, check, proc: subprocess.Popen | None = None, log: Path | None = None,
             timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None:
            assert proc.poll() is None, log.read_text()[-3000:] if log else "the sweep ended"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stopped_then_rerun(tmp_path_factory) -> dict:
    """Run the grid, SIGTERM the sweep once the third run has a checkpoint, then rerun the same command."""
    tmp = tmp_path_factory.mktemp("sweep")
    root = tmp / "runs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **pace_env(tmp, 0)}
    grid = paced_grid(tmp)
    runs = root / "mini-smoke"
    log = tmp / "first.out"
    with open(log, "w") as out:
        sweep = subprocess.Popen(lnstab_sweep(grid, root), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for("the third run to start", lambda: (runs / "peri").exists(), sweep, log)
        set_pace(tmp, 0.5)  # the third run now takes a step every half second
        wait_for("the third run's checkpoint", lambda: list((runs / "peri" / "checkpoints").glob("*.ckpt")),
                 sweep, log)
        before_stop = {name: read_summary(runs / name).get("status") for name in ("none_lr10", "pre")}
        sweep.send_signal(signal.SIGTERM)
        first_code = sweep.wait(timeout=600)
    set_pace(tmp, 0)
    stopped = {name: read_summary(runs / name) for name in ("none_lr10", "pre", "peri")}
    rerun = subprocess.run(lnstab_sweep(grid, root), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    journal = [json.loads(x) for x in (runs / ".sweep" / "journal.jsonl").read_text().splitlines()]
    return {"root": root, "runs": runs, "first_out": log.read_text(), "first_code": first_code,
            "before_stop": before_stop, "stopped": stopped, "rerun": rerun, "journal": journal, "grid": grid}


def test_a_diverged_run_is_recorded_and_the_sweep_goes_on(stopped_then_rerun) -> None:
    s = stopped_then_rerun
    assert s["before_stop"] == {"none_lr10": "diverged", "pre": "completed"}, s["first_out"][-3000:]
    diverged = s["stopped"]["none_lr10"]
    assert diverged["diverged_step"] is not None and diverged["final_step"] < 16
    assert "[1/3] none_lr10: diverged at step" in s["first_out"] and "[2/3] pre: start" in s["first_out"]
    assert s["stopped"]["pre"]["final_step"] == 16


def test_a_stopped_sweep_resumes_the_interrupted_run_and_skips_the_finished(stopped_then_rerun) -> None:
    s = stopped_then_rerun
    assert s["first_code"] == 128 + signal.SIGTERM, s["first_out"][-3000:]
    peri = s["stopped"]["peri"]
    assert peri["status"] == "interrupted" and 0 < peri["interrupted_step"] < 16
    rerun = s["rerun"]
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "none_lr10: diverged, skipped" in rerun.stdout and "pre: completed, skipped" in rerun.stdout
    assert "[3/3] peri: resume" in rerun.stdout
    final = read_summary(s["runs"] / "peri")
    assert final["status"] == "completed" and final["final_step"] == 16
    actions = [(e["run"], e["action"]) for e in s["journal"]]
    assert actions == [("none_lr10", "start"), ("pre", "start"), ("peri", "start"), ("none_lr10", "skip"),
                       ("pre", "skip"), ("peri", "resume")]
    log = (s["runs"] / ".sweep" / "logs" / "peri.log").read_text()
    assert f"Restored all states from the checkpoint at {s['runs'] / 'peri' / 'checkpoints' / 'last.ckpt'}" in log


def test_status_and_report_read_the_grid_back(stopped_then_rerun, tmp_path, capsys) -> None:
    s = stopped_then_rerun
    main(["sweep", str(s["grid"]), "--root", str(s["root"]), "--status"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "status", "step", "val_loss", "wall", "next"]
    assert lines[3].split()[:3] == ["peri", "completed", "16"] and lines[-1].startswith("3 runs: 2 completed, 1 div")
    main(["report", str(s["runs"]), "--out", str(tmp_path / "report")])
    divergence = (tmp_path / "report" / "divergence.csv").read_text().splitlines()
    step = s["stopped"]["none_lr10"]["diverged_step"]
    header = divergence[0].split(",")
    assert header[:7] == ["norm_placement", "learning_rate", "runs", "finished", "diverged", "divergence_steps",
                          "unfinished"]
    rows = [dict(zip(header, line.split(","), strict=True)) for line in divergence[1:]]
    assert [(r["norm_placement"], r["diverged"], r["divergence_steps"]) for r in rows] == [
        ("none", "1", str(step)), ("pre", "0", ""), ("peri", "0", "")]  # the grid's order
    for name in ("depth_profile.png", "last_layer_steps.png", "loss_curves.png", "theorem4_bound.png"):
        assert (tmp_path / "report" / name).stat().st_size > 10_000


def test_a_sweep_killed_outright_takes_its_run_with_it_and_a_rerun_resumes(tmp_path) -> None:
    """Before: the child trained on after ``kill -9`` of its sweep, holding the run's lock, and a rerun printed
    'running, skipped' and exited 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **pace_env(tmp_path, 0.5)}
    grid = paced_grid(tmp_path)
    root = tmp_path / "runs"
    first = root / "mini-smoke" / "none_lr10"  # the first run; paced, it takes a step every half second
    log = tmp_path / "first.out"
    with open(log, "w") as out:
        sweep = subprocess.Popen([*lnstab_sweep(grid, root), "--only", "pre"], cwd=ROOT, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
        run = root / "mini-smoke" / "pre"
        wait_for("a checkpoint", lambda: list((run / "checkpoints").glob("*.ckpt")), sweep, log)
        sweep.kill()
        sweep.wait()
    wait_for("the orphaned run to stop", lambda: read_summary(run).get("status") != "running", timeout=120)
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    assert not first.exists()
    set_pace(tmp_path, 0)
    rerun = subprocess.run([*lnstab_sweep(grid, root), "--only", "pre"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0 and "pre: resume" in rerun.stdout, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 16
