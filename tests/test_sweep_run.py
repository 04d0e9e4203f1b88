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

from lnstab.cli import main
from lnstab.rundir import read_summary

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "experiments" / "grids" / "mini-smoke.yaml"
pytestmark = pytest.mark.slow


def lnstab_sweep(root: Path) -> list[str]:
    # --no-validate: test_sweep.py checks the grid against lnstab fit's parser; here the children do
    return [str(Path(sys.executable).with_name("lnstab")), "sweep", str(GRID), "--root", str(root), "--no-validate"]


@pytest.fixture(scope="module")
def stopped_then_rerun(tmp_path_factory) -> dict:
    """Run the grid, SIGTERM the sweep once the third run has a checkpoint, then rerun the same command."""
    root = tmp_path_factory.mktemp("sweep") / "runs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    runs = root / "mini-smoke"
    log = root.parent / "first.out"
    with open(log, "w") as out:
        sweep = subprocess.Popen(lnstab_sweep(root), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not list((runs / "peri" / "checkpoints").glob("*.ckpt")):
            assert sweep.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the third run never wrote a checkpoint"
            time.sleep(0.2)
        before_stop = {name: read_summary(runs / name).get("status") for name in ("none_lr10", "pre")}
        sweep.send_signal(signal.SIGTERM)
        first_code = sweep.wait(timeout=600)
    stopped = {name: read_summary(runs / name) for name in ("none_lr10", "pre", "peri")}
    rerun = subprocess.run(lnstab_sweep(root), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    journal = [json.loads(x) for x in (runs / ".sweep" / "journal.jsonl").read_text().splitlines()]
    return {"root": root, "runs": runs, "first_out": log.read_text(), "first_code": first_code,
            "before_stop": before_stop, "stopped": stopped, "rerun": rerun, "journal": journal}


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
    main(["sweep", str(GRID), "--root", str(s["root"]), "--status"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "status", "step", "val_loss", "wall", "next"]
    assert lines[3].split()[:3] == ["peri", "completed", "16"] and lines[-1].startswith("3 runs: 2 completed, 1 div")
    main(["report", str(s["runs"]), "--out", str(tmp_path / "report")])
    divergence = (tmp_path / "report" / "divergence.csv").read_text().splitlines()
    step = s["stopped"]["none_lr10"]["diverged_step"]
    assert divergence[0] == "norm_placement,learning_rate,runs,finished,diverged,divergence_steps,unfinished"
    assert divergence[1] == f"none,10,1,1,1,{step},"
    assert divergence[2:] == ["pre,0.003,1,1,0,,", "peri,0.003,1,1,0,,"]  # the grid's order
    for name in ("depth_profile.png", "last_layer_steps.png", "loss_curves.png", "theorem4_bound.png"):
        assert (tmp_path / "report" / name).stat().st_size > 10_000
