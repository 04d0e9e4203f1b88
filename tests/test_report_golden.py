"""``lnstab report`` of committed run directories is, byte for byte, the committed report: the runs of
``tests/data/report/golden.yaml`` (real ``lnstab fit`` runs, a diverged and a missing one among them; how they were
made: ``tests/data/report/README.md``) and what the report wrote from them. A change to how runs are read, measured,
fitted or tabulated shows here as a diff of its tables, Markdown and CSV; a change meant to alter them rewrites
``expected/`` with the command in the README, and the diff is reviewed with it. The figures are checked for presence
only (their pixels depend on matplotlib's version)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from lnstab.cli import main

DATA = Path(__file__).parent / "data" / "report"


def test_the_report_of_the_committed_runs_is_the_committed_report(tmp_path, monkeypatch, capsys) -> None:
    shutil.copytree(DATA / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)  # the report quotes its command: the same relative paths as when it was made
    main(["report", "runs/golden", "--out", "expected"])
    said = capsys.readouterr()
    assert (said.out + said.err).strip().endswith("7 tables (md + csv), 9 figures"), said
    written = tmp_path / "expected"
    expected = sorted(p.name for p in (DATA / "expected").iterdir())
    assert sorted(p.name for p in written.iterdir() if p.suffix != ".png") == expected
    for name in expected:
        assert (written / name).read_text() == (DATA / "expected" / name).read_text(), name
    figures = re.findall(r"\]\(([\w.]+\.png)\)", (written / "report.md").read_text())
    assert len(figures) >= 9 and all((written / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figures)


def test_the_copy_rate_of_teacher_forced_evaluations_is_a_performance_column_beside_rouge(tmp_path) -> None:
    # eval.json records since the copying record: how many predictions repeat their input token (ROUGE ≈ 1 for that)
    runs = shutil.copytree(DATA / "runs" / "golden", tmp_path / "golden")
    rates = {"pre_lr0.003_s0": 0.5, "pre_lr0.003_s1": 0.25, "peri_lr0.003_s0": 0.0}
    for name, rate in rates.items():
        record = json.loads((runs / name / "eval.json").read_text())
        record["copying"] = {"rate": rate, "baseline": {"rouge1": 0.99, "rouge2": 0.99, "rougeL": 0.99}}
        (runs / name / "eval.json").write_text(json.dumps(record))
    main(["report", str(runs), "--out", str(tmp_path / "out")])
    lines = (tmp_path / "out" / "performance.md").read_text().splitlines()
    assert lines[0].endswith("| bertscore_f1 | copy_rate |")
    cells = {tuple(line.split(" | ")[:2]): line.rsplit(" | ", 2)[-1] for line in lines[2:]}
    assert cells[("| pre", "0.003")] == "0.375 ± 0.18 |"  # mean and sample std of 0.5 and 0.25
    assert cells[("| peri", "0.003")] == "0 (n=1) |"  # one of the two runs has it, and the cell says so
    assert cells[("| pre", "0.03")] == "– |"  # evaluated before the record existed
    assert "copy_rate" in (tmp_path / "out" / "runs.csv").read_text().splitlines()[0].split(",")
