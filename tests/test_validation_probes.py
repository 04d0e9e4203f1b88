"""The validation's probe scripts (docs/check/validation/probes/): the model-update probe (model_update.py) measures
what its README says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from lnstab.check.training import Optimisation

SCRIPT = Path(__file__).parents[1] / "docs/check/validation/probes/model_update.py"


def load():
    spec = importlib.util.spec_from_file_location("model_update", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_update_is_seeded_zero_without_a_step_and_post_ln_has_no_final_norm():
    probe = load()
    tokens = torch.randint(0, 50, (3 * probe.BATCH, 17), generator=torch.Generator().manual_seed(0))
    opt = Optimisation(steps=3, warmup_steps=1)
    block = probe.run(tokens, 50, "post", 1e-2, 0, opt, 2)
    assert len(block["update"]) == 3 and all(u > 0 for u in block["update"]) and all(v > 0 for v in block["loss"])
    assert probe.run(tokens, 50, "post", 1e-2, 0, opt, 2) == block  # seeded
    assert probe.run(tokens, 50, "post", 1e-2, 0, opt, 2, site="head") == block  # Post-LN's ln_f is an identity
    assert probe.run(tokens, 50, "pre", 1e-2, 0, opt, 2, site="head") != probe.run(tokens, 50, "pre", 1e-2, 0, opt, 2)
    assert probe.run(tokens, 50, "pre", 0.0, 0, opt, 2, site="head")["update"] == [0.0, 0.0, 0.0]  # nothing moves


def test_the_command_line_writes_every_run(tmp_path, capsys):
    probe = load()
    data = tmp_path / "owt.txt"
    data.write_text(" ".join(f"word{i % 97}" for i in range(20_000)))
    out = tmp_path / "runs.json"
    probe.main([str(data), "post,peri", "1e-2", "10", "2", str(out), "--warmup", "3", "--site", "head"])
    record = json.loads(out.read_text())
    runs = record["runs"]
    assert record["argv"][0] == "owt.txt"  # the data file by name, no path of this machine
    assert set(runs) == {f"{p} lr 0.01 seed {s}" for p in ("post", "peri") for s in (0, 1)}
    assert all(len(r["update"]) == 10 for r in runs.values())
    assert "peri lr 0.01 seed 1: update after step 1" in capsys.readouterr().out
