"""Reference runs kept between cards (``lnstab.check.cache``): a second card reuses the first's reference runs and
grades exactly as a card that trained them afresh; a changed setting, ``--no-cache`` or an unreadable entry trains
them again. Real cards of a tiny lnstab model (OLMo 2's output norm, neither reference), in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.check import GPT, TINY, check

from lnstab.check import cache
from lnstab.check.runspec import RunResult

SUBJECT = [*GPT, "--model.norm_placement", "output"]


@pytest.fixture
def kept(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV, str(root))
    return root


def measured(report: dict) -> list:
    """Every number a card grades on: each criterion's measurement and references', and every run's losses."""
    return ([(r["id"], r["measured"], r["references"], r["status"]) for r in report["criteria"]]
            + [(r["subject"], r["lr"], r["seed"], r["losses"]) for r in report["runs"]])


def cached(report: dict) -> list[tuple[str, float]]:
    return sorted((r["subject"], r["lr"]) for r in report["runs"] if r.get("cached"))


def test_a_second_card_reuses_the_reference_runs_and_grades_as_a_fresh_one(kept, tmp_path) -> None:
    code_a, first = check(tmp_path / "a", *SUBJECT, *TINY)
    assert cached(first) == [] and len(first["runs"]) == 9
    assert len([p for p in kept.iterdir() if not p.name.startswith(".")]) == 6  # 2 references × 3 rates, 1 seed

    code_b, second = check(tmp_path / "b", *SUBJECT, *TINY, "--workers", "2")  # kept by this process, read by workers
    assert cached(second) == sorted((s, lr) for s in ("peri-ln", "pre-ln") for lr in (1e-3, 1e-2, 1e-1))
    assert code_b == code_a and measured(second) == measured(first)
    for run in second["runs"]:  # the reused runs' logs are in this card's run directory, as trained ones are
        assert any((tmp_path / "b" / run["log_dir"]).glob("events.out.tfevents.*")), run["log_dir"]
    assert "Reused: 6 of 9 stress runs (peri-ln, pre-ln)" in (tmp_path / "b" / "report.md").read_text()

    code_c, fresh = check(tmp_path / "c", *SUBJECT, *TINY, "--no-cache")
    assert cached(fresh) == [] and code_c == code_a
    assert measured(fresh) == measured(first)  # what the cache stands in for is what training gives again
    assert "Reused" not in (tmp_path / "c" / "report.md").read_text()


def test_a_changed_setting_trains_the_references_again(kept, tmp_path) -> None:
    check(tmp_path / "a", *SUBJECT, *TINY)
    for name, change in {"protocol": ["--grad-clip", "0.5"], "token-windows": ["--batch-size", "2"],
                         "seed": ["--seeds", "1"]}.items():
        _, other = check(tmp_path / name, *SUBJECT, *TINY, *change)
        assert other["runs"] and cached(other) == [], name


def test_an_unreadable_entry_is_trained_again_and_written_anew(kept, tmp_path) -> None:
    _, first = check(tmp_path / "a", *SUBJECT, *TINY)
    entries = [p for p in kept.iterdir() if not p.name.startswith(".")]
    for entry in entries:
        (entry / cache.RESULT).write_text('{"subject": "pre-ln", "lr": ')
    _, again = check(tmp_path / "b", *SUBJECT, *TINY)
    assert cached(again) == [] and measured(again) == measured(first)
    for entry in entries:
        data = json.loads((entry / cache.RESULT).read_text())
        data["metrics"] = {int(k): v for k, v in data["metrics"].items()}
        assert RunResult(**data).subject in cache.REFERENCE_KEYS


def test_the_checked_models_runs_are_never_kept(kept, tmp_path) -> None:
    _, card = check(tmp_path / "a", *GPT, "--model.norm_placement", "peri", *TINY)  # the checked model is Peri-LN
    kept_runs = [json.loads((p / cache.RESULT).read_text())["subject"] for p in kept.iterdir()]
    assert sorted(set(kept_runs)) == ["pre-ln"] and len(kept_runs) == 3  # Peri-LN's runs are the checked model's
    assert cache.cache_root(no_cache=True) is None


@pytest.mark.system
def test_a_cache_on_a_full_disk_costs_only_time(full_disk, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cache.ENV, str(full_disk / "cache"))
    code, card = check(tmp_path / "a", *SUBJECT, *TINY)
    assert code in (0, 1) and len(card["runs"]) == 9 and cached(card) == []
    left = list((full_disk / "cache").iterdir()) if (full_disk / "cache").is_dir() else []
    assert left == []  # no entry, and no half-written one
