"""``lnstab check``'s parent process never imports Lightning: it plans, waits and grades, while its workers train (and
one of them reads the data). Lightning's import (with torchmetrics, transformers and scipy behind it) is seconds of
CPU on a slow 2-core machine, paid before any worker could start; ``lnstab --help``, ``lnstab check --help``,
``--compare``, ``lnstab report`` and their usage errors start without it too.

Each case runs in a fresh interpreter (this one has Lightning imported long ago) and reports which modules it ended
with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
HEAVY = ("lightning", "lightning.pytorch", "torchmetrics", "transformers", "lnstab.lightning_cli",
         "lnstab.datamodules", "lnstab.check.training", "lnstab.module")
MODEL = ["--model.preset", "tiny", "--model.vocab_size", "128", "--model.block_size", "32", "--model.norm_placement",
         "output"]
FACTORY = ["--factory", "check_factories:encoder_lm", "--layer-pattern", r"layers\.(\d+)$"]  # finds its sites in
# the parent through lnstab.callbacks' site helpers
PROTOCOL = ["--lrs", "1e-2", "--seeds", "0,1", "--steps", "4", "--measure-every", "2", "--batch-size", "4", "--seq-len",
            "16", "--no-progress", "--workers", "2", "--threads", "2"]
TINY = [*MODEL, *PROTOCOL]
SCRIPT = """
import json, sys
from lnstab.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def parent(*commands: list[str], cwd: Path) -> tuple[dict, str]:
    """Run ``lnstab.cli.main`` on each command in one fresh interpreter; its exit codes and the heavy modules it
    imported, and its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(commands)), json.dumps(HEAVY)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def text_file(path: Path, documents: int) -> Path:
    """A JSON-lines file of ``documents`` short English documents (GPT-2 tokens enough for the tiny protocol)."""
    words = "the model trains on text and the norm keeps its hidden states from growing over depth".split()
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(40))}) for i in range(documents)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.system
def test_help_compare_and_usage_errors_start_without_lightning(tmp_path) -> None:
    validation = str(ROOT / "docs" / "check" / "validation")
    got, _ = parent(["--help"], ["check", "--help"], ["check", "--compare", validation, validation],
                    ["check", "--model.preset", "tiny", "--lrs", "x"], ["report", "--help"],
                    ["report", str(tmp_path / "no-such-run")], cwd=tmp_path)
    assert got["codes"][:5] == [0, 0, 0, 2, 0] and got["codes"][5] != 0
    assert got["heavy"] == []


@pytest.mark.system
@pytest.mark.parametrize(("model", "source"), [("lnstab", "synthetic"), ("lnstab", "files"), ("factory", "synthetic")])
def test_a_check_with_workers_trains_and_grades_without_lightning_in_its_parent(tmp_path, model, source) -> None:
    data = (["--data.source", "synthetic"] if source == "synthetic" else
            ["--data.path", str(text_file(tmp_path / "docs.jsonl", 60)), "--vocab", "protocol"])
    subject = MODEL if model == "lnstab" else FACTORY
    got, _ = parent(["check", *subject, *PROTOCOL, *data, "--out", str(tmp_path / "card")], cwd=tmp_path)
    report = json.loads((tmp_path / "card" / "report.json").read_text())
    assert got["codes"] == [report["exit_code"]] and report["status"] in ("pass", "warn", "fail")
    assert report["provenance"]["machine"]["workers"] == 2 and len(report["runs"]) == 6
    assert report["data"]["source"] == source and all(len(r["losses"]) == 5 for r in report["runs"])
    assert got["heavy"] == []  # the workers imported them; the parent did not


@pytest.mark.system
def test_a_data_error_in_the_worker_that_reads_the_data_is_one_line_and_leaves_nothing(tmp_path) -> None:
    """The error crosses from the worker as it was raised; the workers end at once and leak no semaphore (tqdm's
    multiprocessing lock, which the data module's reader would create in a worker, is switched off there)."""
    exe = Path(sys.executable).with_name("lnstab")
    tiny = text_file(tmp_path / "tiny.jsonl", 1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(exe), "check", *TINY, "--data.path", str(tiny), "--out", str(tmp_path / "card")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("lnstab: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "--data.path" in done.stderr and not (tmp_path / "card").exists()


def test_the_lightningcli_names_are_still_reachable_from_lnstab_cli() -> None:
    import lnstab.cli
    from lnstab.lightning_cli import LNStabCLI, cli_main

    assert lnstab.cli.cli_main is cli_main and lnstab.cli.LNStabCLI is LNStabCLI
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        lnstab.cli.nothing_here  # noqa: B018
