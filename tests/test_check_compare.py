"""``lnstab check --compare``: two finished cards, or two validation runs, against each other. The fixtures are the
committed validation set (docs/check/validation), copied and changed where a test needs a difference."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from lnstab.check.compare import compare, moved
from lnstab.check.criteria import BY_ID
from lnstab.cli import main

VALIDATION = Path(__file__).resolve().parents[1] / "docs" / "check" / "validation"


def copy_set(where: Path) -> Path:
    summary = json.loads((VALIDATION / "summary.json").read_text())
    where.mkdir()
    shutil.copy(VALIDATION / "summary.json", where / "summary.json")
    for row in summary["rows"]:
        shutil.copytree(VALIDATION / row, where / row)
    return where


def edit(card: Path, change) -> None:
    data = json.loads(card.read_text())
    change(data)
    card.write_text(json.dumps(data))


def criterion(data: dict, cid: str) -> dict:
    return next(c for c in data["criteria"] if c["id"] == cid)


def test_a_set_against_itself_changes_nothing_and_exits_0(tmp_path, capsys) -> None:
    copy = copy_set(tmp_path / "copy")
    rows = json.loads((VALIDATION / "summary.json").read_text())["rows"]
    n_criteria = sum(len(json.loads((VALIDATION / r / "report.json").read_text())["criteria"]) for r in rows)
    main(["check", "--compare", str(VALIDATION), str(copy)])  # no SystemExit: status 0
    out = capsys.readouterr().out
    assert f"**Verdicts: {len(rows)} of {len(rows)} the same**" in out
    assert f"**Criterion statuses: {n_criteria} of {n_criteria} the same.**" in out
    compared = int(out.split("**Measurements: ")[1].split(" compared")[0])
    assert 0 < compared <= n_criteria and f"{compared} within 0.1%" in out and "Largest moves" not in out


def test_a_changed_verdict_status_and_measurement_are_each_reported_and_exit_1(tmp_path) -> None:
    new = copy_set(tmp_path / "new")
    old_pre = json.loads((VALIDATION / "pre-ln" / "report.json").read_text())
    spread = criterion(old_pre, "grad_spread")

    def fail_on_spread(data: dict) -> None:  # Pre-LN's gradient spread doubled and now beyond its fail band
        data["status"] = "fail"
        c = criterion(data, "grad_spread")
        c["measured"], c["status"] = 2 * c["measured"], "fail"

    edit(new / "pre-ln" / "report.json", fail_on_spread)
    edit(new / "peri-ln" / "report.json", lambda d: criterion(d, "loss").update(measured=math.nan))
    text, code = compare(str(VALIDATION), str(new))
    assert code == 1
    assert "| pre-ln | WARN | FAIL |" in text
    n = len(json.loads((VALIDATION / "summary.json").read_text())["rows"])
    assert f"**Verdicts: {n - 1} of {n} the same**" in text
    assert "| pre-ln | `grad_spread` | PASS ×" in text and "| FAIL ×" in text
    largest = text.split("Largest moves:")[1]
    assert "| pre-ln | `grad_spread` |" in largest and "| 50.0% |" in largest
    assert "| peri-ln | `loss` |" in largest and "one side not finite" in largest
    assert "1 finite on one side only" in text
    assert spread["status"] == "pass"  # the fixture's premise: Pre-LN passes on gradient spread


def test_cards_missing_on_one_side_are_named_and_exit_1(tmp_path) -> None:
    new = copy_set(tmp_path / "new")
    summary = json.loads((new / "summary.json").read_text())
    del summary["rows"]["rezero"]
    (new / "summary.json").write_text(json.dumps(summary))
    text, code = compare(str(VALIDATION), str(new))
    n = len(summary["rows"])  # rezero's gone
    assert code == 1 and f"**Verdicts: {n} of {n} the same**; only in OLD: rezero." in text


def test_a_criterion_on_one_side_only_is_named_and_exit_1_and_a_card_without_criteria_is_refused(tmp_path,
                                                                                                  capsys) -> None:
    """A card of an older lnstab without a criterion (or of a newer one with one more) read as '10 of 10 the same',
    exit 0, and a card with an empty criteria list as '0 of 0 the same' (a helper probing as a user found both)."""
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "old")
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "new")
    edit(tmp_path / "new" / "report.json", lambda d: d.update(criteria=[c for c in d["criteria"]
                                                                        if c["id"] != "divergence"]))
    text, code = compare(str(tmp_path / "old"), str(tmp_path / "new"))
    n = len(BY_ID) - 1
    assert code == 1 and f"**Criterion statuses: {n} of {n} the same**; `divergence` of card only in OLD." in text
    edit(tmp_path / "new" / "report.json", lambda d: d.update(criteria=[]))
    with pytest.raises(SystemExit) as info:
        main(["check", "--compare", str(tmp_path / "old"), str(tmp_path / "new")])
    assert info.value.code == 2 and "report.json is not lnstab check's (no criteria)" in capsys.readouterr().err


def test_a_non_finite_measurement_as_cards_store_it_is_read_back_as_a_number(tmp_path) -> None:
    # report.json stores NaN as {"$float": "nan"} (strict JSON); Pre-LN's bound is one (n/a: no output norms)
    assert criterion(json.loads((VALIDATION / "pre-ln" / "report.json").read_text()), "bound")["measured"] == {
        "$float": "nan"}
    shutil.copytree(VALIDATION / "pre-ln", tmp_path / "a")
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "b")  # its bound is measured: a number on one side only
    text, code = compare(str(tmp_path / "a"), str(tmp_path / "b"))  # before: a TypeError on the tagged object
    assert code == 0  # both cards warn
    assert "| card | `bound` | n/a " in text and "one side not finite" in text


def test_two_single_cards_compare(tmp_path) -> None:
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "a")
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "b")
    edit(tmp_path / "b" / "report.json", lambda d: d["provenance"]["machine"].update(cpu="Another CPU", isa="AVX2"))
    text, code = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and "1 card in common" in text and "**Verdicts: 1 of 1 the same**" in text
    assert "NEW `" in text and "Another CPU (2 cores, AVX2, " in text


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("empty", "is not allowed: give a card directory (report.json) or a validation directory (summary.json)"),
        ("interrupted", "(a check a signal ended there, with no card: see its interrupted.txt)"),
        ("failed", "(a check that failed there, with no card: see its error.txt)"),
        ("garbage", "report.json is damaged: not valid JSON at line 1"),
        ("foreign", "report.json is not lnstab check's (no criteria)"),
        ("row-missing", "row deepnorm of its summary.json has no deepnorm/report.json"),
        ("row-path", "its summary.json names row '../olmo2', which is not a row id"),
        ("card-vs-set", "is a card and"),
        ("model-arg", "--model.n_layer is not used with --compare"),
        ("other-arg", "--steps is not used with --compare"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, expected) -> None:
    side = tmp_path / "side"
    side.mkdir()
    old = str(VALIDATION)
    extra: list[str] = []
    if setup == "interrupted":  # what lnstab check leaves where a signal ended it, or where it failed
        (side / "interrupted.txt").write_text("SIGTERM ended this check after 0 of 6 stress runs finished\n")
        (side / "tb").mkdir()
    elif setup == "failed":
        (side / "error.txt").write_text("Traceback ...\n")
    elif setup == "garbage":
        (side / "report.json").write_text("{not json")
    elif setup == "foreign":
        (side / "report.json").write_text('{"status": "pass"}')
    elif setup == "row-missing":
        side = copy_set(tmp_path / "set")
        shutil.rmtree(side / "deepnorm")
    elif setup == "row-path":
        side = copy_set(tmp_path / "set")
        summary = json.loads((side / "summary.json").read_text())
        summary["rows"]["../olmo2"] = summary["rows"].pop("olmo2")
        (side / "summary.json").write_text(json.dumps(summary))
    elif setup == "card-vs-set":
        old = str(VALIDATION / "olmo2")
        side = VALIDATION
    elif setup == "model-arg":
        extra = ["--model.n_layer", "8"]
    elif setup == "other-arg":
        extra = ["--steps", "6"]
    with pytest.raises(SystemExit) as info:
        main(["check", "--compare", old, str(side if setup not in ("model-arg", "other-arg") else VALIDATION), *extra])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("lnstab: error: ") and expected in err and "\n" not in err, err


def test_moved_is_relative_and_says_what_cannot_be_compared() -> None:
    assert moved(2.0, 1.0) == 0.5 and moved(-1.0, 1.0) == 2.0 and moved(0.0, 0.0) == 0.0
    assert moved(None, None) == 0.0 and moved(1.0, None) == math.inf
    assert moved(math.inf, math.inf) == 0.0 and moved(math.nan, math.nan) == 0.0
    assert moved(math.inf, 1.0) == math.inf and moved(math.nan, 1.0) == math.inf
    assert moved("n/a", 1.0) is None and moved(True, 1.0) is None


def test_a_row_made_of_another_model_protocol_or_data_is_said_to_be_another_check(tmp_path) -> None:
    new = copy_set(tmp_path / "new")
    edit(new / "olmo2" / "report.json",
         lambda d: d["model"].update(description=d["model"]["description"].replace("z_loss 1e-05", "z_loss 0.0001")))
    edit(new / "rezero" / "report.json",
         lambda d: d.update(protocol_text=d["protocol_text"].replace("30 steps", "60 steps")))
    text, code = compare(str(VALIDATION), str(new))
    assert code == 0  # the verdicts are the same; the report says the check is not
    table = text.split("**Not the same check**")[1].split("**Criterion statuses")[0]
    assert "| olmo2 | model | checked (output" in table and "z_loss 0.0001" in table
    assert "| rezero | protocol | 18 stress runs" in table and "60 steps" in table
    assert table.count("\n| ") == 3  # the header and the two rows: nothing else differs
    same, _ = compare(str(VALIDATION), str(copy_set(tmp_path / "same")))
    assert "Not the same check" not in same


MALFORMED = {  # what is changed in NEW's olmo2 card -> what the one line says
    "status-list": (lambda d: d.update(status=["pass"]), "status is ['pass']; it must be a string"),
    "provenance-string": (lambda d: d.update(provenance="a laptop"), "provenance is 'a laptop'; it must be an object"),
    "model-string": (lambda d: d.update(model="gpt"), "model is 'gpt'; it must be an object or null"),
    "machine-string": (lambda d: d["provenance"].update(machine="x86"), "provenance.machine is 'x86'; it must be an "
                       "object"),
    "bf16-list": (lambda d: d["provenance"]["machine"].update(native_bf16=[1]), "provenance.machine.native_bf16 is "
                  "[1]; it must be true, false or null"),
    "criterion-list": (lambda d: d["criteria"].append([1, 2]), "is [1, 2]; it must be an object"),
    "measured-string": (lambda d: criterion(d, "loss").update(measured="4.2"), ".measured is '4.2'; it must be a "
                        "number or null"),
    "criterion-id": (lambda d: d["criteria"][0].update(id={"a": 1}), "criteria[0].id is {'a': 1}; it must be a "
                     "string"),
    # taken before: shown as the card's verdict 'maybe' (exit 1), or the second row of an id read as the first's
    "status-word": (lambda d: d.update(status="maybe"), "status is 'maybe'; it must be one of pass, warn, fail"),
    "criterion-status-word": (lambda d: criterion(d, "loss").update(status="ok"), ".status is 'ok'; it must be one "
                              "of pass, warn, fail, n/a or null"),
    "criterion-twice": (lambda d: d["criteria"].append(dict(d["criteria"][0])), "; it must be an id no other "
                        "criterion of the card has"),
}


@pytest.mark.parametrize("case", [*MALFORMED, "400-digit measurement"])
def test_a_malformed_card_is_one_line_and_exit_2_never_1(case, tmp_path, capsys) -> None:
    """Exit 1 is the gate's "a verdict changed": a card compare cannot read must never exit with it (before: each
    of these was a traceback, exit 1)."""
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "old")
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "new")
    card = tmp_path / "new" / "report.json"
    if case == "400-digit measurement":
        data = json.loads(card.read_text())
        criterion(data, "loss")["measured"] = 0.0
        card.write_text(json.dumps(data).replace('"measured": 0.0', '"measured": 1' + "0" * 399, 1))
        said = f"{card} is damaged: holds a number of 400 characters"
    else:
        change, said = MALFORMED[case]
        edit(card, change)
    for old, new in ((tmp_path / "old", tmp_path / "new"), (tmp_path / "new", tmp_path / "old")):
        with pytest.raises(SystemExit) as info:
            main(["check", "--compare", str(old), str(new)])
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert info.value.code == 2 and err.startswith("lnstab: error: ") and "\n" not in err, err
        assert said in err and captured.out == "", err
        if case != "400-digit measurement":
            assert f"--compare {tmp_path / 'new'}: {card} is not a card lnstab check writes: " in err, err


def test_a_measurement_too_large_for_its_units_is_shown_as_a_number(tmp_path) -> None:
    """A growth exponent of 1e299 is a number, but not one its factor (e^x) can show: the report shows it as it is
    (before: OverflowError, exit 1)."""
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "a")
    shutil.copytree(VALIDATION / "olmo2", tmp_path / "b")
    grow = next(c["id"] for c in json.loads((tmp_path / "a" / "report.json").read_text())["criteria"]
                if BY_ID[c["id"]].factor_base and isinstance(c.get("measured"), float))
    edit(tmp_path / "b" / "report.json", lambda d: criterion(d, grow).update(measured=1e299))
    text, code = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and f"| card | `{grow}` |" in text and "| 1e+299 |" in text, text


def test_a_comparison_that_fails_is_exit_3_never_1(tmp_path, capsys, monkeypatch) -> None:
    """Whatever else goes wrong inside the comparison is one line and exit 3 ("it could not be made"), never 1."""
    import lnstab.check.compare as compare_module

    def broken(old: str, new: str) -> tuple[str, int]:
        raise KeyError("criteria")

    monkeypatch.setattr(compare_module, "compare", broken)
    with pytest.raises(SystemExit) as info:
        main(["check", "--compare", str(VALIDATION), str(VALIDATION)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 3 and "\n" not in err and "--compare failed: KeyError: 'criteria'" in err, err


def test_check_help_names_the_exit_statuses_of_compare(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--compare: 0 the same verdicts on the same cards, 1 not, 2 a usage error or a malformed card, 3 the " \
           "comparison failed" in text
