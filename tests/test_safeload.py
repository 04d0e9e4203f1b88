"""``lnstab.safeload``, the bounded reader of every YAML and JSON file lnstab reads: a YAML bomb, a file too deep,
cyclic, not UTF-8 or too large, and a number too long to read are each one line (exit 2 and nothing written where a
command reads the file), and honest files read as ``yaml.safe_load`` and ``json`` read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.hostile import HUGE, inline_laughs
from support.runs import one_line_error, tiny_config

from lnstab.safeload import (
    MAX_NODES,
    MAX_NUMBER_CHARS,
    DataFileError,
    load_json,
    load_json_text,
    load_yaml,
    load_yaml_text,
)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def laughs(levels: int = 9, width: int = 10, indent: str = "") -> str:
    """A "billion laughs": ``levels`` anchors, each a list of ``width`` aliases of the one before (10⁹ values)."""
    lines = [f'{indent}a0: &a0 ["lol"]']
    lines += [f"{indent}a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_is_refused_wherever_lnstab_reads_yaml(tmp_path, capsys) -> None:
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(f"extends: {QUICKSTART}\ntrainer:\n  plugins: {inline_laughs()}\n")
    assert f"--config {cfg}: its aliases expand to more than {MAX_NODES} values" in one_line_error(
        capsys, "fit", "--config", str(cfg), "--print_config")
    quoted = tmp_path / "quoted.yaml"  # a string that jsonargparse would parse as YAML again
    quoted.write_text(f"trainer:\n  plugins: '{inline_laughs()}'\n")
    assert "(YAML in a string of it): its aliases expand" in one_line_error(
        capsys, "fit", "--config", QUICKSTART, "--config", str(quoted), "--print_config")
    assert "its aliases expand to more than" in one_line_error(  # a command-line value, parsed by jsonargparse
        capsys, "fit", "--config", QUICKSTART, "--trainer.plugins", inline_laughs(), "--print_config")
    trainer = tmp_path / "trainer.yaml"  # a file that jsonargparse reads by itself
    trainer.write_text(f"plugins: {inline_laughs()}\n")
    assert "its aliases expand to more than" in one_line_error(
        capsys, "fit", "--config", QUICKSTART, "--trainer", str(trainer), "--print_config")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"base: {QUICKSTART}\naxes:\n  seed_everything: [0]\nslurm:\n{laughs(indent='  ')}")
    assert f"grid {grid}: its aliases expand" in one_line_error(capsys, "sweep", str(grid), "--dry-run")
    grid.write_text(f"base: {QUICKSTART}\naxes:\n  seed_everything: [0]\n")
    assert "--set trainer.plugins: its aliases expand" in one_line_error(
        capsys, "sweep", str(grid), "--dry-run", "--set", f"trainer.plugins={inline_laughs()}")
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text(laughs())
    assert f"--thresholds {thresholds}: its aliases expand" in one_line_error(
        capsys, "check", "--model.preset", "tiny", "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
    assert not (tmp_path / "c").exists() and not (tmp_path / "runs").exists()


def test_a_saved_config_that_is_a_bomb_is_refused_when_a_checkpoint_is_evaluated(tmp_path, capsys) -> None:
    import torch

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    weights = {"model.transformer.wte.weight": torch.zeros(1)}  # read as lnstab's GPT up to the config
    torch.save({"state_dict": weights, "hyper_parameters": {}}, run / "checkpoints" / "last.ckpt")
    (run / "config.yaml").write_text(f"data:\n  init_args:\n    path: {inline_laughs()}\n")
    err = one_line_error(capsys, "evaluate", "--config", str(tiny_config(tmp_path)), "--ckpt_path",
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
    assert expected in one_line_error(capsys, "fit", "--config", str(cfg), "--print_config")
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(cfg.read_bytes())
    assert f"grid {grid}" in one_line_error(capsys, "sweep", str(grid), "--dry-run")
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
