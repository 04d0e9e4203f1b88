"""Every committed card's ``report.md`` re-rendered from its ``report.json``, and the committed validation READMEs from
their committed run records (``summary.json`` with its ``readme`` record, and the rows' ``report.json``): the main
README byte for byte, and every README's verdicts and tables; the validation's data files read back, and refused in one
line when malformed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from scipy.stats import binomtest

from lnstab.check.card import build_rows
from lnstab.check.criteria import overall
from lnstab.check.options import tier_thresholds
from lnstab.check.report import markdown
from lnstab.check.validation import sets
from lnstab.check.validation.readme import rerender
from lnstab.check.validation.score import best_constant, score, wilson
from lnstab.rundir import read_json
from lnstab.safeload import DataFileError

VALIDATION = Path(__file__).resolve().parents[1] / "docs" / "check" / "validation"
RECORDS = sorted(p.parent for p in VALIDATION.rglob("summary.json") if "readme" in json.loads(p.read_text()))


def verdict_lines(text: str) -> list[str]:
    """What a README says of the verdicts: the agreement line, each row's implied verdict, card and agreement, the
    table of criteria by row and which rows each criterion decides. (A row's outcome, source and note are prose,
    which a run written before the citations were re-read quotes as they stood then.)"""
    found = []
    for line in text.split("\n"):
        cells = line.split(" | ")
        if line.startswith("**Agreement"):
            found.append(line)
        elif line.startswith("| ") and len(cells) == 8 and cells[0][2:].isdigit():  # a row of the verdict table
            found.append(" | ".join([cells[0], *cells[3:7]]))
        elif line.startswith("| ") or line.startswith("- `") and ": fails " in line:
            found.append(line)
    return found


def test_every_run_record_with_its_readme_is_found() -> None:
    assert {p.relative_to(VALIDATION).as_posix() for p in RECORDS} >= {
        ".", "heldout", "supplements/no-warmup-6", "supplements/long-warmup-6", "proxy"}


def test_the_main_readme_renders_again_byte_for_byte() -> None:
    assert rerender(VALIDATION) == (VALIDATION / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("where", RECORDS, ids=lambda p: p.relative_to(VALIDATION).as_posix())
def test_each_readmes_verdicts_and_tables_render_again(where: Path) -> None:
    committed = verdict_lines((where / "README.md").read_text(encoding="utf-8"))
    assert len(committed) > 10 and verdict_lines(rerender(where)) == committed


def test_a_changed_verdict_shows_in_the_rendered_readme(tmp_path) -> None:
    copy = tmp_path / "validation"
    shutil.copytree(VALIDATION, copy, ignore=shutil.ignore_patterns("*.png"))
    card = json.loads((copy / "peri-ln" / "report.json").read_text())
    assert card["status"] == "pass"
    (copy / "peri-ln" / "report.json").write_text(json.dumps({**card, "status": "warn"}))
    text, committed = rerender(copy), (VALIDATION / "README.md").read_text(encoding="utf-8")
    assert text != committed
    assert verdict_lines(text) != verdict_lines(committed)
    agree, rows = re.search(r"\*\*Agreement over all rows: (\d+) of (\d+) rows", committed).groups()
    assert f"**Agreement over all rows: {int(agree) - 1} of {rows} rows" in text  # peri-ln agreed; now it does not
    assert headline(text) != headline(committed)  # peri-ln is scored


def headline(text: str) -> str:
    return next(line for line in text.split("\n") if line.startswith("**Agreement over the rows"))


def test_a_row_left_out_of_the_headline_changes_only_the_agreement_over_all_rows(tmp_path) -> None:
    copy = tmp_path / "validation"
    shutil.copytree(VALIDATION, copy, ignore=shutil.ignore_patterns("*.png"))
    assert not {r.id: r for r in sets.ROWS}["deepnorm"].scored("quick")
    card = json.loads((copy / "deepnorm" / "report.json").read_text())
    flipped = "fail" if card["status"] in ("pass", "warn") else "warn"  # from agreeing to not, or back
    (copy / "deepnorm" / "report.json").write_text(json.dumps({**card, "status": flipped}))
    text, committed = rerender(copy), (VALIDATION / "README.md").read_text(encoding="utf-8")
    assert headline(text) == headline(committed)
    assert all_rows(text) != all_rows(committed)


def all_rows(text: str) -> str:
    return next(line for line in text.split("\n") if line.startswith("**Agreement over all rows"))


@pytest.mark.parametrize(("agree", "n"), [(10, 12), (0, 5), (5, 5), (6, 6), (3, 8), (1, 1), (47, 50)])
def test_the_wilson_interval_is_scipys(agree, n) -> None:
    ci = binomtest(agree, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson(agree, n) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_the_wilson_interval_of_10_of_12_is_about_55_to_95_percent() -> None:
    low, high = wilson(10, 12)
    assert round(low, 3) == 0.552 and round(high, 3) == 0.953  # by hand: (p + z²/2n ± z√(p(1−p)/n + z²/4n²))/(1 + z²/n)


@pytest.mark.parametrize(("agree", "n"), [(0, 0), (3, 2), (-1, 4)])
def test_the_wilson_interval_refuses_an_impossible_count(agree, n) -> None:
    with pytest.raises(ValueError, match="0 <= agree <= n and n > 0"):
        wilson(agree, n)


def row(rid: str, expected: tuple[str, ...], reachable: tuple[str, ...] = ("quick",), reported: bool = True):
    return sets.Row(rid, "d", (), "o", "s", expected, None, reachable, reported, "n")


def test_the_best_constant_verdict_and_the_score_are_over_the_reachable_reported_rows() -> None:
    rows = [row("f", ("fail",)), row("s1", sets.STABLE), row("s2", sets.STABLE), row("w", ("warn",)),
            row("far", ("fail",), reachable=("proxy",)), row("told", ("pass",), reported=False)]
    assert best_constant(rows) == ("warn", 3)  # WARN 3 (s1, s2, w) ties PASS 3 (s1, s2, told): WARN first
    assert best_constant(rows[:4] + [row("p", ("pass",))] * 2) == ("pass", 4)
    assert best_constant([row("f", ("fail",))]) == ("fail", 1)
    got = score(rows, ["fail", "warn", "fail", "warn", "pass", "pass"], "quick")
    assert [r.id for r in got.scored] == ["f", "s1", "s2", "w"] and got.agree == 3
    assert got.baseline == ("warn", 3) and got.interval == wilson(3, 4)
    assert [(r.id, why) for r, why in got.left_out] == [("far", "not reachable"), ("told", "implied")]
    proxy = score(rows, ["fail", "warn", "fail", "warn", "fail", "pass"], "proxy")
    assert [r.id for r in proxy.scored] == ["far"] and proxy.agree == 1 and proxy.baseline == ("fail", 1)


@pytest.mark.parametrize("file", sorted(VALIDATION.parent.rglob("report.json")),
                         ids=lambda p: p.parent.relative_to(VALIDATION.parent).as_posix())
def test_every_committed_card_grades_again_to_its_verdicts(file: Path) -> None:
    """A shipped card is what its stored measurements grade to under the package's thresholds for its tier: a change of
    thresholds or criteria (issue 39: mechanisms warn only) re-grades the committed cards, or this fails. Each row
    whole, the sentence saying why and its numbers included (issue 38: the same card before and after)."""
    card = read_json(file)  # lnstab's JSON: a NaN is {"$float": "nan"}
    sites = card["model"]["sites"]
    order = ["checked", "pre-ln", "peri-ln"]  # the subjects' order (report.json sorts its keys)
    summaries = {k: card["summaries"][k] for k in sorted(card["summaries"], key=lambda k: (
        k not in order, order.index(k) if k in order else 0, k))}
    tier = (card.get("tier") or {}).get("name", "quick")  # cards from before the tiers are the quick tier's
    rows = build_rows(summaries, tier_thresholds(tier, None), {"norm_pattern": sites.get("norm_pattern"), "attention":
                      sites.get("attention"), "logits": sites.get("logits"), "bound_unchecked": ""})
    assert {r["id"]: r["status"] for r in rows} == {c["id"]: c["status"] for c in card["criteria"]}
    assert json.dumps(rows, sort_keys=True) == json.dumps(card["criteria"], sort_keys=True)  # NaN == NaN as text
    assert overall([r["status"] for r in rows]) == card["status"]


@pytest.mark.parametrize("file", sorted(VALIDATION.parent.rglob("report.json")),
                         ids=lambda p: p.parent.relative_to(VALIDATION.parent).as_posix())
def test_every_committed_cards_markdown_renders_again_byte_for_byte(file: Path) -> None:
    """A shipped card's ``report.md`` is what its ``report.json`` renders to (issue 38: every card identical before
    and after a change of the card's code): a change of wording, number format or layout shows here as a diff."""
    assert markdown(read_json(file)) == (file.parent / "report.md").read_text(encoding="utf-8")


def test_the_data_files_hold_the_sets() -> None:
    assert [r.id for r in sets.ROWS][:4] == ["post-ln", "no-ln", "pre-ln", "peri-ln"]
    assert sets.ROWS[5].model == ("--model.norm_placement", "output", "--model.qk_norm", "true",
                                  "--model.z_loss", "1e-5")
    assert sets.SUPPLEMENT_IDS["long-warmup-6"].rows[0].expected == sets.STABLE and sets.HELDOUT_PREDICTION


def test_every_row_of_both_sets_says_what_its_source_reached() -> None:
    for row in (*sets.ROWS, *sets.HELDOUT):
        assert set(row.reachable) <= set(sets.TIERS) and isinstance(row.reported, bool) and row.reach_note
    by_id = {r.id: r for r in (*sets.ROWS, *sets.HELDOUT)}
    # the readings: the contrast DeepNorm/Post-LN and ReZero's lr 0.1 are not reached; RMSNorm Post-LN implied
    assert not by_id["deepnorm"].scored("quick") and not by_id["rezero"].scored("proxy")
    assert by_id["post-rmsnorm"].reported is False and by_id["no-ln"].scored("quick")
    assert by_id["post-ln-xavier"].model == ("--model.norm_placement", "post", "--model.init", "xavier")


@pytest.mark.parametrize(("text", "said"), [
    ("rows:\n- {id: a, design: d, model: {x: '1'}, outcome: o, source: s, expected: [fail], reported: true, "
     "reach_note: n, reachable: {quick: true}}\n",
     "rows.yaml: rows[0].reachable is {'quick': True}; a mapping of each tier (quick, proxy) to true or false is "
     "allowed"),
    ("rows:\n- {id: a, design: d, model: {x: '1'}, outcome: o, source: s, expected: [fail], reported: 'yes', "
     "reach_note: n, reachable: {quick: true, proxy: false}}\n",
     "rows.yaml: rows[0].reported is 'yes'; true or false is allowed"),
    ("rows:\n- {id: a, design: d, model: {x: '1'}, outcome: o, source: s, expected: [fail], reported: true, "
     "reachable: {quick: true, proxy: false}}\n",
     "rows.yaml: rows[0].reach_note is None; a non-empty string is allowed"),
    ("rows:\n- {id: a, design: d, model: {x: '1'}, outcome: o, source: s, expected: [maybe]}\n",
     "rows.yaml: rows[0].expected is 'maybe'; allowed: pass, warn, fail"),
    ("rows:\n- {id: a, design: d, model: {x: '1'}, outcome: o, expected: [fail]}\n",
     "rows.yaml: rows[0].source is None; a non-empty string is allowed"),
    ("rows:\n- {id: a, design: d, hf: bloom, outcome: o, source: s, expected: [fail]}\n",
     "rows.yaml: rows[0].hf is 'bloom'; allowed: gemma2, llama, olmo2, gpt2"),
    ("rows:\n- {id: a, design: d, outcome: o, source: s, expected: [fail], colour: red}\n",
     "rows.yaml: rows[0] has 'colour'; allowed: id, design, model, hf, outcome, source, expected, reachable, "
     "reported, reach_note"),
    ("rows: []\n", "rows.yaml: rows is []; a non-empty list of rows is allowed"),
])
def test_a_malformed_data_file_is_refused_in_one_line(text, said, tmp_path, monkeypatch) -> None:
    (tmp_path / "rows.yaml").write_text(text)
    monkeypatch.setattr(sets, "HERE", tmp_path)
    with pytest.raises(DataFileError) as info:
        sets.load_rows()
    assert str(info.value) == said


def test_the_check_pages_table_says_what_each_committed_card_says() -> None:
    """docs/check/README.md's table of the five placement cards is written by hand: after issue 39 re-graded the
    cards (mechanisms warn), it still showed Post-LN and the output norm alone FAIL on gradient spread and
    attention, which the same page says cannot happen (a helper probing as a user found it)."""
    page = VALIDATION.parent / "README.md"
    lines = [line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("| [")]
    assert len(lines) == 5
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        card = read_json(page.parent / cells[0].split("(", 1)[1].split("/", 1)[0] / "report.json")
        assert cells[1] == f"**{card['status'].upper()}** ({card['exit_code']})", cells[0]
        statuses = [c["status"].upper().replace("N/A", "n/a") for c in card["criteria"]]
        assert cells[2:2 + len(statuses)] == statuses, cells[0]
