"""The final evaluation under FSDP (2 CPU processes, gloo, each Block its own unit): training saves a sharded
checkpoint directory, as the 774M / 1.5B configs do, and ``lnstab evaluate --ckpt_path <that directory>`` loads it
through the strategy and scores it on the gathered full parameters, equal to one process scoring the same weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from support.runs import tiny_config

from lnstab.cli import cli_main
from lnstab.evaluation import evaluate_model
from lnstab.module import GPTModule
from lnstab.rundir import read_summary

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
def test_lnstab_evaluate_reads_a_sharded_fsdp_checkpoint_and_equals_one_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))  # spawned ranks
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path, **{"trainer.devices": 2, "trainer.max_steps": 2})
    raw = yaml.safe_load(cfg.read_text())
    strategy = {"auto_wrap_policy": ["lnstab.model.Block"], "state_dict_type": "sharded"}  # as experiments/fsdp.yaml
    raw["trainer"]["strategy"] = {"class_path": "fsdp_cpu.CPUFSDPStrategy", "init_args": strategy}
    raw["instruments"]["enabled"] = False
    raw["evaluation"] = {"n_samples": 6, "batch_size": 2, "on_fit_end": False}
    cfg.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    cli_main(["fit", "--config", str(cfg), "--run_dir", str(run)])
    assert read_summary(run)["status"] == "completed"
    sharded = run / "checkpoints" / "last.ckpt"
    assert sharded.is_dir() and (sharded / ".metadata").is_file()  # a sharded checkpoint is a directory

    cli_main(["evaluate", "--ckpt_path", "last", "--run_dir", str(run), "--config", str(cfg)])
    record = json.loads((run / "eval.json").read_text())
    assert record["stage"] == "evaluate" and record["settings"]["world_size"] == 2 and record["global_step"] == 2

    # one process, the same weights: consolidate the shards and score them directly
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(sharded, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    state = {k.removeprefix("model."): v for k, v in full["model"].items()}  # Lightning's sharded layout
    module = GPTModule(**{k: v for k, v in raw["model"].items()})
    module.model.load_state_dict(state)
    from lnstab.datamodules import OpenWebTextDataModule

    data = OpenWebTextDataModule(block_size=raw["model"]["block_size"], **raw["data"]["init_args"])
    data.setup("validate")
    single = evaluate_model(module.model, data.validation_tokens(), n_samples=6, batch_size=2, rank=0, world_size=1)
    assert [s["prediction"] for s in record["samples"]] == [s["prediction"] for s in single["samples"]]
    for key, value in single["metrics"].items():
        assert record["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
