"""Damaged run files (issue 16): a truncated summary, evaluation or hidden-state series, a half-written event line,
a config that is not YAML, a corrupt sweep manifest. Each is one damaged run (or manifest), named in one line and
counted in the tables' n, and the healthy runs are reported as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.runs import tiny_config

from lnstab import rundir
from lnstab.cli import main
from lnstab.report import collect
from lnstab.report.tables import divergence_table, performance_table, runs_table
from lnstab.rundir import read_events, read_hidden_series, read_summary, write_json
from lnstab.sweep.state import plan

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {  # run -> (file, how, what the line says)
    "pre_s0": ("summary.json", "truncate", "summary.json is damaged: not valid JSON at line"),
    "pre_s1": ("eval.json", "truncate", "eval.json is damaged: not valid JSON"),
    "peri_s0": ("hidden_stats.json", "truncate", "hidden_stats.json is damaged: not valid JSON"),
    "peri_s1": ("divergence_events.jsonl", "half-line", "divergence_events.jsonl is damaged: line 2 is not valid JSON"),
    "none_s1": ("config.yaml", "not-yaml", "config.yaml is damaged: not valid YAML at line 2"),
}


def damage(run: Path, name: str, how: str) -> None:
    path = run / name
    if how == "truncate":
        truncate(path)
    elif how == "half-line":
        path.write_text('{"step": 3, "kind": "loss_spike", "value": 9.5}\n{"step": 4, "kind": "nonfin')
    else:
        path.write_text("model: [unclosed\n")


def test_damaged_run_files_are_named_counted_and_the_rest_reported(grid, tmp_path, capsys) -> None:
    for run, (name, how, _) in DAMAGE.items():
        damage(grid / run, name, how)
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == len(DAMAGE), captured.err
    for run, (_, _, said) in DAMAGE.items():
        assert any(said in line and f"{run} is counted as a damaged run" in line for line in lines), (run, lines)
    report = (out / "report.md").read_text()
    assert "8 runs in 3 configuration(s): 5 damaged, 1 diverged, 1 interrupted, 1 missing." in report
    assert all(f"- `{run}`: " in report for run in DAMAGE)
    records = collect([grid], warn=lambda line: None)
    assert {r.name for r in records if r.status == "damaged"} == set(DAMAGE)
    divergence = {row["norm_placement"]: row for row in divergence_table(records).rows}
    assert divergence["none"]["runs"] == 2 and divergence["none"]["diverged"] == 1  # none_s1 counted in its config
    assert divergence["pre"]["unfinished"] == "2 damaged, 1 interrupted"
    performance = {row["norm_placement"]: row for row in performance_table(records).rows}
    assert performance["pre"]["n"] == 0 and performance["pre"]["runs"] == 3  # no data used, still counted
    assert {row["run"]: row["status"] for row in runs_table(records).rows}["peri_s1"] == "damaged"


def test_a_corrupt_manifest_is_one_line_and_the_runs_are_still_reported(grid, tmp_path, capsys) -> None:
    manifest = grid / ".sweep" / "manifest.json"
    truncate(manifest)
    main(["report", str(grid), "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{manifest} is damaged: not valid JSON" in err and "left out" in err
    assert "7 runs in 3 configuration(s)" in (tmp_path / "report" / "report.md").read_text()  # no missing run now


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


def test_a_fresh_fit_into_a_run_dir_with_a_corrupt_summary_is_the_usual_refusal(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"status": "comp')
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(tiny_config(tmp_path)), "--run_dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err
    assert f"--run_dir {run} already holds a run (status unknown: summary.json is damaged: not valid JSON" in err
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


def test_readers_raise_run_file_error_for_wrong_shapes(tmp_path) -> None:
    for name, text, said, read in (
        ("summary.json", "[1, 2]", "it holds a JSON list, not a run summary", read_summary),
        ("summary.json", '{"val": "low"}', "'val' holds a JSON str, not an object", read_summary),
        ("hidden_stats.json", '{"tags": [0], "steps": []}', "'tags' must be a list of strings", read_hidden_series),
        ("divergence_events.jsonl", '{"step": 1}\n[2]\n', "line 2 holds a JSON list", read_events),
        ("summary.json", b'{"status": "\xff"}', "not UTF-8 text (byte 0xff at offset 12)", read_summary),
    ):
        run = tmp_path / name.replace(".", "_") / str(len(text))
        run.mkdir(parents=True)
        (run / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(rundir.RunFileError) as info:  # the class other code catches
            read(run)
        assert str(info.value) == f"{run / name} is damaged: {said}" or said in str(info.value), str(info.value)
        assert info.value.path == run / name and said in info.value.problem
