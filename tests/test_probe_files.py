"""A hostile new user's files (issue 16): YAML bombs, deep or non-UTF-8 files, non-finite numbers and the strings
"nan"/"inf", run names that would leave their grid directory, run directories behind broken symbolic links.

Each is one line on stderr and exit status 2 with nothing written, or, for the numbers, a round trip that keeps
every string a string.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from support.probes import inline_laughs
from support.runs import tiny_config

from lnstab.cli import main
from lnstab.rundir import read_json, read_summary, write_json
from lnstab.safeload import MAX_NODES, DataFileError, load_json, load_yaml
from lnstab.sweep.grid import load_grid
from lnstab.sweep.state import read_manifest, record_manifest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def laughs(levels: int = 9, width: int = 10, indent: str = "") -> str:
    """A "billion laughs": ``levels`` anchors, each a list of ``width`` aliases of the one before (10⁹ values)."""
    lines = [f'{indent}a0: &a0 ["lol"]']
    lines += [f"{indent}a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def one_line(capsys, *args: str) -> str:
    """Run ``lnstab *args``; it must exit 2 with exactly one ``lnstab: error:`` line; that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(args))
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("lnstab: error: ") and "\n" not in err, err
    return err


# ----------------------------------------------------------------------------------------------- bounded parsing
def test_a_billion_laughs_is_refused_wherever_lnstab_reads_yaml(tmp_path, capsys) -> None:
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(f"extends: {QUICKSTART}\ntrainer:\n  plugins: {inline_laughs()}\n")
    assert f"--config {cfg}: its aliases expand to more than {MAX_NODES} values" in one_line(
        capsys, "fit", "--config", str(cfg), "--print_config")
    quoted = tmp_path / "quoted.yaml"  # a string that jsonargparse would parse as YAML again
    quoted.write_text(f"trainer:\n  plugins: '{inline_laughs()}'\n")
    assert "(YAML in a string of it): its aliases expand" in one_line(
        capsys, "fit", "--config", QUICKSTART, "--config", str(quoted), "--print_config")
    assert "its aliases expand to more than" in one_line(  # a command-line value, parsed by jsonargparse
        capsys, "fit", "--config", QUICKSTART, "--trainer.plugins", inline_laughs(), "--print_config")
    trainer = tmp_path / "trainer.yaml"  # a file that jsonargparse reads by itself
    trainer.write_text(f"plugins: {inline_laughs()}\n")
    assert "its aliases expand to more than" in one_line(
        capsys, "fit", "--config", QUICKSTART, "--trainer", str(trainer), "--print_config")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"base: {QUICKSTART}\naxes:\n  seed_everything: [0]\nslurm:\n{laughs(indent='  ')}")
    assert f"grid {grid}: its aliases expand" in one_line(capsys, "sweep", str(grid), "--dry-run")
    grid.write_text(f"base: {QUICKSTART}\naxes:\n  seed_everything: [0]\n")
    assert "--set trainer.plugins: its aliases expand" in one_line(
        capsys, "sweep", str(grid), "--dry-run", "--set", f"trainer.plugins={inline_laughs()}")
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text(laughs())
    assert f"--thresholds {thresholds}: its aliases expand" in one_line(
        capsys, "check", "--model.preset", "tiny", "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
    assert not (tmp_path / "c").exists() and not (tmp_path / "runs").exists()


def test_a_saved_config_that_is_a_bomb_is_refused_when_a_checkpoint_is_evaluated(tmp_path, capsys) -> None:
    import torch

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}, "hyper_parameters": {}}, run / "checkpoints" / "last.ckpt")
    (run / "config.yaml").write_text(f"data:\n  init_args:\n    path: {inline_laughs()}\n")
    err = one_line(capsys, "evaluate", "--config", str(tiny_config(tmp_path)), "--ckpt_path",
                   str(run / "checkpoints" / "last.ckpt"))
    assert f"{run / 'config.yaml'}: its aliases expand" in err


@pytest.mark.parametrize("kind", ["deep", "cycle", "utf8", "large"])
def test_deep_cyclic_non_utf8_and_oversized_configs_are_one_line(kind, tmp_path, capsys) -> None:
    cfg = tmp_path / "bad.yaml"
    expected = {"deep": "nests deeper than 64 levels", "cycle": "an alias refers to the value that holds it",
                "utf8": "is not UTF-8 text (byte 0xff at offset 14)", "large": "lnstab reads files of at most"}[kind]
    if kind == "deep":
        cfg.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    elif kind == "cycle":
        cfg.write_text("model: &m {preset: tiny, inner: *m}\n")
    elif kind == "utf8":
        cfg.write_bytes(b"model: {name: \xff\xfe}\n")
    else:
        cfg.write_text("# padding\n" * 1_000_000)
    assert expected in one_line(capsys, "fit", "--config", str(cfg), "--print_config")
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(cfg.read_bytes())
    assert f"grid {grid}" in one_line(capsys, "sweep", str(grid), "--dry-run")
    assert not (tmp_path / "runs").exists()


def test_bounded_readers_take_honest_files_unchanged(tmp_path) -> None:
    for path in sorted((ROOT / "experiments").rglob("*.yaml")):
        assert load_yaml(path) == yaml.safe_load(path.read_text()), path
    aliases = tmp_path / "aliases.yaml"  # a few honest aliases, merged keys included
    aliases.write_text("base: &b {lr: 0.1, steps: 3}\nrun: {<<: *b, steps: 5}\nlist: [*b, *b]\n")
    assert load_yaml(aliases) == yaml.safe_load(aliases.read_text())
    (tmp_path / "deep.json").write_text("[" * 100 + "]" * 100)
    with pytest.raises(DataFileError, match="nests deeper than 64 levels"):
        load_json(tmp_path / "deep.json")
    (tmp_path / "ok.json").write_text('{"a": ["[[[[", {"b": "}}}"}]}')
    assert load_json(tmp_path / "ok.json") == {"a": ["[[[[", {"b": "}}}"}]}


# ----------------------------------------------------------------------------------------------- non-finite numbers
def test_non_finite_numbers_are_tagged_and_strings_stay_strings(tmp_path) -> None:
    write_json(tmp_path / "summary.json", {"status": "diverged", "name": "nan", "note": "-inf",
                                           "val": {"loss": math.nan, "ppl": math.inf}, "low": -math.inf})
    back = read_summary(tmp_path)
    assert back["name"] == "nan" and back["note"] == "-inf"  # a run named nan stays a name
    assert math.isnan(back["val"]["loss"]) and back["val"]["ppl"] == math.inf and back["low"] == -math.inf
    assert '"$float": "nan"' in (tmp_path / "summary.json").read_text()  # strict JSON: no NaN literal
    assert read_json(tmp_path / "summary.json", numbers=False)["val"]["loss"] == {"$float": "nan"}


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


# ----------------------------------------------------------------------------------------------- run names
@pytest.mark.parametrize("value", ["..", ".", ".hidden"])
def test_a_run_name_that_would_leave_its_grid_directory_is_refused(value, tmp_path, capsys) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"data.init_args.path": [value, "ok"]}}))
    err = one_line(capsys, "sweep", str(grid), "--dry-run", "--root", str(tmp_path / "runs"))
    assert f"run name {value!r}" in err and "is not allowed" in err
    one_line(capsys, "sweep", str(grid), "--slurm", "--no-validate", "--root", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


def test_a_manifest_naming_a_run_outside_the_grid_is_damaged(tmp_path, capsys) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"base": QUICKSTART, "axes": {"seed_everything": [0]}}))
    write_json(tmp_path / "runs" / "g" / "s0" / "summary.json", {"status": "completed"})  # nothing to train
    manifest = tmp_path / "runs" / "g" / ".sweep" / "manifest.json"
    write_json(manifest, {"grid": str(grid), "base": QUICKSTART, "runs": [{"name": "..", "overrides": {}}]})
    err = one_line(capsys, "sweep", str(grid), "--no-validate", "--root", str(tmp_path / "runs"))
    assert f"{manifest} is damaged: runs[0] has the name '..'" in err


# ----------------------------------------------------------------------------------------------- run directories
@pytest.mark.parametrize("kind", ["dangling", "loop", "under_dangling", "under_file"])
def test_a_run_dir_behind_a_broken_link_or_under_a_file_is_one_line(kind, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    run_dir, expected = {
        "dangling": (tmp_path / "dangling", "is a symbolic link to"),
        "loop": (tmp_path / "loop_a", "is a loop of symbolic links"),
        "under_dangling": (tmp_path / "dangling" / "run", "which does not exist"),
        "under_file": (tmp_path / "file" / "a" / "run", "is a file, not a directory"),
    }[kind]
    cfg = tiny_config(tmp_path)
    assert expected in one_line(capsys, "fit", "--config", str(cfg), "--run_dir", str(run_dir))
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "runs").exists()
