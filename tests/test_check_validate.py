"""``lnstab check --validate`` at a tiny shape (the machinery, not the verdicts: those need the default shape), the
validation set's well-formedness, and its refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from support.check import TINY

from lnstab.check.options import build_parser, make_protocol, split_model_args
from lnstab.check.subjects import lnstab_subject
from lnstab.check.validation import (
    DEFAULT_SHAPE,
    HELDOUT,
    HELDOUT_PREDICTION,
    HF_FAMILIES,
    ROWS,
    SUPPLEMENT_IDS,
    SUPPLEMENTS,
    Supplement,
    supplement_rows,
)
from lnstab.check.validation.readme import (
    constant_text,
    heldout_result,
    heldout_section,
    supplement_results,
    supplement_section,
)
from lnstab.check.validation.run import default_protocol, pairs, prepare_out, protocol_args, replace_cards, unique_runs
from lnstab.cli import main
from lnstab.errors import LNStabError

SHAPE = ["--model.preset", "tiny", "--model.vocab_size", "128", "--model.block_size", "32"]
STATUSES = {"pass", "warn", "fail"}
VALIDATION = Path(__file__).resolve().parents[1] / "docs" / "check" / "validation"


def test_the_validation_set_is_well_formed() -> None:
    assert len(ROWS) >= 12 and len({r.id for r in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row.outcome and row.source and row.design and set(row.expected) <= STATUSES and row.expected
        if row.hf is None:  # every lnstab row is a valid GPTModule configuration at the default shape
            subject, _ = lnstab_subject({**pairs(DEFAULT_SHAPE), **pairs(row.model)})
            assert (subject.config.n_layer, subject.config.n_embd, subject.config.block_size) == (4, 128, 128)
    implied = {r.id: r.expected for r in ROWS}
    assert implied["post-ln"] == implied["no-ln"] == ("fail",) and implied["peri-ln"] == ("pass",)
    assert implied["pre-ln"] == ("warn",)


def test_the_heldout_set_is_well_formed_and_apart_from_the_main_set() -> None:
    assert len(HELDOUT) >= 8 and len({r.id for r in HELDOUT}) == len(HELDOUT)
    assert not {r.id for r in HELDOUT} & {r.id for r in ROWS}  # held out: no design graded twice
    main_designs = {r.model for r in ROWS if r.hf is None}
    for row in HELDOUT:
        assert row.outcome and row.source and row.design and set(row.expected) <= STATUSES and row.expected
        if row.hf is None:
            assert row.model not in main_designs, row.id
            subject, _ = lnstab_subject({**pairs(DEFAULT_SHAPE), **pairs(row.model)})
            assert (subject.config.n_layer, subject.config.n_embd, subject.config.block_size) == (4, 128, 128)
        else:
            assert row.hf in HF_FAMILIES and row.hf != "gemma2"  # Gemma 2 is the main set's
    assert [r.id for r in HELDOUT if r.expected == ("fail",)] == ["post-rmsnorm"] and HELDOUT_PREDICTION
    assert {"pre-ln-nobias", "gpt2-hf"} <= {r.id for r in HELDOUT}  # what HELDOUT_LIMITS says of the set


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_each_hf_family_builds_at_a_shape_with_its_norms_located(family, tmp_path) -> None:
    import transformers

    from lnstab.check.subjects import hf_subject

    make_config, model_class, _ = HF_FAMILIES[family]
    config = make_config(2, 32, 2, 16, 64)
    getattr(transformers, model_class)(config).save_pretrained(tmp_path / family)
    subject = hf_subject(str(tmp_path / family), True)
    model = subject.build()
    assert config.model_type == family and model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 64)
    assert len(model.output_norms()) == (2 if family in ("gemma2", "olmo2") else 0)  # Theorem 4's updates
    assert subject.sites.attention  # q and k found for the attention-logit instrument


def test_the_constant_verdict_baseline_counts_the_rows_each_verdict_matches() -> None:
    rows = [r for r in ROWS if r.id in ("post-ln", "pre-ln", "peri-ln", "olmo2", "deepnorm")]
    # expected: fail; warn; pass; pass or warn; pass or warn -> always WARN 3, always PASS 3, always FAIL 1
    text = constant_text(rows)
    assert text.startswith("Baseline: a card that always said WARN, whatever the model, would agree on 3 of 5 rows")
    assert "(always PASS 3, always FAIL 1)" in text
    fails = [r for r in ROWS if r.id in ("post-ln", "no-ln")]
    assert "always said FAIL, whatever the model, would agree on 2 of 2 rows" in constant_text(fails)


def test_rows_identical_to_a_reference_reuse_its_runs() -> None:
    rows = [r for r in ROWS if r.id in ("pre-ln", "peri-ln", "olmo2")]
    subjects = [lnstab_subject({**pairs(tuple(SHAPE)), **pairs(r.model)})[0] for r in rows]
    registry, keys = unique_runs(rows, subjects, 16)
    assert sorted(registry) == ["olmo2", "peri-ln", "pre-ln"]  # three models, not five
    assert keys["pre-ln"] == ("pre-ln", {"pre-ln": "pre-ln", "peri-ln": "peri-ln"})
    assert keys["olmo2"][0] == "olmo2" and registry["olmo2"].config.qk_norm
    assert not registry["pre-ln"].config.qk_norm and registry["pre-ln"].config.z_loss == 0  # plain references


def test_protocol_args_keep_only_the_protocol() -> None:
    argv = ["--validate", "--rows", "a,b", "--out=x", "--model.preset", "tiny", "--steps", "6", "--overwrite"]
    assert protocol_args(argv) == ["--steps", "6"]


def test_validate_writes_a_card_per_row_and_the_readme(tmp_path, capsys) -> None:
    out = tmp_path / "validation"
    code = 0
    (tmp_path / "same.yaml").write_text("{}\n")  # the default thresholds, named by an absolute path
    try:  # at this size a row may disagree: exit 1 then, never a crash
        main(["check", "--validate", *SHAPE, *TINY, "--lrs", "1e-2,1e-1", "--rows", "pre-ln,peri-ln,olmo2,gemma2-hf",
              "--thresholds", str(tmp_path / "same.yaml"),
              "--out", str(out)])
    except SystemExit as exc:
        code = exc.code
    printed = capsys.readouterr().out
    agree = int(printed.split(": ")[1].split(" of ")[0])
    assert code == (0 if agree == 4 else 1) and "of 4 rows agree" in printed
    text = (out / "README.md").read_text()
    assert f"**Agreement over all rows: {agree} of 4 rows" in text and "stress runs of 4 distinct models" in text
    # another shape than a tier's (--model.preset tiny): no tier recorded, so no headline over reachable rows
    assert "**Agreement over the rows whose source reached" not in text
    for row in ("pre-ln", "peri-ln", "olmo2", "gemma2-hf"):
        report = json.loads((out / row / "report.json").read_text())
        assert f"]({row}/report.md)" in text and report["status"] in STATUSES
        assert str(tmp_path) not in (out / row / "report.json").read_text()  # no path of this machine
    pre = json.loads((out / "pre-ln" / "report.json").read_text())
    assert pre["references"]["pre-ln"]["same_as"] == "checked"  # the reference itself: its runs are reused
    gemma = json.loads((out / "gemma2-hf" / "report.json").read_text())
    assert {r["id"]: r for r in gemma["criteria"]}["bound"]["status"] == "pass"  # Theorem 4 on Gemma 2
    assert not (out / "tb").exists() and "--validate" in text
    summary = json.loads((out / "summary.json").read_text())  # what the main README reads of a supplement
    assert summary["agree"] == agree and summary["args"][:2] == ["--model.preset", "tiny"]
    assert summary["rows"]["olmo2"]["expected"] == ["pass", "warn"] and "--rows" in summary["args"]
    assert "tier" not in summary
    assert {v["card"] for v in summary["rows"].values()} <= STATUSES and "## Supplements" not in text
    assert str(tmp_path) not in (out / "summary.json").read_text()
    assert "the check's default shape but `--model.preset tiny`" in text  # not "the default shape"
    with pytest.raises(SystemExit) as info:  # an earlier validation is replaced only when asked
        main(["check", "--validate", *SHAPE, *TINY, "--rows", "pre-ln", "--out", str(out)])
    assert info.value.code == 2 and "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["--hf", "x"], "--hf and --factory are not used"),
    (["--model.norm_placement", "post"], "--model.norm_placement is not allowed with --validate"),
    (["--rows", "nope"], "--rows nope is not allowed"),
    (["--no-reference"], "--no-reference is not used with --validate"),
    (["--name", "mine"], "--name is not used with --validate"),
    (["--head-pattern", "head$"], "--head-pattern is not used with --validate"),
])
def test_validate_refuses_in_one_line(args, said, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--validate", *TINY, *args, "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and said in err and "\n" not in err, err


def test_every_supplement_is_a_valid_validate_command_on_known_rows() -> None:
    ids = {r.id for r in ROWS}
    assert len({s.id for s in SUPPLEMENTS}) == len(SUPPLEMENTS) >= 2
    for sup in SUPPLEMENTS:
        model_args, rest = split_model_args(list(sup.args))
        args = build_parser().parse_args(rest)
        assert set(model_args) <= {"n_layer", "n_head", "n_embd", "block_size", "preset", "vocab_size"}
        assert set((args.rows or ",".join(ids)).split(",")) <= ids and sup.question and sup.prediction
        assert model_args or not default_protocol(make_protocol(args, {}))  # each changes something


def test_default_protocol_ignores_the_data_and_sees_any_other_flag() -> None:
    parse = build_parser().parse_args
    assert default_protocol(make_protocol(parse(["--data.path", "x.jsonl", "--accelerator", "cpu"]), {}))
    for flag in (["--seeds", "2,3"], ["--lrs", "1e-3"], ["--steps", "12"], ["--warmup-steps", "0"]):
        assert not default_protocol(make_protocol(parse(flag), {})), flag


def test_the_main_readme_reports_each_supplement_from_its_summary(tmp_path) -> None:
    first, second = SUPPLEMENTS[0], SUPPLEMENTS[1]
    (tmp_path / "supplements" / first.id).mkdir(parents=True)
    (tmp_path / "supplements" / first.id / "summary.json").write_text(json.dumps(
        {"agree": 1, "wall_s": 90.0, "args": list(first.args),
         "rows": {"post-ln": {"card": "fail", "expected": ["fail"]},
                  "deepnorm": {"card": "fail", "expected": ["pass", "warn"]}}}))
    (tmp_path / "supplements" / second.id).mkdir(parents=True)
    (tmp_path / "supplements" / second.id / "summary.json").write_text("{not json")  # damaged: not reported
    found = supplement_results(tmp_path)
    assert found[first.id]["agree"] == 1 and found[second.id] is None
    text = supplement_section(found, "--data.path owt.jsonl.gz")
    assert f"[1 of 2 rows agree](supplements/{first.id}/README.md) (1.5 min)" in text
    assert "post-ln FAIL, deepnorm FAIL (disagrees)" in text and first.prediction in text
    assert f"`lnstab check --validate --data.path owt.jsonl.gz --supplement {first.id} --no-progress`" in text
    assert f"its arguments `{' '.join(first.args)}`" in text
    assert f"**{second.id}**" in text and "Result: not run yet." in text
    own = next(s for s in SUPPLEMENTS if s.rows)  # a supplement whose protocol implies another outcome says so
    row = own.rows[0]
    assert f"Expected here for {row.id} ({row.design}): PASS or WARN: {row.outcome} ({row.source})." in text


def test_a_supplements_own_rows_replace_the_sets_for_its_protocol_only() -> None:
    main_rows = {r.id: r for r in ROWS}
    for sup in (s for s in SUPPLEMENTS if s.rows):
        named = (build_parser().parse_args(split_model_args(list(sup.args))[1]).rows or "").split(",")
        for row in sup.rows:  # the same model, in the supplement's rows, another outcome with its own source
            base = main_rows[row.id]
            assert row.model == base.model and row.hf == base.hf and row.id in named
            assert row.expected != base.expected and set(row.expected) <= STATUSES
            assert row.outcome != base.outcome and row.source and row.design != base.design
        replaced = supplement_rows(sup, ROWS)
        assert [r.id for r in replaced] == [r.id for r in ROWS]
        assert {r.id for r in replaced if r not in ROWS} == {r.id for r in sup.rows}
    assert supplement_rows(None, ROWS) == ROWS


@pytest.mark.parametrize(("args", "said"), [
    (["--validate", "--supplement", "nope"], "--supplement nope is not allowed; supplements: depth16,"),
    (["--supplement", "depth16"], "--supplement is for --validate"),
    (["--validate", "--set", "heldout", "--supplement", "depth16"], "not with --set heldout"),
    (["--validate", "--supplement", "depth16", "--rows", "post-ln"], "--rows is not allowed with it"),
    (["--validate", "--supplement", "depth16", "--model.n_layer=8"], "--model.n_layer is not allowed with it"),
])
def test_supplement_refusals_are_one_line(args, said, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", *args, "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and said in err and "\n" not in err, err
    assert not (tmp_path / "v").exists()


def test_validate_supplement_runs_its_rows_with_its_own_expected_verdicts(tmp_path, capsys, monkeypatch) -> None:
    """``--supplement ID`` adds the supplement's arguments, grades its own rows by the outcome it names for its
    protocol (the others by their own) and writes under ``docs/check/validation/supplements/ID`` by default."""
    post = next(r for r in ROWS if r.id == "post-ln")
    sup = Supplement("tiny-sup", ("--rows", "pre-ln,post-ln", "--lrs", "1e-2"), "Does it plumb?", "It does.",
                     rows=(dataclasses.replace(post, design="Post-LN here", expected=("pass", "warn", "fail")),))
    monkeypatch.setitem(SUPPLEMENT_IDS, sup.id, sup)
    monkeypatch.chdir(tmp_path)
    code = 0
    try:  # pre-ln keeps its own expected WARN, which a tiny card may miss: exit 1 then, never a crash
        main(["check", "--validate", *SHAPE, *TINY, "--supplement", sup.id])
    except SystemExit as exc:
        code = exc.code
    out = tmp_path / "docs" / "check" / "validation" / "supplements" / sup.id
    summary = json.loads((out / "summary.json").read_text())
    printed = capsys.readouterr().out
    assert f"--validate --supplement {sup.id}: " in printed and summary["supplement"] == sup.id
    assert summary["rows"]["post-ln"]["expected"] == ["pass", "warn", "fail"]  # the supplement's own
    assert summary["rows"]["pre-ln"]["expected"] == ["warn"]
    assert list(summary["rows"]) == ["post-ln", "pre-ln"]  # the set's order
    assert code == (0 if summary["agree"] == 2 else 1) and "--lrs" in summary["args"]
    text = (out / "README.md").read_text()
    assert "Supplement **tiny-sup**" in text and "Does it plumb? Predicted before the first run: It does." in text
    assert "Post-LN here" in text and f"--supplement {sup.id}" in text and "--lrs 1e-2" not in text.split("\n")[2]
    report = json.loads((out / "post-ln" / "report.json").read_text())
    assert "--lrs 1e-2" in report["command"]  # a row's own card names the full protocol


def test_the_heldout_set_runs_apart_and_the_main_readme_reports_it(tmp_path, capsys) -> None:
    out = tmp_path / "heldout"
    code = 0
    try:  # at this size a row may disagree: exit 1 then, never a crash
        main(["check", "--validate", "--set", "heldout", *SHAPE, *TINY, "--lrs", "1e-2,1e-1",
              "--rows", "olmo2-hf,post-rmsnorm", "--out", str(out)])
    except SystemExit as exc:
        code = exc.code
    printed = capsys.readouterr().out
    agree = int(printed.split(": ")[1].split(" of ")[0])
    assert code == (0 if agree == 2 else 1) and "--set heldout: " in printed and "of 2 rows agree" in printed
    text = (out / "README.md").read_text()
    assert text.startswith("# `lnstab check` against the published record: the held-out set")
    assert HELDOUT_PREDICTION in text and "out of sample" in text and "## Held-out set" not in text
    assert "Baseline: a card that always said" in text
    olmo = json.loads((out / "olmo2-hf" / "report.json").read_text())
    assert {r["id"]: r for r in olmo["criteria"]}["bound"]["status"] != "n/a"  # Theorem 4 on OLMo 2's output norms
    summary = heldout_result(out)
    assert summary["set"] == "heldout" and summary["agree"] == agree and "--set" in summary["args"]
    assert set(summary["rows"]) == {"olmo2-hf", "post-rmsnorm"}
    section = heldout_section(summary)
    assert f"[{agree} of 2 rows agree](heldout/README.md)" in section and HELDOUT_PREDICTION in section
    assert "would agree on 1 of 2 rows" in section  # the baseline of these two rows: one FAIL, one PASS or WARN
    assert "Result: not run yet." in heldout_section(None)
    (out / "summary.json").write_text(json.dumps({**summary, "set": "main"}))  # a main set's summary: not this one
    assert heldout_result(out) is None and heldout_result(tmp_path / "nowhere") is None
    with pytest.raises(SystemExit) as info:
        main(["check", "--validate", "--set", "heldout", *TINY, "--rows", "pre-ln", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--rows pre-ln is not allowed; rows of --set heldout: pre-rmsnorm" in err


def card_text(tag: str) -> str:
    """A card's report.json as lnstab check writes one (its status and criteria), told apart by ``tag``."""
    return json.dumps({"schema": 1, "status": "pass", "criteria": [], "name": tag})


def test_overwriting_one_set_keeps_the_other_and_the_supplements(tmp_path) -> None:
    out, stage = tmp_path / "validation", tmp_path / "validation" / ".incoming"
    for part in ("README.md", "post-ln/report.json", "no-ln/report.json", "heldout/README.md",
                 "heldout/llama-hf/report.json", "supplements/no-clip/summary.json", ".incoming/post-ln/report.json"):
        (out / part).parent.mkdir(parents=True, exist_ok=True)
        (out / part).write_text(card_text("new" if part.startswith(".incoming") else "old"))
    replace_cards(out, stage, [r for r in ROWS if r.id == "post-ln"], {"README.md": "new readme"})
    assert (out / "post-ln" / "report.json").read_text() == card_text("new")
    assert (out / "no-ln" / "report.json").read_text() == card_text("old")  # a row not run keeps its card
    assert (out / "README.md").read_text() == "new readme" and (out / "supplements" / "no-clip").is_dir()
    assert (out / "heldout" / "llama-hf" / "report.json").read_text() == card_text("old")
    (stage / "gpt2-hf").mkdir(parents=True)
    replace_cards(out / "heldout", stage, [r for r in HELDOUT if r.id == "gpt2-hf"], {})
    assert (out / "heldout" / "llama-hf").is_dir() and (out / "heldout" / "gpt2-hf").is_dir()
    assert (out / "post-ln" / "report.json").read_text() == card_text("new")
    (out / ".incoming-x1y2" / "post-ln").mkdir(parents=True)  # what a validation killed before its swap leaves
    prepare_out(out, True)
    assert not list(out.glob(".incoming-*")) and (out / "post-ln" / "report.json").read_text() == card_text("new")


@pytest.mark.parametrize("foreign", ["notes", "link", "file", "not-a-card"])
def test_overwrite_never_removes_what_is_not_a_card(foreign, tmp_path, capsys) -> None:
    """A folder of the user's named like a row (notes in it, a link, a file, a JSON that is no card) is refused in
    one line before anything trains, and stays as it was; the other rows' cards stay too."""
    out = tmp_path / "validation"
    (out / "peri-ln").mkdir(parents=True)
    (out / "README.md").write_text("earlier validation\n")
    (out / "peri-ln" / "report.json").write_text(card_text("peri"))  # a row this run does not touch
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("my notes\n")
    target = out / "pre-ln"
    if foreign == "notes":
        target.mkdir()
        (target / "notes.md").write_text("my notes\n")
    elif foreign == "link":
        target.symlink_to(mine, target_is_directory=True)
    elif foreign == "file":
        target.write_text("my notes\n")
    else:
        target.mkdir()
        (target / "report.json").write_text('{"notes": "mine"}')
    before = {p: p.read_bytes() for p in [*out.rglob("*"), *mine.rglob("*")] if p.is_file()}
    with pytest.raises(SystemExit) as info:
        main(["check", "--validate", *SHAPE, *TINY, "--rows", "pre-ln", "--overwrite", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err
    assert f"--overwrite is not allowed: {target} is " in err and "not a card lnstab check wrote" in err, err
    assert {p: p.read_bytes() for p in [*out.rglob("*"), *mine.rglob("*")] if p.is_file()} == before
    assert not list(out.glob(".incoming-*"))
    stage = tmp_path / "stage"
    (stage / "pre-ln").mkdir(parents=True)  # the swap itself refuses too (a folder made while the runs trained)
    with pytest.raises(LNStabError, match="not a card lnstab check wrote"):
        replace_cards(out, stage, [r for r in ROWS if r.id == "pre-ln"], {"README.md": "new"})
    assert {p: p.read_bytes() for p in [*out.rglob("*"), *mine.rglob("*")] if p.is_file()} == before


def test_overwrite_replaces_an_earlier_card_or_an_empty_folder(tmp_path) -> None:
    out, stage = tmp_path / "validation", tmp_path / "stage"
    (out / "pre-ln").mkdir(parents=True)
    (out / "peri-ln").mkdir()
    (out / "README.md").write_text("earlier validation\n")
    (out / "pre-ln" / "report.json").write_text(card_text("old"))
    prepare_out(out, True, [r for r in ROWS if r.id in ("pre-ln", "peri-ln")])  # a card, an empty folder: allowed
    for row in ("pre-ln", "peri-ln"):
        (stage / row).mkdir(parents=True)
        (stage / row / "report.json").write_text(card_text(f"new {row}"))
    replace_cards(out, stage, [r for r in ROWS if r.id in ("pre-ln", "peri-ln")], {})
    assert [(out / row / "report.json").read_text() for row in ("pre-ln", "peri-ln")] == [
        card_text("new pre-ln"), card_text("new peri-ln")]
