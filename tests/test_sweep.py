"""``lnstab sweep``: grid expansion, bad grids as one-line errors, rerun decisions, SLURM and torchrun launch; a
damaged run file or manifest, a full disk and a file where the sweep's directory goes, each one line."""

from __future__ import annotations

import datetime as dt
import fcntl
import math
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from support.hostile import ENOSPC, HUGE, truncate
from support.runs import one_line_error

from lnstab.cli import main
from lnstab.errors import LNStabError
from lnstab.rundir import write_json
from lnstab.sweep.cli import prepare
from lnstab.sweep.grid import GridError, cli_value, load_grid
from lnstab.sweep.runner import fit_command
from lnstab.sweep.slurm import sbatch_script, slurm_settings, torchrun_commands
from lnstab.sweep.state import (
    is_locked,
    lock_path,
    move_aside,
    plan,
    read_manifest,
    record_manifest,
    run_directory,
    run_lock,
)

ROOT = Path(__file__).resolve().parents[1]
GRIDS = sorted((ROOT / "experiments" / "grids").glob("*.yaml"))
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def write_grid(tmp_path: Path, spec: dict, name: str = "g.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"base": QUICKSTART, **spec}, sort_keys=False))
    return path


def sweep(*args: str) -> None:
    main(["sweep", *args])


# ----------------------------------------------------------------------------------------------- grid expansion
def test_axes_expand_in_order_with_readable_names_and_overrides(tmp_path) -> None:
    grid = load_grid(write_grid(tmp_path, {
        "overrides": {"trainer.max_steps": 5},
        "axes": {"model.norm_placement": ["pre", "peri"], "model.residual_scale": [1.0, 0.1],
                 "model.weight_decay": [0.1, 0.0], "seed_everything": [0, 3]},
    }))
    names = [r.name for r in grid.runs]
    assert len(names) == 16 and names[:3] == ["pre_dt1_wd0.1_s0", "pre_dt1_wd0.1_s3", "pre_dt1_wd0_s0"]
    assert names[-1] == "peri_dt0.1_wd0_s3"
    run = grid.run("pre_dt0.1_wd0_s3")
    assert run.overrides == {"trainer.max_steps": 5, "model.norm_placement": "pre", "model.residual_scale": 0.1,
                             "model.weight_decay": 0.0, "seed_everything": 3}
    assert run.cli_args() == ["--trainer.max_steps", "5", "--model.norm_placement", "pre", "--model.residual_scale",
                              "0.1", "--model.weight_decay", "0.0", "--seed_everything", "3"]
    assert load_grid(grid.path).runs == grid.runs  # stable: the same file gives the same runs


def test_exclude_include_labels_and_compound_axes(tmp_path) -> None:
    grid = load_grid(write_grid(tmp_path, {
        "axes": {
            "model.norm_placement": ["pre", "none"],
            "seed_everything": {"label": "seed", "values": [0, 1]},
            "recipe": {"values": {"slow": {"model.learning_rate": 1e-3},
                                  "fast": {"model.learning_rate": 1e-2, "model.warmup_steps": 5}}},
        },
        "exclude": [{"model.norm_placement": "none", "recipe": "slow"}, {"seed_everything": 1, "recipe": "fast"}],
        "include": [{"model.norm_placement": "pre", "seed_everything": 0, "recipe": "fast",
                     "model.dropout": 0.1}],
    }))
    assert [r.name for r in grid.runs] == ["pre_seed0_slow", "pre_seed0_fast", "pre_seed1_slow", "none_seed0_fast",
                                           "pre_seed0_fast_dropout0.1"]
    assert grid.run("none_seed0_fast").overrides == {"model.norm_placement": "none", "seed_everything": 0,
                                                     "model.learning_rate": 1e-2, "model.warmup_steps": 5}
    assert grid.run("pre_seed0_fast_dropout0.1").overrides["model.dropout"] == 0.1


def test_cli_values_read_back_as_the_same_yaml() -> None:
    for value in (1e-5, 0.1, 3, True, None, "bf16-mixed", [0.9, 0.95], 6.0e-4):
        assert yaml.safe_load(cli_value(value)) == value


# ----------------------------------------------------------------------------------------------- bad grids
BAD = [
    ({"axes": {"model.colour": ["red"]}}, "run 'red': lnstab fit refuses it: unrecognized arguments: --model.colour"),
    # values lnstab fit refuses only after parsing: before, the grid validated and every run then failed at its start
    ({"axes": {"model.n_layer": [2, 0]}}, "run 'n_layer0': lnstab fit refuses it: model.n_layer=0 is not allowed"),
    ({"axes": {"trainer.accumulate_grad_batches": [0]}}, "run 'accumulate_grad_batches0': lnstab fit refuses it: "
                                                          "trainer.accumulate_grad_batches=0 is not allowed"),
    ({"axes": {"data.init_args.batch_size": [0]}}, "run 'batch_size0': lnstab fit refuses it: data.batch_size=0 is "
                                                    "not allowed"),
    # a combination no parsed run holds: 64 and 3 were each parsed in a valid run (64 x 4, 96 x 3)
    ({"axes": {"model.n_embd": [64, 96], "model.n_head": [4, 3]}}, "run 'n_embd64_n_head3': lnstab fit refuses "
                                                                    "it: model.n_embd=64 "),
    ({"axes": {"model.residual_scale": ["abc"]}}, "model.residual_scale='abc' is not allowed; it must be a number"),
    ({"axes": {"model.norm_placement": []}}, "axis 'model.norm_placement' values=[] is not allowed"),
    ({"axes": {}}, "axes={} is not allowed"),
    ({"axes": {"model.residual_scale": {"label": "x", "values": [0.1, 0.10]}}}, "two runs are named 'x0.1'"),
    ({"axes": {"model.norm_placement": ["pre"], "seed_everything": [1]}, "include": [{"model.norm_placement": "pre",
      "seed_everything": 1}]}, "two runs are named 'pre_s1'"),
    ({"axes": {"model.norm_placement": ["pre"]}, "exclude": [{"model.norm_placement": "peri"}]},
     "exclude[0] model.norm_placement='peri' is not allowed"),
    ({"axes": {"model.norm_placement": ["pre"], "seed_everything": [0]}, "include": [{"seed_everything": 0}]},
     "include[0] is not allowed without axis 'model.norm_placement'"),
    ({"axes": {"trainer.logger.init_args.save_dir": ["x"]}}, "the sweep sets where runs live"),
    ({"axes": {"model.norm_placement": ["pre"]}, "overrides": {"model.norm_placement": "peri"}},
     "key 'model.norm_placement' is set by both overrides and axis"),
    ({"axis": {"model.norm_placement": ["pre"]}}, "field 'axis' is not allowed"),
]


@pytest.mark.parametrize(("spec", "expected"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_grid_is_one_line_exit_2_and_writes_nothing(spec, expected, tmp_path, capsys) -> None:
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as info:
        sweep(str(write_grid(tmp_path, spec)), "--root", str(root))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lnstab: error: grid ") and expected in err and "\n" not in err, err
    assert not root.exists()


def test_missing_grid_file_and_bad_options_are_one_line(tmp_path, capsys) -> None:
    for args, expected in (([str(tmp_path / "nope.yaml")], "is not a file"),
                           ([QUICKSTART, "--parallel", "0"], "--parallel 0 is not allowed"),
                           ([str(GRIDS[0]), "--set", "nokey"], "--set 'nokey' is not allowed")):
        with pytest.raises(SystemExit) as info:
            sweep(*args)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, err


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.stem)
def test_every_shipped_grid_validates(path, tmp_path, capsys) -> None:
    args = [str(path), "--dry-run", "--root", str(tmp_path / "runs")]
    try:
        sweep(*args)
    except SystemExit as exc:  # a machine without ../shared (the OpenWebText sample): refused in one line, then given
        err = capsys.readouterr().err
        assert exc.code == 2 and "--data.path ../shared/data/openwebtext/owt-sample-900.jsonl.gz does not exist" in err
        text = tmp_path / "docs.jsonl"
        text.write_text('{"text": "a document of its own"}\n')
        sweep(*args, "--set", f"data.init_args.path={text}")
    out = capsys.readouterr().out
    grid = load_grid(path)
    assert f"{len(grid.runs)} run(s)" in out and not (tmp_path / "runs").exists()
    expected = {"gpt2_divergence": 30, "gpt2_perf": 12, "gpt2-large_perf": 4, "gpt2-xl_perf": 4, "mini": 26,
                "mini-smoke": 3, "mitigations": 64, "proxy-core": 48, "proxy-designs": 264,
                "proxy-drift": 6, "proxy-drift-4k": 12}
    assert len(grid.runs) == expected[path.stem]


def test_a_local_sweep_whose_data_is_not_here_is_refused_in_one_line_before_any_run(tmp_path, capsys) -> None:
    """From a clone without ../shared, the proxy grid's 48 runs each failed on the same missing --data.path after
    seconds of start-up (a helper probing as a user saw it); a local sweep and its --dry-run refuse it at once, naming
    the path and how many runs read it. --slurm does not: its runs read the path where they run."""
    grid = write_grid(tmp_path, {"axes": {"model.learning_rate": [1e-3, 3e-3, 1e-2]},
                                 "overrides": {"data.init_args.source": "files",
                                               "data.init_args.path": "nowhere/owt.jsonl.gz"}})
    for mode in ([], ["--dry-run"]):
        err = one_line_error(capsys, "sweep", str(grid), *mode, "--root", str(tmp_path / "runs"))
        assert "and 2 more: --data.path nowhere/owt.jsonl.gz does not exist" in err, err
    assert not (tmp_path / "runs").exists()


def test_paper_divergence_grid_names() -> None:
    grid = load_grid(ROOT / "experiments" / "grids" / "gpt2_divergence.yaml")
    names = {r.name for r in grid.runs}
    assert {f"{p}_wd{wd}_s{s}" for p in ("pre", "peri", "none") for wd in ("0.1", "0") for s in range(5)} == names


@pytest.mark.parametrize("value", ["..", ".", ".hidden"])
def test_a_run_name_that_would_leave_its_grid_directory_is_refused(value, tmp_path, capsys) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"data.init_args.path": [value, "ok"]}}))
    err = one_line_error(capsys, "sweep", str(grid), "--dry-run", "--root", str(tmp_path / "runs"))
    assert f"run name {value!r}" in err and "is not allowed" in err
    one_line_error(capsys, "sweep", str(grid), "--slurm", "--no-validate", "--root", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------- rerun decisions
def make_run(directory: Path, status: str | None, checkpoint: bool = False) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text("model: {}\n")
    if status:
        write_json(directory / "summary.json", {"status": status, "final_step": 7})
    if checkpoint:
        (directory / "checkpoints").mkdir()
        with zipfile.ZipFile(directory / "checkpoints" / "last.ckpt", "w") as z:
            z.writestr("archive/data.pkl", b"x")
    return directory


@pytest.mark.parametrize(("status", "checkpoint", "retry", "expected"), [
    ("completed", True, True, "skip"),
    ("diverged", False, True, "skip"),
    ("failed", True, False, "skip"),  # --skip-failed
    ("failed", True, True, "resume"),  # the default: only completed and diverged runs are results
    ("failed", False, True, "restart"),
    ("interrupted", True, True, "resume"),
    ("running", True, True, "resume"),  # a stale "running": nobody holds its lock
    ("running", False, True, "restart"),  # killed before its first checkpoint
    (None, False, True, "restart"),
])
def test_plan_for_each_state(status, checkpoint, retry, expected, tmp_path) -> None:
    directory = make_run(tmp_path / "r", status, checkpoint)
    assert plan(directory, retry_failed=retry).action == expected
    assert plan(tmp_path / "absent").action == "start"
    assert plan(tmp_path / "absent", locked=True).action == "skip"  # launched by another sweep, no directory yet
    assert plan(directory, locked=True).action == "skip"  # another sweep holds its lock: it is training


def test_a_run_killed_before_its_first_checkpoint_is_moved_aside_not_lost(tmp_path, capsys) -> None:
    grid = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0, 1]}}))
    root = tmp_path / "runs"
    run = grid.runs[0]
    old = make_run(root / grid.name / run.name, "running")
    (old / "events.out.tfevents.1").write_text("log")
    assert prepare(grid, run, str(root), retry_failed=False) == "start"
    assert not old.exists()
    kept = root / grid.name / ".sweep" / "attempts" / f"{run.name}.1"
    assert (kept / "events.out.tfevents.1").read_text() == "log" and (kept / "config.yaml").is_file()
    make_run(old, "running")
    assert move_aside(root, grid, run).name == f"{run.name}.2"  # a second attempt never replaces the first
    make_run(old, "interrupted", checkpoint=True)
    assert prepare(grid, run, str(root), retry_failed=False) == "resume" and old.is_dir()


def test_manifest_refuses_a_changed_run_under_the_same_name(tmp_path) -> None:
    root = tmp_path / "runs"
    grid = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0]}, "overrides": {"trainer.max_steps": 5}}))
    record_manifest(root, grid, grid.runs)
    record_manifest(root, grid, grid.runs)  # the same runs again: fine
    changed = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0]},
                                              "overrides": {"trainer.max_steps": 6}}))
    with pytest.raises(GridError, match="was launched with other overrides .differs in trainer.max_steps"):
        record_manifest(root, changed, changed.runs)


def test_status_dry_run_and_slurm_say_what_the_sweep_will_refuse(tmp_path, capsys) -> None:
    """A grid edited under the same run names: --status said 'next: skip' and --dry-run/--slurm printed the runs
    (a job whose every element is then refused as it starts) while the sweep itself refuses them."""
    root = tmp_path / "runs"
    spec = {"axes": {"seed_everything": [0]}, "overrides": {"trainer.max_steps": 5}}
    record_manifest(root, load_grid(write_grid(tmp_path, spec)), load_grid(write_grid(tmp_path, spec)).runs)
    edited = str(write_grid(tmp_path, {**spec, "overrides": {"trainer.max_steps": 6}}))
    sweep(edited, "--root", str(root), "--status")
    assert "refuse (launched with other trainer.max_steps)" in capsys.readouterr().out
    for mode in ("--dry-run", "--slurm"):
        with pytest.raises(SystemExit) as info:
            sweep(edited, "--root", str(root), mode, "--no-validate")
        err = capsys.readouterr().err
        assert info.value.code == 2 and "was launched with other overrides (differs in trainer.max_steps)" in err, err
    sweep(str(write_grid(tmp_path, spec)), "--root", str(root), "--dry-run", "--no-validate")  # unchanged: fine


def test_a_grid_of_the_strings_inf_and_nan_reruns_and_reports(tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"  # two runs named inf and nan, and a float NaN in every run
    grid_file.write_text(f"base: {QUICKSTART}\naxes:\n  data.init_args.path: ['inf', 'nan']\n"
                         f"overrides:\n  model.dropout: .nan\n")
    grid = load_grid(grid_file)
    assert [r.name for r in grid.runs] == ["inf", "nan"]
    root = tmp_path / "runs"
    for _ in range(3):  # the unchanged grid, rerun: no "launched with other overrides", no runs added
        record_manifest(root, grid, grid.runs)
    manifest = read_manifest(root / grid.name)
    assert [e["name"] for e in manifest["runs"]] == ["inf", "nan"]
    assert manifest["runs"][1]["overrides"]["data.init_args.path"] == "nan"
    assert math.isnan(manifest["runs"][1]["overrides"]["model.dropout"])
    run = root / grid.name / "nan"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": {"path": "nan"}}}))
    write_json(run / "summary.json", {"status": "completed", "final_step": 5, "val": {"loss": 2.5}})
    main(["report", str(root / grid.name), "--out", str(tmp_path / "report")])
    assert "2 runs in 2 configuration(s): 1 completed, 1 missing." in (tmp_path / "report" / "report.md").read_text()
    rows = (tmp_path / "report" / "runs.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["inf", "nan"]


def test_a_held_lock_means_running(tmp_path) -> None:
    grid = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0]}}))
    run = grid.runs[0]
    with run_lock(tmp_path, grid, run) as fd:
        assert fd is not None and is_locked(tmp_path, grid, run)
    assert not is_locked(tmp_path, grid, run)


@pytest.mark.parametrize("status", ["interrupted", "running"])
def test_the_lock_of_a_run_that_recorded_its_end_is_waited_for(tmp_path, status) -> None:
    """A process that wrote its final status still holds the lock while it exits; a sweep rerun at once takes the
    lock when it is let go (an ``interrupted`` run resumes) instead of skipping the run as running. A run that says
    it is running is skipped at once, and ``--status`` (``is_locked``) never waits."""
    grid = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0]}}))
    run = grid.runs[0]
    directory = run_directory(tmp_path, grid, run)
    directory.mkdir(parents=True)
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_json(directory / "summary.json", {"status": status, "ended_at": None if status == "running" else now})
    lock_path(tmp_path, grid, run).parent.mkdir(parents=True)
    holder = os.open(lock_path(tmp_path, grid, run), os.O_RDWR | os.O_CREAT)  # another open file: flock excludes it
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.5, os.close, (holder,)).start()  # the exiting process lets go in half a second
    assert is_locked(tmp_path, grid, run)  # at once, however the run ended
    with run_lock(tmp_path, grid, run) as fd:
        assert (fd is not None) is (status == "interrupted")
    time.sleep(0.6)


# ----------------------------------------------------------------------------------------------- cluster launch
def test_slurm_array_script_runs_one_lnstab_fit_per_element(tmp_path) -> None:
    path = ROOT / "experiments" / "grids" / "gpt2_divergence.yaml"
    grid = load_grid(path)
    script = sbatch_script(grid, grid.runs, "runs", slurm_settings(grid), grid_file=str(path))
    assert "#SBATCH --array=0-29\n" in script and "#SBATCH --nodes=1\n" in script
    assert "#SBATCH --ntasks-per-node=8\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert script.count("FIT=(lnstab fit ") == 30
    for i, run in enumerate(grid.runs):
        fit = fit_command(grid, run, "runs", extra={"trainer.accelerator": "gpu", "trainer.num_nodes": 1,
                                                    "trainer.devices": 8})
        assert f"  {i}) RUN={run.name}\n     FIT=({' '.join(fit)}) ;;" in script
    # Running it: tests/test_slurm.py submits CPU scripts to a real SLURM; a GPU script like this one is checked
    # as text only (this machine has no GPU node).


def test_slurm_and_torchrun_follow_nodes_and_gpus(tmp_path, capsys) -> None:
    path = ROOT / "experiments" / "grids" / "gpt2-xl_perf.yaml"
    grid = load_grid(path)
    settings = slurm_settings(grid, nodes=2, gpus_per_node=4)
    script = sbatch_script(grid, grid.runs, "runs", settings)
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    assert "--trainer.num_nodes 2 --trainer.devices 4" in script and "#SBATCH --time=48:00:00" in script
    commands = torchrun_commands(grid, grid.runs, "runs", settings)
    lines = [x for x in commands.splitlines() if x.startswith("torchrun")]
    assert len(lines) == 4 and all("--nnodes=2 --nproc-per-node=4 --node-rank=$NODE_RANK" in x for x in lines)
    assert "--no-python lnstab fit --config experiments/gpt2-xl_pre_dt1.yaml --run_dir runs/gpt2-xl_perf/" in lines[0]
    sweep(str(path), "--slurm", "--root", str(tmp_path / "runs"), "--no-validate", "--nodes", "2",
          "--set", "trainer.accumulate_grad_batches=2")
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n") and script.count("--trainer.accumulate_grad_batches 2") == 4
    # the decision step repeats --set, so it finds the runs as they were launched
    assert "--set=trainer.accumulate_grad_batches=2 --prepare \"$RUN\")" in script
    assert (tmp_path / "runs" / "gpt2-xl_perf" / ".sweep" / "slurm").is_dir()  # sbatch's --output directory
    with pytest.raises(LNStabError, match="slurm nodes=0 is not allowed"):
        slurm_settings(grid, nodes=0)


# ----------------------------------------------------------------------------------------------- local execution
FAKE_FIT = '''
import json, os, sys, time
args = sys.argv[2:]
run_dir = args[args.index("--run_dir") + 1]
seed = int(args[args.index("--seed_everything") + 1])
os.makedirs(run_dir)
open(os.path.join(run_dir, "config.yaml"), "w").write("seed_everything: %d\\n" % seed)
open(os.path.join(run_dir, "span"), "w").write("%f " % time.time())
time.sleep(1.0)
status = ["completed", "failed", "diverged"][seed]
json.dump({"status": status, "final_step": 5, "diverged_step": 3 if status == "diverged" else None},
          open(os.path.join(run_dir, "summary.json"), "w"))
open(os.path.join(run_dir, "span"), "a").write("%f" % time.time())
sys.exit(1 if status == "failed" else 0)
'''


def test_parallel_children_record_failures_and_the_sweep_goes_on(tmp_path, monkeypatch) -> None:
    from lnstab.sweep import runner

    fake = tmp_path / "fake_fit.py"
    fake.write_text(FAKE_FIT)
    monkeypatch.setattr(runner, "lnstab_program", lambda: (sys.executable, str(fake)))
    grid = load_grid(write_grid(tmp_path, {"axes": {"seed_everything": [0, 1, 2]}}))
    root = tmp_path / "runs"
    lines: list[str] = []
    code = runner.LocalSweep(grid, grid.runs, root, parallel=3, echo=lines.append).run()
    assert code == 1  # one run failed; the others still ran
    statuses = {r.name: r for r in grid.runs}
    spans = [tuple(map(float, (root / grid.name / n / "span").read_text().split())) for n in statuses]
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # all three ran at once
    assert any(line.startswith("[2/3] s1: failed (exit 1)") for line in lines), lines
    assert any(line.startswith("[3/3] s2: diverged at step 3") for line in lines), lines
    lines.clear()
    skipping = runner.LocalSweep(grid, grid.runs, root, retry_failed=False, echo=lines.append)
    assert skipping.run() == 0  # --skip-failed: all settled, nothing to do
    assert [line.split(": ", 1)[1] for line in lines] == ["completed, skipped (a result)",
                                                          "failed, skipped (failed (--skip-failed))",
                                                          "diverged, skipped (a result)"]


def test_a_cpu_job_requests_no_gpu_and_one_task_per_node(tmp_path) -> None:
    grid = load_grid(ROOT / "experiments" / "grids" / "mini-smoke.yaml")
    settings = slurm_settings(grid, gpus_per_node=0, cpus_per_task=2, nodes=2)
    script = sbatch_script(grid, grid.runs, "runs", settings)
    assert "#SBATCH --ntasks-per-node=1\n" in script and "--gpus-per-node" not in script
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --cpus-per-task=2\n" in script
    assert script.count("--trainer.accelerator cpu --trainer.num_nodes 2 --trainer.devices 1") == 3
    assert "trap '" in script and "' USR1\n" in script  # the batch shell survives a SIGUSR1 to the whole job
    commands = torchrun_commands(grid, grid.runs, "runs", settings)
    assert all("--nproc-per-node=1 " in x for x in commands.splitlines() if x.startswith("torchrun"))
    with pytest.raises(LNStabError, match=r"slurm gpus_per_node=-1 is not allowed; it must be an integer >= 0"):
        slurm_settings(grid, gpus_per_node=-1)


# ----------------------------------------------------------------- damaged files, a full disk, a file in the way
def test_a_corrupt_manifest_stops_a_sweep_in_one_line(tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    write_json(tmp_path / "runs" / "g" / "s0" / "summary.json", {"status": "completed"})  # nothing to train
    manifest = tmp_path / "runs" / "g" / ".sweep" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text('{"grid": "g.yaml", "runs": [{"name": "s0", "overr')
    before = manifest.read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(grid_file), "--no-validate", "--root", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err and f"{manifest} is damaged: not valid JSON" in err
    assert manifest.read_bytes() == before  # not overwritten


def test_a_manifest_naming_a_run_outside_the_grid_is_damaged(tmp_path, capsys) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    write_json(tmp_path / "runs" / "g" / "s0" / "summary.json", {"status": "completed"})  # nothing to train
    manifest = tmp_path / "runs" / "g" / ".sweep" / "manifest.json"
    write_json(manifest, {"grid": str(grid), "base": QUICKSTART, "runs": [{"name": "..", "overrides": {}}]})
    err = one_line_error(capsys, "sweep", str(grid), "--no-validate", "--root", str(tmp_path / "runs"))
    assert f"{manifest} is damaged: runs[0] has the name '..'" in err


def test_sweep_status_shows_a_damaged_run_and_the_others(tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0, 1, 2]}}))
    runs = tmp_path / "runs" / "g"
    write_json(runs / "s0" / "summary.json", {"status": "completed", "final_step": 9, "val": {"loss": 1.25},
                                              "wall_s": 30})
    write_json(runs / "s1" / "summary.json", {"status": "completed"})
    truncate(runs / "s1" / "summary.json")
    main(["sweep", str(grid_file), "--status", "--root", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in out.splitlines()[1:4]}
    assert table["s0"][1:4] == ["completed", "9", "1.2500"] and table["s1"][1] == "damaged"
    assert table["s2"][1] == "pending"
    assert "3 runs: 1 completed, 1 damaged, 1 pending" in out
    assert f"damaged: s1: {runs / 's1' / 'summary.json'} is damaged: not valid JSON" in out
    assert plan(runs / "s1").action == "skip"  # a rerun leaves it alone: its state is unknown


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
def test_lnstab_sweep_on_a_full_disk_is_one_line_and_exit_1(full_disk, tmp_path, capsys) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    (full_disk / "runs" / "g" / "s0").mkdir(parents=True)  # made before the disk filled: nothing to train
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(grid_file), "--no-validate", "--root", str(full_disk / "runs")])
    err = capsys.readouterr().err.strip()
    manifest = full_disk / "runs" / "g" / ".sweep" / "manifest.json"
    assert info.value.code == 1 and err == f"lnstab: error: {manifest} {ENOSPC}", err


def files_of(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


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


def test_a_child_the_sweeps_own_signal_ends_in_its_first_seconds_is_not_a_failed_run(tmp_path, monkeypatch) -> None:
    """A sweep stopped just after it launched a run: the child, still importing (before lnstab fit takes SIGTERM
    over), died of the sweep's SIGTERM and was reported 'failed (exit -15)', quoting its own log header, while
    --status said pending. The child here is a process that never takes the signal over, as such a child."""
    import signal
    import threading
    import time

    from lnstab.sweep import runner
    from lnstab.sweep.grid import load_grid

    grid = load_grid(ROOT / "experiments" / "grids" / "mini-smoke.yaml")
    monkeypatch.setattr(runner, "lnstab_program", lambda: (sys.executable, "-c", "import time; time.sleep(120)"))
    lines: list[str] = []
    sweep = runner.LocalSweep(grid, grid.runs[:1], tmp_path / "runs", echo=lines.append)
    monkeypatch.setattr(signal, "signal", lambda *args: signal.SIG_DFL)  # not the test process's own handlers
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(sweep.run()))
    worker.start()
    deadline = time.monotonic() + 60
    while not sweep.children and time.monotonic() < deadline:  # the child is running: stop the sweep now
        time.sleep(0.05)
    sweep._on_signal(signal.SIGINT, None)
    worker.join(timeout=60)
    name = grid.runs[0].name
    assert sweep.results[name]["status"] == "not started" and done == [128 + signal.SIGINT], (sweep.results, lines)
    assert "stopped by the sweep's signal before it began (exit -15)" in lines[-1], lines
