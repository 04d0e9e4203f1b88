"""The ``lnstab`` CLI: every shipped YAML parses, extends-chains, a real fit writes a run directory, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lnstab.cli import cli_main, main
from lnstab.configfiles import expand_extends
from lnstab.errors import LNStabError
from lnstab.moduleargs import gpt_config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def resolved_config(path: Path, capsys, *extra: str) -> dict:
    """The config ``lnstab fit --config path --print_config`` prints: parsed, type-checked, classes resolved."""
    with pytest.raises(SystemExit) as info:
        cli_main(["fit", "--config", str(path), *extra, "--print_config"])
    assert info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_there_is_one_config_per_paper_experiment() -> None:
    names = {p.stem for p in EXPERIMENTS}
    for size in ("gpt2", "gpt2-large", "gpt2-xl"):
        for placement in ("pre", "peri"):
            for dt in ("1", "0.1"):
                assert f"{size}_{placement}_dt{dt}" in names
    for placement in ("pre", "peri"):
        for dt in ("1", "0.1"):
            assert f"gpt2_{placement}_dt{dt}_wd0" in names
    assert {"base", "quickstart", "gpt2_post_dt1", "gpt2_none_dt1"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_yaml_parses_through_the_cli(path: Path, capsys) -> None:
    config = resolved_config(path, capsys)
    model = config["model"]
    # The architecture the file describes is a valid GPTConfig (built without allocating the weights).
    gpt_config(model)
    assert "block_size" not in config["data"].get("init_args", {})  # linked from the model, never set twice
    if path.stem not in ("base", "fsdp", "quickstart", "proxy"):
        name = config["trainer"]["logger"]["init_args"]["name"]
        assert name == path.stem  # runs land in runs/<experiment>/version_N
        placement, dt = path.stem.split("_")[1], float(path.stem.split("_")[2][2:])
        assert (model["norm_placement"], model["residual_scale"]) == (placement, dt)
        assert model["weight_decay"] == (0.0 if path.stem.endswith("_wd0") else 0.1)


def test_quickstart_instantiates_with_the_data_block_size_linked(tmp_path) -> None:
    cli = cli_main(
        ["--config", str(ROOT / "experiments" / "quickstart.yaml"), "--model.block_size", "48",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        run=False,
    )
    assert cli.model.config.block_size == 48 and cli.datamodule.hparams.block_size == 48
    assert cli.model.config.norm_placement == "peri"


def test_paper_scale_values(capsys) -> None:
    c = resolved_config(ROOT / "experiments" / "gpt2-xl_peri_dt0.1.yaml", capsys)
    m, t = c["model"], c["trainer"]
    assert (m["preset"], m["block_size"], m["bias"]) == ("gpt2-xl", 1024, False)
    assert (m["learning_rate"], m["min_lr"]) == (6e-4, 6e-5)
    assert (m["warmup_steps"], t["max_steps"], m["betas"], t["gradient_clip_val"]) == (2000, 60000, [0.9, 0.95], 1.0)
    assert t["precision"] == "auto" and "FSDPStrategy" in t["strategy"]["class_path"]  # bf16-mixed on H200s
    tokens = 8 * c["data"]["init_args"]["batch_size"] * t["accumulate_grad_batches"] * m["block_size"]
    assert tokens == 262_144  # ~0.25M tokens per optimizer step on one 8-GPU node
    c = resolved_config(ROOT / "experiments" / "gpt2_pre_dt1.yaml", capsys, "--trainer.num_nodes", "2")
    assert c["trainer"]["num_nodes"] == 2 and c["trainer"]["strategy"] == "ddp"
    assert 8 * c["data"]["init_args"]["batch_size"] * c["model"]["block_size"] == 262_144


def test_two_experiment_files_on_one_base_read_the_base_once(capsys) -> None:
    """``--config quickstart.yaml --config gpt2_pre_dt1.yaml`` (both extend base.yaml): base.yaml was read again
    before the second file, so the paper's 60k steps on 8 GPUs silently undid the quickstart's CPU settings; the later
    file now wins with its own keys only, as docs/experiments.md says."""
    experiments = Path(__file__).parents[1] / "experiments"
    quick, pre, base = (str(experiments / f) for f in ("quickstart.yaml", "gpt2_pre_dt1.yaml", "base.yaml"))
    assert expand_extends(["fit", "--config", quick, "--config", pre]) == [
        "fit", "--config", base, "--config", quick, "--config", pre]
    config = resolved_config(Path(quick), capsys, "--config", pre)
    assert config["model"]["norm_placement"] == "pre" and config["trainer"]["max_steps"] == 300
    assert config["trainer"]["accelerator"] == "cpu" and config["model"]["n_embd"] == 64


def test_extends_chain_expands_base_first_and_refuses_cycles(tmp_path) -> None:
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: c.yaml\n")
    (tmp_path / "c.yaml").write_text("model:\n  preset: tiny\n")
    args = expand_extends(["fit", "--config", str(tmp_path / "a.yaml"), "--model.preset", "mini"])
    chain = sum((["--config", str(tmp_path / f"{n}.yaml")] for n in "cba"), [])
    assert args == ["fit", *chain, "--model.preset", "mini"]
    (tmp_path / "c.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(LNStabError, match="cycle"):
        expand_extends(["--config", str(tmp_path / "a.yaml")])
    with pytest.raises(LNStabError, match="is not a file"):
        expand_extends(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.norm_placement", "sideways"], "model.norm_placement='sideways' is not allowed; choose one of: pre"),
        (["--model.norm_type", "batchnorm"], "model.norm_type='batchnorm' is not allowed; choose one of: layernorm"),
        (["--model.preset", "gpt5"], "model.preset='gpt5' is not allowed"),
        (["--model.residual_scale", "0"], "model.residual_scale=0.0 is not allowed; it must be a finite number > 0"),
        (["--model.n_embd", "102"], "model.n_embd=102 is not allowed with n_head=4"),
        (["--data.source", "nonsense"], "data.source='nonsense' is not allowed; choose one of: hf, files, prepared"),
        (["--model.residual_scale", "abc"], "model.residual_scale='abc' is not allowed; it must be a number"),
        (["--model.colour", "red"], "unrecognized arguments: --model.colour red"),
        (["--data.colour", "red"], "unrecognized arguments: --data.colour (not an argument"),  # was NestedArg(key=…
        (["--model.min_lr", "1", "--model.learning_rate", "0.1"], "model.min_lr=1.0 is not allowed; it must be <="),
        (["--data.batch_size", "0"], "data.batch_size=0 is not allowed; it must be an integer >= 1"),
        (["--data.val_documents", "5"], "--data.val_documents 5 is not used with --data.val_split head"),
        (["--data.path"], "argument --data.path: expected one argument"),  # was 'argument --data: …'
        (["--data.path", "--model.n_layer", "2"], "argument --data.path: expected one argument"),  # an unset $VAR
        (["--model.n_layer"], "argument --model.n_layer: expected one argument"),
    ],
)
def test_bad_model_input_is_one_line_exit_2_and_writes_nothing(args, expected, tmp_path, capsys, caplog) -> None:
    """Refused in one line naming the config key, before the data or the trainer say anything (the data module
    used to announce its source first, and a bad --data.* came after the precision line)."""
    quickstart = str(ROOT / "experiments" / "quickstart.yaml")
    run_root = tmp_path / "runs"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", quickstart, "--trainer.logger.init_args.save_dir", str(run_root), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lnstab: error: ") and expected in err and "\n" not in err
    assert not run_root.exists()
    assert "lnstab data:" not in caplog.text and "precision auto" not in caplog.text


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # before: "instruments.fatal_kinds='3' is not allowed; choose one of: " (an empty list), and each data field
        # as "data='True' is not allowed; choose one of: null", naming the data module instead of its argument
        ("instruments: {fatal_kinds: 3}\n", "instruments.fatal_kinds='3' is not allowed; it must be a list of strings"),
        ("data: {init_args: {path: true}}\n", "data.init_args.path='True' is not allowed; it must be a string or null"),
        ("data: {path: true}\n", "data.path='True' is not allowed; it must be a string or null"),
        ("data: {val_documents: [1]}\n", "data.val_documents='[1]' is not allowed; it must be a number or null"),
        ("data: {init_args: {data_files: {a: 1}}}\n",
         "data.init_args.data_files=\"{'a': 1}\" is not allowed; it must be a string, a list of strings or null"),
        ("data: {init_args: {seed: abc}}\n", "data.init_args.seed='abc' is not allowed; it must be an integer"),
        ("model: {norm_placement: [pre]}\n", "model.norm_placement=\"['pre']\" is not allowed; it must be a string"),
    ],
)
def test_a_config_value_of_the_wrong_type_names_its_field_and_what_it_takes(text, expected, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    run_root = tmp_path / "runs"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "experiments" / "quickstart.yaml"), "--trainer.max_steps", "1",
              "--data.source", "synthetic", "--trainer.logger.init_args.save_dir", str(run_root), "--config", str(bad)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("lnstab: error: ") and "\n" not in err, err
    assert expected in err, err
    assert not run_root.exists()


@pytest.mark.slow
@pytest.mark.system
def test_console_script_fit_writes_a_run_directory(tmp_path) -> None:
    """What a new user runs: the ``lnstab`` console script, a few steps of the quickstart, offline."""
    exe = Path(sys.executable).with_name("lnstab")
    cmd = [str(exe), "fit", "--config", str(ROOT / "experiments" / "quickstart.yaml"), "--trainer.max_steps", "3",
           "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart" / "version_0"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["norm_placement"] == "peri" and saved["trainer"]["max_steps"] == 3
    assert (run / "checkpoints" / "last.ckpt").is_file()
    # A second run never overwrites the first: it gets the next version directory. It is `python -m lnstab`, the
    # command for an environment whose scripts are not on PATH (it was "No module named lnstab.__main__").
    done = subprocess.run([sys.executable, "-m", "lnstab", *cmd[1:]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "quickstart" / "version_1" / "config.yaml").is_file()


def test_fsdp_configs_wrap_each_block(capsys) -> None:
    """The 774M / 1.5B strategy block instantiates to FSDP with one unit per Block (no GPU needed to build it)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy

    from lnstab.model import Block

    strategy = resolved_config(ROOT / "experiments" / "gpt2-xl_pre_dt1.yaml", capsys)["trainer"]["strategy"]
    parser = ArgumentParser()
    parser.add_class_arguments(FSDPStrategy, "strategy")
    cfg = parser.parse_object({"strategy": strategy["init_args"]})
    fsdp = parser.instantiate(cfg).strategy
    assert isinstance(fsdp, FSDPStrategy)
    assert fsdp.kwargs["auto_wrap_policy"]._module_classes == {Block}
