"""The model-update exploration (docs/check/validation/explorations/model-update) runs, and measures what it says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "docs/check/validation/explorations/model-update/model_update.py"


def load():
    spec = importlib.util.spec_from_file_location("model_update", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_update_is_zero_at_initialisation_and_tracks_the_weights():
    mu = load()
    tokens = torch.randint(0, 50, (3 * 4, 17), generator=torch.Generator().manual_seed(0))
    opt = mu.Optimisation(steps=2, warmup_steps=1)
    updates, loss = mu.train("post", 2, tokens, 50, 1e-2, 0, 2, 1, opt, 4)
    assert updates[0] == 0.0 and all(u > 0 for u in updates[1:]) and len(updates) == 3 and loss > 0
    still, _ = mu.train("post", 2, tokens, 50, 0.0, 0, 2, 1, opt, 4)  # a zero rate: nothing moves
    assert still == [0.0, 0.0, 0.0]
    again, _ = mu.train("post", 2, tokens, 50, 1e-2, 0, 2, 1, opt, 4)
    assert again == updates  # seeded: the same series


def test_the_script_writes_every_series(tmp_path, monkeypatch, capsys):
    mu = load()
    monkeypatch.setitem(mu.REGIMES, "default", {"n_layer": 2, "steps": 3, "warmup": 1, "lrs": (1e-2,)})
    data = tmp_path / "owt.txt"
    data.write_text(" ".join(f"word{i % 97}" for i in range(20_000)))
    out = tmp_path / "series.json"
    mu.main(["--data.path", str(data), "--regimes", "default", "--seeds", "0", "--placements", "post,deepnorm",
             "--json", str(out)])
    series = json.loads(out.read_text())["default"]
    assert set(series) == {"post", "deepnorm"} and len(series["post"]["0.01"]["update"]) == 4  # init + 3 steps
    assert "| deepnorm | 0.01 |" in capsys.readouterr().out
