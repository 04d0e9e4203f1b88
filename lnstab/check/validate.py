"""``lnstab check --validate``: every row of :data:`lnstab.check.validation.ROWS` (``--set heldout``: of
:data:`~lnstab.check.validation.HELDOUT`) as a card at the default shape,
graded against the verdict its published outcome implies, and ``docs/check/validation/README.md``.

All rows share one set of stress runs: the Pre-LN and Peri-LN references (identical for every row of one shape) run
once, a row identical to a reference reuses its runs, and every run goes through one worker pool. Each row's card
(``<out>/<row>/report.md``, ``report.json``, ``thresholds.yaml``; no figures, no TensorBoard logs) is what
``lnstab check`` with that row's arguments writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lnstab.check.criteria import CRITERIA, DEFAULT_THRESHOLDS, load_thresholds
from lnstab.check.protocol import plan, run_ladder
from lnstab.check.runner import check_logits, grade, lnstab_version, load_data, machine, public_command, public_path
from lnstab.check.subjects import Subject, context_length, hf_subject, lnstab_subject, parse_value, references
from lnstab.check.validation import (
    DEFAULT_SHAPE,
    HELDOUT,
    HELDOUT_PREDICTION,
    HF_FAMILIES,
    ROWS,
    STABLE,
    SUPPLEMENTS,
    Row,
)
from lnstab.check.validation_notes import HELDOUT_NOTES, NOTES, SUPPLEMENT_NOTES, THRESHOLD_CHANGES, NoteError, render
from lnstab.check.workers import RunPool
from lnstab.errors import LNStabError
from lnstab.rundir import read_json

DEFAULT_OUT = Path("docs/check/validation")
SETS = {"main": ROWS, "heldout": HELDOUT}  # --set: the validation set, the held-out set (its own README)
HELDOUT_DIR = "heldout"  # the held-out set's directory under the main set's
SHAPE_KEYS = ("preset", "n_layer", "n_head", "n_embd", "block_size", "vocab_size")
SHORT = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "n/a": "n/a"}


def pairs(args: tuple[str, ...]) -> dict[str, Any]:
    """``("--model.a", "1", …)`` as ``{"a": 1, …}``."""
    return {k.removeprefix("--model."): parse_value(v) for k, v in zip(args[::2], args[1::2], strict=True)}


def row_subject(row: Row, shape: dict[str, Any], workdir: Path) -> tuple[Subject, list[str]]:
    """The checked subject of ``row`` at ``shape``, and the ``lnstab check`` arguments that make the same card."""
    if row.hf:
        probe, _ = lnstab_subject(shape)
        s = probe.shape
        import transformers

        make_config, model_class, family = HF_FAMILIES[row.hf]
        directory = workdir / row.hf
        config = make_config(s.n_layer, s.n_embd, s.n_head, s.block_size, s.vocab_size)
        transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bars are not the check's
        getattr(transformers, model_class)(config).save_pretrained(directory)
        article = "an" if family[0] in "AEIOU" else "a"
        return hf_subject(str(directory), True), ["--hf", f"<{article} {family} directory of this shape>", "--hf-init"]
    model = {**shape, **pairs(row.model)}
    subject, _ = lnstab_subject(model)
    return subject, model_flags(model)


def model_flags(model: dict[str, Any]) -> list[str]:
    """``{"a": 1, "b": True}`` as ``["--model.a", "1", "--model.b", "true"]``."""
    return [arg for k, v in model.items()
            for arg in (f"--model.{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def prepare_out(out: Path, overwrite: bool, rows: tuple[Row, ...] = ROWS) -> None:
    """An empty ``out``, or one whose earlier validation may be replaced (``--overwrite``)."""
    if out.exists() and not out.is_dir():
        raise LNStabError(f"--out {out} is not allowed; it is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise LNStabError(f"--out {out} already holds a validation; give --overwrite to replace it")
        if not (out / "README.md").is_file():
            raise LNStabError(f"--out {out} is not empty and holds no validation README; refusing to replace it")
        for row in rows:
            shutil.rmtree(out / row.id, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def main(args: argparse.Namespace, model_args: dict[str, Any], argv: list[str]) -> None:
    """Run the validation set; exit status 0 when every row agrees, 1 when one does not."""
    started = time.perf_counter()
    if args.hf or args.factory:
        raise LNStabError("--validate checks its own set of models; --hf and --factory are not used with it")
    bad = [k for k in model_args if k not in SHAPE_KEYS]
    if bad:
        raise LNStabError(f"--model.{bad[0]} is not allowed with --validate; only the shape may change "
                          f"({', '.join(SHAPE_KEYS)})")
    every = SETS[args.set]
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()]
    unknown = [r for r in wanted if r not in {row.id for row in every}]
    if unknown:
        raise LNStabError(f"--rows {unknown[0]} is not allowed; rows of --set {args.set}: "
                          f"{', '.join(r.id for r in every)}")
    rows = [r for r in every if not wanted or r.id in wanted]
    heldout = args.set == "heldout"
    from lnstab.check.cli import make_protocol, worker_counts

    protocol = make_protocol(args, {})
    thresholds = load_thresholds(args.thresholds)
    out = Path(args.out) if args.out else DEFAULT_OUT / HELDOUT_DIR if heldout else DEFAULT_OUT
    shape = {**pairs(DEFAULT_SHAPE), **model_args}
    with tempfile.TemporaryDirectory(prefix="lnstab-validate-") as tmp:
        work = Path(tmp)
        checked = [row_subject(row, shape, work) for row in rows]
        seq_len = context_length(checked[0][0], protocol.seq_len)
        prepare_out(out, args.overwrite, every)
        estimate = len(plan([checked[0][0], *references(checked[0][0], seq_len)], protocol)) * len(rows)
        workers, per_worker = worker_counts(args, estimate)
        with RunPool(workers, per_worker) as pool:
            data, first = load_data(protocol, checked[0][0], seq_len, args.vocab)
            subjects = [first] + [with_protocol_vocab(s, data, seq_len) for s, _ in checked[1:]]
            registry, keys = unique_runs(rows, subjects, seq_len)
            runs = run_ladder(list(registry.values()), protocol, data.tokens, work / "tb",
                              progress=not args.no_progress, pool=pool)
        provenance = {"lnstab": lnstab_version(), "machine": machine(workers, per_worker)}
        cards = []
        for row, subject, (_, card_args) in zip(rows, subjects, checked, strict=True):
            key, ref_keys = keys[row.id]
            card_subjects = [dataclasses.replace(subject, key="checked", same_as=None)] + [
                dataclasses.replace(registry[k], key=name, same_as="checked" if k == key else None)
                for name, k in ref_keys.items()]
            card_runs = {"checked": runs[key], **{name: runs[k] for name, k in ref_keys.items()}}
            spent = sum(r.wall_s for k in {key, *ref_keys.values()} for r in runs[k])
            command = public_command([*card_args, *protocol_args(argv)])
            cards.append(grade(card_subjects[0], card_subjects, card_runs, protocol, thresholds, data, seq_len,
                               out / row.id, command, time.perf_counter() - spent, provenance, figures=False))
    wall = time.perf_counter() - started
    n_runs = sum(len(v) for k, v in runs.items() if k in registry)
    agree = sum(c["status"] in r.expected for r, c in zip(rows, cards, strict=True))
    shown = [*model_flags(model_args), *(["--set", args.set] if heldout else []),
             *(["--rows", ",".join(wanted)] if wanted else []), *protocol_args(argv)]
    summary = {"set": args.set,  # args: no path of this machine
               "args": shlex.split(public_command(shown).removeprefix("lnstab check ")),
               "agree": agree, "rows": {r.id: {"card": c["status"], "expected": list(r.expected)}
                                        for r, c in zip(rows, cards, strict=True)}, "wall_s": round(wall, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    full = not wanted and not model_args and default_protocol(protocol)
    text = readme(rows, cards, thresholds, public_command(["--validate", *argv_without(argv, "--validate")]),
                  wall, n_runs, len(registry), provenance, shape=model_args,
                  supplements=supplement_results(out) if full and not heldout else None,
                  data_text=data_text(protocol), heldout=heldout_result(out / HELDOUT_DIR) if full and not heldout
                  else None, set_name=args.set, notes=full)
    (out / "README.md").write_text(text, encoding="utf-8")
    sys.stdout.write(f"lnstab check --validate{' --set heldout' if heldout else ''}: {agree} of {len(rows)} rows "
                     f"agree with the published outcome ({wall:.0f} s); {out / 'README.md'}\n")
    if agree < len(rows):
        raise SystemExit(1)


def argv_without(argv: list[str], flag: str) -> list[str]:
    return [a for a in argv if a != flag]


def protocol_args(argv: list[str]) -> list[str]:
    """The protocol flags of a ``--validate`` command line (no ``--validate``, ``--overwrite``, ``--rows``,
    ``--set``, ``--out``, ``--model.*``): what a single card of a row needs beside the row's own arguments."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--validate", "--overwrite"):
            continue
        if name in ("--rows", "--set", "--out") or name.startswith("--model."):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def default_protocol(protocol: Any) -> bool:
    """Whether ``protocol`` is the check's default one, whatever its data and accelerator."""
    from lnstab.check.cli import build_parser, make_protocol

    default = make_protocol(build_parser().parse_args([]), {})
    loose = {"data_source": "auto", "data_path": None, "accelerator": "cpu"}
    return dataclasses.replace(protocol, **loose) == dataclasses.replace(default, **loose)


def data_text(protocol: Any) -> str:
    """The data flags of ``protocol`` as a README shows them (a path by :func:`public_path`)."""
    flags = [] if protocol.data_source == "auto" else [f"--data.source {protocol.data_source}"]
    if protocol.data_path:
        flags.append(f"--data.path {shlex.quote(public_path(protocol.data_path))}")
    return " ".join(flags)


def with_protocol_vocab(subject: Subject, data: Any, seq_len: int) -> Subject:
    """``subject`` on the validation's windows: with the protocol vocabulary when that is in use."""
    if data.vocab["mode"] != "protocol":
        return subject
    compact = subject.with_vocab(data.vocab["size"])
    if compact is None:
        raise LNStabError(f"{subject.label} cannot take the protocol vocabulary; give --vocab model")
    check_logits(compact, data.vocab["size"], seq_len)
    return compact


def unique_runs(rows: list[Row], subjects: list[Subject], seq_len: int
                ) -> tuple[dict[str, Subject], dict[str, tuple[str, dict[str, str]]]]:
    """The distinct models to train (a row or reference identical to an earlier one reuses its runs) by run key,
    and per row the keys of its checked model's and its references' runs."""
    registry: dict[str, Subject] = {}
    by_config: dict[Any, str] = {}

    def register(subject: Subject, key: str) -> str:
        ident = repr(subject.config) if subject.config is not None else repr(subject.recipe)
        if ident in by_config:
            return by_config[ident]
        while key in registry:
            key += "'"
        registry[key] = dataclasses.replace(subject, key=key, same_as=None)
        by_config[ident] = key
        return key

    keys = {}
    for row, subject in zip(rows, subjects, strict=True):
        refs = {r.key: register(r, r.key) for r in references(subject, seq_len)}
        keys[row.id] = (register(subject, row.id), refs)
    return registry, keys


def reference_text(cards: list[dict[str, Any]]) -> str:
    """The first card's Pre-LN reference, described."""
    ref = cards[0]["references"].get("pre-ln", {}) if cards else {}
    return ref.get("description", "").split(" (the checked")[0]


def statuses(card: dict[str, Any]) -> dict[str, str]:
    return {r["id"]: r["status"] for r in card["criteria"]}


def deciding(card: dict[str, Any]) -> list[str]:
    """The criteria whose status is the card's verdict (for a warning or a failure)."""
    if card["status"] == "pass":
        return []
    return [r["id"] for r in card["criteria"] if r["status"] == card["status"]]


def history() -> list[str]:
    """``git log`` of the thresholds and the expected verdicts (oldest first), when this is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "log", "--reverse", "--format=%h %ad %s", "--date=short", "--",
                               "lnstab/check/criteria.py", "lnstab/check/validation.py"], cwd=root,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[:160] for line in done.stdout.splitlines()] if done.returncode == 0 else []


def note_text(note: str, cards: dict[str, dict[str, Any]]) -> str:
    """A note rendered from the run's cards; a placeholder they cannot fill is said in its place, so the README of
    a run of minutes is still written (the committed notes are tested against the committed cards)."""
    try:
        return render(note, cards)
    except NoteError as exc:
        return f"(note not rendered: {exc})"


def supplement_results(out: Path) -> dict[str, dict[str, Any] | None]:
    """Each supplement's ``summary.json`` under ``<out>/supplements/<id>/`` (``None`` where it has not been run or
    its summary does not read back), with its rows' cards under ``"cards"`` (row id → ``report.json``; ``None``
    unless every row's reads back), which its note quotes."""
    found: dict[str, dict[str, Any] | None] = {}
    for sup in SUPPLEMENTS:
        where = out / "supplements" / sup.id
        try:
            found[sup.id] = json.loads((where / "summary.json").read_text(encoding="utf-8"))
            cards = {row: read_json(where / row / "report.json") for row in found[sup.id]["rows"]}
        except (OSError, ValueError, KeyError, TypeError):  # a damaged file (lnstab's file errors are ValueErrors)
            found[sup.id] = None
            continue
        found[sup.id]["cards"] = cards if all(isinstance(c, dict) for c in cards.values()) else None
    return found


def verdict_list(summary: dict[str, Any]) -> str:
    """``post-ln FAIL, deepnorm FAIL (disagrees)``: each row of a run's ``summary.json`` with its card's verdict."""
    return ", ".join(f"{row} {SHORT[v['card']]}" + ("" if v["card"] in v["expected"] else " (disagrees)")
                     for row, v in summary["rows"].items())


def supplement_lines(results: dict[str, dict[str, Any] | None], data_arg: str) -> list[str]:
    """The main README's section on the supplements: question, prediction, command and what came out."""
    lines = ["", "## Supplements", "",
             "Re-runs under other arguments, each with its question and prediction committed before it first ran "
             "(`lnstab/check/validation.py`, `SUPPLEMENTS`); the expected verdicts are the rows' own.", ""]
    for sup in SUPPLEMENTS:
        got = results.get(sup.id)
        command = " ".join(["lnstab check --validate", data_arg, *sup.args, "--no-progress",
                            f"--out <out>/supplements/{sup.id}"])
        if got is None:
            outcome = "not run yet"
        else:
            verdicts = verdict_list(got)
            outcome = (f"[{got['agree']} of {len(got['rows'])} rows agree]"
                       f"(supplements/{sup.id}/README.md) ({got['wall_s'] / 60:.1f} min): {verdicts}")
        lines += [f"- **{sup.id}** (`{command}`). {sup.question} Predicted: {sup.prediction} Result: {outcome}."]
        note = SUPPLEMENT_NOTES.get(sup.id)
        if note and got is not None and got.get("cards"):
            lines[-1] += " " + note_text(note, got["cards"])
    return lines


HELDOUT_TEXT = (
    "These designs played no part in fixing the thresholds: every threshold was fixed, and the two changed, on the "
    "main set's rows alone ([README](../README.md)). Rows, expected verdicts and the prediction below were committed "
    "before this set was first run (`lnstab/check/validation.py`, `HELDOUT`), so its agreement is the check's "
    "out-of-sample record; the main set's is in sample.")


HELDOUT_LIMITS = (
    f"Read it with its limits: {sum(r.expected == STABLE for r in HELDOUT)} of its {len(HELDOUT)} outcomes are "
    "\"stable\" (any verdict but FAIL agrees); its one FAIL row's outcome is implied by Xiong et al.'s analysis, not "
    "reported; pre-ln-nobias (its references are built without biases too) and gpt2-hf are Pre-LN built another way, "
    "so they test that the verdict survives the build, not a new design. Its row notes say so.")


def heldout_result(where: Path) -> dict[str, Any] | None:
    """The held-out set's ``summary.json`` under ``where`` (``None`` where it has not been run or does not read back
    as one)."""
    try:
        found = json.loads((where / "summary.json").read_text(encoding="utf-8"))
        return found if found.get("set") == "heldout" and isinstance(found.get("rows"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def heldout_lines(got: dict[str, Any] | None) -> list[str]:
    """The main README's section on the held-out set: what it is, what was predicted, what came out."""
    lines = ["", "## Held-out set", "",
             f"{len(HELDOUT)} designs that played no part in fixing the thresholds, with their expected verdicts and "
             f"a prediction committed before the set first ran (`lnstab check --validate --set heldout`; "
             f"`lnstab/check/validation.py`, `HELDOUT`). Predicted: {HELDOUT_PREDICTION}", ""]
    if got is None:
        return [*lines, "Result: not run yet."]
    return [*lines, f"Result: [{got['agree']} of {len(got['rows'])} rows agree]({HELDOUT_DIR}/README.md) "
                    f"({got['wall_s'] / 60:.1f} min): {verdict_list(got)}. "
                    + constant_text([r for r in HELDOUT if r.id in got["rows"]]) + " " + HELDOUT_LIMITS]


def constant_text(rows: list[Row]) -> str:
    """What a card that always gives one verdict would score on ``rows``: the baseline the check's agreement is to be
    read against (most published outcomes are "stable", which any verdict but FAIL matches)."""
    counts = {v: sum(v in r.expected for r in rows) for v in ("warn", "pass", "fail")}
    best = max(counts, key=counts.get)
    others = ", ".join(f"always {SHORT[v]} {n}" for v, n in counts.items() if v != best)
    return (f"Baseline: a card that always said {SHORT[best]}, whatever the model, would agree on {counts[best]} of "
            f"{len(rows)} rows ({others}); the check's worth is in the rows a constant verdict gets wrong.")


def readme(rows: list[Row], cards: list[dict[str, Any]], thresholds: dict[str, Any], command: str, wall: float,
           n_runs: int, n_models: int, provenance: dict[str, Any], shape: dict[str, Any] | None = None,
           supplements: dict[str, dict[str, Any] | None] | None = None, data_text: str = "",
           heldout: dict[str, Any] | None = None, set_name: str = "main", notes: bool | None = None) -> str:
    """The validation README: agreement, one row per architecture, which criteria decide which rows, thresholds,
    and (for the whole set at the default shape and protocol: ``supplements`` given) the row notes and the
    supplements found under ``<out>/supplements``; another run's rows carry no notes (those explain the default
    run's numbers), its disagreements are explained in the main README's supplement notes. ``set_name`` ``heldout``
    writes the held-out set's README (its prediction, its own row notes); ``heldout`` (that set's summary, for the
    main set's README) adds its section. ``notes``: whether the row notes are shown (default: with
    ``supplements``)."""
    from lnstab.check.report import cell
    from lnstab.check.report import provenance as made_by

    agree = [c["status"] in r.expected for r, c in zip(rows, cards, strict=True)]
    by_row = {r.id: c for r, c in zip(rows, cards, strict=True)}  # what the row notes quote
    strict = sum(a for a, r in zip(agree, rows, strict=True) if len(r.expected) == 1)
    single = sum(len(r.expected) == 1 for r in rows)
    custom = thresholds != load_thresholds(None)
    notes = supplements is not None if notes is None else notes
    row_notes = HELDOUT_NOTES if set_name == "heldout" else NOTES
    proto = cards[0]["protocol_text"] if cards else ""
    lines = [
        "# `lnstab check` against the published record" + (": the held-out set" if set_name == "heldout" else ""),
        "",
        f"Generated by `{command}` in {wall / 60:.1f} min ({n_runs} stress runs of {n_models} distinct models; made by "
        f"{made_by(provenance)}). Every row is a card at "
        + ("the check's default shape" if not shape else
           "the check's default shape but " + ", ".join(f"`--model.{k} {v}`" for k, v in shape.items()))
        + " beside the same Pre-LN and "
        f"Peri-LN references ({reference_text(cards)}); {proto}. Data: {cards[0]['data_text'] if cards else ''}. "
        "A row identical to a reference (Pre-LN, Peri-LN) is graded against itself, so it passes every criterion "
        "where that reference sets the pass band (for Peri-LN: all of them) by construction.",
        "",
        *([HELDOUT_TEXT, "", f"Predicted before the first run: {HELDOUT_PREDICTION}", ""] if set_name == "heldout"
          else []),
        f"**Agreement: {sum(agree)} of {len(rows)} rows ({100 * sum(agree) / max(1, len(rows)):.0f} %"
        + ("; out of sample" if set_name == "heldout" else "; goal ≥ 90 %") + ")** "
        f"— {strict} of the {single} rows whose outcome implies one verdict, {sum(agree) - strict} of the "
        f"{len(rows) - single} reported stable (any verdict but FAIL agrees). Thresholds: "
        + ("**a --thresholds file, not the defaults**." if custom else
           "the defaults of `lnstab/check/criteria.py`, fixed before the set was first run"
           + (f"; {len(THRESHOLD_CHANGES)} changed after that run and every verdict re-run (see Thresholds)."
              if THRESHOLD_CHANGES else " (history below).")),
        "",
        constant_text(rows),
        "",
        "| # | architecture | published outcome (source) | implies | card | agrees | decided by / why |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (row, card, ok) in enumerate(zip(rows, cards, agree, strict=True), 1):
        implies = " or ".join(SHORT[e] for e in row.expected)
        decided = ", ".join(f"`{c}`" for c in deciding(card)) or "every criterion passes"
        note = note_text(row_notes.get(row.id, ""), by_row) if notes else ""
        why = decided + (f"; {note}" if note else "" if ok or not notes else "; not yet explained")
        lines.append(f"| {i} | [{cell(row.design)}]({row.id}/report.md) | {cell(row.outcome)} ({cell(row.source)}) | "
                     f"{implies} | **{SHORT[card['status']]}** | {'yes' if ok else '**no**'} | {cell(why)} |")
    lines += ["", "## Each criterion on each row", "",
              "| row | " + " | ".join(c.id for c in CRITERIA) + " |", "|---|" + "---|" * len(CRITERIA)]
    for row, card in zip(rows, cards, strict=True):
        st = statuses(card)
        lines.append(f"| {row.id} | " + " | ".join(SHORT[st[c.id]] for c in CRITERIA) + " |")
    lines += ["", "Which rows each criterion decides (its status is the card's verdict):", ""]
    for c in CRITERIA:
        decided = {level: [r.id for r, k in zip(rows, cards, strict=True)
                           if k["status"] == level and statuses(k)[c.id] == level] for level in ("fail", "warn")}
        fails, warns = decided["fail"], decided["warn"]
        lines.append(f"- `{c.id}`: fails {', '.join(fails) or 'no row'}; is among the warnings of "
                     f"{', '.join(warns) or 'no row'}")
    lines += ["", "## Thresholds", "",
              "The thresholds and the expected verdicts were committed before the set was run "
              "(`lnstab/check/criteria.py`, `lnstab/check/validation.py`); their history, oldest first:", ""]
    lines += [f"- `{h}`" for h in history()] or ["- (not a git checkout)"]
    lines += ["", "Changes after the first run: " + ("; ".join(THRESHOLD_CHANGES) if THRESHOLD_CHANGES else
                                                     "none; every verdict above is from the thresholds fixed before "
                                                     "it.")]
    if DEFAULT_THRESHOLDS != load_thresholds(None):
        lines.append("(The module's defaults differ from its YAML: this should not happen.)")
    if heldout is not None or set_name == "main" and supplements is not None:
        lines += heldout_lines(heldout)
    if supplements is not None:
        lines += supplement_lines(supplements, data_text)
    lines.append("")
    return "\n".join(lines)
