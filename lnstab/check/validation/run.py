"""``lnstab check --validate``: every row of ``rows.yaml`` (``--set heldout``: of ``heldout.yaml``) as a card at the
default shape, graded against the verdict its published outcome implies, its run record (``summary.json``) and
``docs/check/validation/README.md`` rendered from that record (:mod:`lnstab.check.validation.readme`). Every run goes
through one worker pool, each distinct model (a reference, a row identical to one) once (:func:`unique_runs`); each
row's card (``<out>/<row>/report.md``, ``report.json``, ``thresholds.yaml``; no figures, no TensorBoard logs) is what
``lnstab check`` with that row's arguments writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lnstab.check.hf import progress_bars_off
from lnstab.check.options import FACTORY_OPTIONS, build_parser, make_protocol, pairs, tier_thresholds, worker_counts
from lnstab.check.protocol import Protocol, plan, run_ladder, tiers
from lnstab.check.runner import check_model, grade, load_data, provenance, public_command, public_path
from lnstab.check.signals import Interrupted, deferred
from lnstab.check.subjects import Subject, context_length, hf_subject, lnstab_subject, references
from lnstab.check.validation.families import HF_FAMILIES
from lnstab.check.validation.readme import HELDOUT_DIR, SETS, history, readme
from lnstab.check.validation.sets import DEFAULT_SHAPE, Row, Supplement, model_flags, supplement_rows
from lnstab.check.workers import RunPool
from lnstab.errors import LNStabError
from lnstab.rundir import atomic_write_text, check_writable, read_json

DEFAULT_OUT = Path("docs/check/validation")
STAGE_PREFIX = ".incoming-"  # where the new cards wait, inside --out, until they replace the earlier ones
SHAPE_KEYS = ("preset", "n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def row_subject(row: Row, shape: dict[str, Any], workdir: Path) -> tuple[Subject, list[str]]:
    """The checked subject of ``row`` at ``shape``, and the ``lnstab check`` arguments that make the same card."""
    if row.hf:
        s = lnstab_subject(shape)[0].shape
        import transformers

        make_config, model_class, family = HF_FAMILIES[row.hf]
        directory = workdir / row.hf
        config = make_config(s.n_layer, s.n_embd, s.n_head, s.block_size, s.vocab_size)
        with progress_bars_off():  # its "Writing model shards" bars are not the check's
            getattr(transformers, model_class)(config).save_pretrained(directory)
        article = "an" if family[0] in "AEIOU" else "a"
        return hf_subject(str(directory), True), ["--hf", f"<{article} {family} directory of this shape>", "--hf-init"]
    model = {**shape, **pairs(row.model)}
    subject, _ = lnstab_subject(model)
    return subject, model_flags(model)


def prepare_out(out: Path, overwrite: bool, rows: list[Row] | tuple[Row, ...] = ()) -> None:
    """An empty ``out``, or one whose earlier validation ``--overwrite`` may replace: nothing in it is removed until
    the new validation is written (:func:`replace_cards`), and then only the cards of ``rows``, the rows it runs.

    Raises:
        LNStabError: ``out`` holds something and ``overwrite`` is not given, holds no validation, or holds something
            other than a card (a user's own folder) where one of ``rows``' cards goes: refused before anything trains.
    """
    check_writable(out, "--out")  # a file at or above it, a dangling link, no write permission
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise LNStabError(f"--out {out} already holds a validation; give --overwrite to replace it")
        if not (out / "README.md").is_file():
            raise LNStabError(f"--out {out} is not empty and holds no validation README; refusing to replace it")
        for row in rows:
            refuse_foreign(out / row.id)
        for stale in out.glob(f"{STAGE_PREFIX}*"):  # the new cards of an earlier validation killed before its swap
            shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def is_card(directory: Path) -> bool:
    """Whether ``directory`` is a card ``lnstab check`` wrote (a real directory, not a link, whose ``report.json``
    is a card: an object with its criteria), or an empty directory: what ``--overwrite`` may replace."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    if not any(directory.iterdir()):
        return True
    try:
        card = read_json(directory / "report.json")
    except LNStabError:
        return False
    return isinstance(card, dict) and isinstance(card.get("criteria"), list) and "status" in card


def refuse_foreign(target: Path) -> None:
    """Refuse ``target``, where a row's card goes, when something other than a card is there."""
    if os.path.lexists(target) and not is_card(target):
        what = "a symbolic link" if target.is_symlink() else "a directory" if target.is_dir() else "a file"
        raise LNStabError(f"--overwrite is not allowed: {target} is {what} that is not a card lnstab check wrote "
                          "(no report.json of a card); --overwrite replaces only the cards of the rows it runs: "
                          "move it away")


def replace_cards(out: Path, stage: Path, rows: list[Row], files: dict[str, str]) -> None:
    """Swap the new cards (``stage/<row>``, same filesystem as ``out``) and ``files`` (name → text) into ``out``, in
    place of the earlier cards of those rows only (every other row's card, and anything that is not a card, stays);
    a signal meanwhile waits until it is done, so ``out`` holds one validation or the other, whole."""
    for row in rows:  # checked before the training too (prepare_out); again here, before anything changes
        refuse_foreign(out / row.id)
    with deferred():
        for row in rows:
            shutil.rmtree(out / row.id, ignore_errors=True)
            (stage / row.id).rename(out / row.id)
        for name, text in files.items():
            atomic_write_text(out / name, text)


@dataclasses.dataclass(frozen=True)
class Validation:
    """One ``--validate`` run, its arguments checked by :func:`main`."""

    args: argparse.Namespace  # a supplement's arguments included
    model_args: dict[str, Any]  # the shape given (a supplement's included)
    command: str  # the README names the command the user typed, which reproduces it
    flags: list[str]  # the protocol flags given (a supplement's after the user's): what a row's card adds to its own
    sup: Supplement | None
    rows: list[Row]
    wanted: list[str]  # the --rows asked for, empty for all
    out: Path
    protocol: Protocol
    thresholds: dict[str, Any]
    started: float

    def summary(self, agree: int, cards: list[dict[str, Any]], wall: float, n_runs: int, models: int
                ) -> dict[str, Any]:
        """The run record (``summary.json``), from which the README is rendered."""
        args, model_args, sup, wanted = self.args, self.model_args, self.sup, self.wanted
        shown = [*model_flags(model_args), *(["--set", args.set] if args.set == "heldout" else []),
                 *(["--rows", ",".join(wanted)] if wanted else []), *self.flags]
        tier, at_default = args.tier, default_protocol(self.protocol, args.tier)
        at_tier = {} if sup or model_args or not at_default else {"tier": tier}  # a tier's run says so (issue 39)
        # the row notes explain the quick tier's whole default run, and quote its numbers
        full = not wanted and not model_args and tier == "quick" and at_default
        return {"set": args.set, **({"supplement": sup.id} if sup else {}), **at_tier,  # args: no local path
                "args": shlex.split(public_command(shown).removeprefix("lnstab check ")),
                "agree": agree, "rows": {r.id: {"card": c["status"], "expected": list(r.expected)}
                                         for r, c in zip(self.rows, cards, strict=True)}, "wall_s": round(wall, 1),
                "readme": {  # what the README says beyond the cards: it is rendered from this record
                    "command": self.command,
                    "runs": n_runs, "models": models, "shape": model_args, "data": data_text(self.protocol),
                    "notes": full, "default_thresholds": self.thresholds == tier_thresholds(tier, None),
                    "history": history()}}


def main(args: argparse.Namespace, model_args: dict[str, Any], typed: list[str], sup: Supplement | None) -> None:
    """Run the validation set (with ``--supplement``: ``sup``'s, whose arguments ``args`` and ``model_args`` hold);
    exit status 0 when every row agrees, 1 when one does not."""
    started = time.perf_counter()
    if args.hf or args.factory:
        raise LNStabError("--validate checks its own set of models; --hf and --factory are not used with it")

    unused = [f"--{dest.replace('_', '-')}" for dest in ("hf_init", *FACTORY_OPTIONS, "z_loss", "no_reference", "name")
              if getattr(args, dest) not in (None, False)]
    if unused:
        raise LNStabError(f"{unused[0]} is not used with --validate: its rows are its own models, each graded beside "
                          "the references, and the README goes to --out")
    bad = [k for k in model_args if k not in SHAPE_KEYS]
    if bad:
        raise LNStabError(f"--model.{bad[0]} is not allowed with --validate; only the shape may change "
                          f"({', '.join(SHAPE_KEYS)})")
    every = supplement_rows(sup, SETS[args.set])  # a supplement's protocol may imply another outcome for a row
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()]
    unknown = [r for r in wanted if r not in {row.id for row in every}]
    if unknown:
        raise LNStabError(f"--rows {unknown[0]} is not allowed; rows of --set {args.set}: "
                          f"{', '.join(r.id for r in every)}")
    rows = [r for r in every if not wanted or r.id in wanted]
    out = Path(args.out) if args.out else default_out(args.tier, args.set, sup.id if sup else None)
    run = Validation(args, model_args, public_command(["--validate", *(a for a in typed if a != "--validate")]),
                     protocol_args([*typed, *(sup.args if sup else ())]), sup, rows, wanted, out,
                     make_protocol(args, {}), tier_thresholds(args.tier, args.thresholds), started)
    try:
        agree, wall = validate_rows(run)
    except Interrupted as exc:
        exc.where = exc.where or f"; nothing in {out} was replaced"
        raise
    which = " --set heldout" if args.set == "heldout" else f" --supplement {sup.id}" if sup else ""
    sys.stdout.write(f"lnstab check --validate{which}: {agree} of {len(rows)} rows "
                     f"agree with the published outcome ({wall:.0f} s); {out / 'README.md'}\n")
    if agree < len(rows):
        raise SystemExit(1)


def default_out(tier: str, set_name: str, supplement: str | None) -> Path:
    """Where a validation goes without ``--out``: ``docs/check/validation`` at the quick tier (the held-out set in
    its ``heldout/``, a supplement in ``supplements/ID``), ``docs/check/validation/<tier>`` at another tier, so a
    proxy-tier run never replaces the quick tier's record."""
    base = DEFAULT_OUT if tier == "quick" else DEFAULT_OUT / tier
    return base / HELDOUT_DIR if set_name == "heldout" else DEFAULT_OUT / "supplements" / supplement if supplement \
        else base


def validate_rows(run: Validation) -> tuple[int, float]:
    """Train every row's runs, grade the cards and replace ``run.out``'s validation with them; ``(agreeing rows, wall
    seconds)``."""
    args, protocol, rows, out = run.args, run.protocol, run.rows, run.out
    tier_shape = (tiers()[args.tier].get("model") or {}) if args.tier != "quick" else {}
    shape = {**pairs(DEFAULT_SHAPE), **tier_shape, **run.model_args}
    with tempfile.TemporaryDirectory(prefix="lnstab-validate-") as tmp:
        work = Path(tmp)
        checked = [row_subject(row, shape, work) for row in rows]
        seq_len = context_length(checked[0][0], protocol.seq_len, given=args.seq_len is not None)
        prepare_out(out, args.overwrite, rows)
        estimate = len(plan([checked[0][0], *references(checked[0][0], seq_len)], protocol)) * len(rows)
        workers, per_worker = worker_counts(args, estimate)
        with RunPool(workers, per_worker) as pool:
            data, first = load_data(protocol, checked[0][0], seq_len, args.vocab, pool)
            subjects = [first] + [with_protocol_vocab(s, data, seq_len) for s, _ in checked[1:]]
            registry, keys = unique_runs(rows, subjects, seq_len)
            runs = run_ladder(list(registry.values()), protocol, data.tokens, work / "tb",
                              progress=not args.no_progress, pool=pool)
        made_by = provenance(workers, per_worker)
        cards = []
        stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out))  # beside the cards it replaces: renames
        try:
            for row, subject, (_, card_args) in zip(rows, subjects, checked, strict=True):
                key, ref_keys = keys[row.id]
                card_subjects = [dataclasses.replace(subject, key="checked", same_as=None)] + [
                    dataclasses.replace(registry[k], key=name, same_as="checked" if k == key else None)
                    for name, k in ref_keys.items()]
                card_runs = {"checked": runs[key], **{name: runs[k] for name, k in ref_keys.items()}}
                spent = sum(r.wall_s for k in {key, *ref_keys.values()} for r in runs[k])
                cards.append(grade(card_subjects[0], card_subjects, card_runs, protocol, run.thresholds, data, seq_len,
                                   stage / row.id, public_command([*card_args, *run.flags]),
                                   time.perf_counter() - spent, made_by, figures=False, shown=out / row.id))
            wall = time.perf_counter() - run.started
            n_runs = sum(len(v) for k, v in runs.items() if k in registry)
            agree = sum(c["status"] in r.expected for r, c in zip(rows, cards, strict=True))
            summary = run.summary(agree, cards, wall, n_runs, len(registry))
            text = readme(summary, cards, out)
            try:
                replace_cards(out, stage, rows, {"summary.json": json.dumps(summary, indent=1) + "\n",
                                                 "README.md": text})
            except Interrupted as exc:  # held back while the cards were replaced: the new validation is whole
                exc.where = f" after the new validation was written to {out}"
                raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return agree, wall


def protocol_args(argv: list[str]) -> list[str]:
    """The protocol flags of a ``--validate`` command line (no ``--validate``, ``--overwrite``, ``--rows``,
    ``--set``, ``--out``, ``--supplement``, ``--model.*``): what a single card of a row needs beside the row's own
    arguments."""
    out, given = [], iter(argv)
    for arg in given:
        name = arg.split("=", 1)[0]
        if name in ("--rows", "--set", "--out", "--supplement") or name.startswith("--model."):
            if "=" not in arg:
                next(given, None)  # its value
        elif name not in ("--validate", "--overwrite"):
            out.append(arg)
    return out


def default_protocol(protocol: Any, tier: str = "quick") -> bool:
    """Whether ``protocol`` is ``tier``'s (by default the check's default one), whatever its data and accelerator."""

    data = ["--data.path", protocol.data_path] if protocol.data_path else []  # the proxy tier needs a file
    default = make_protocol(build_parser().parse_args(["--tier", tier, *data]), {})
    loose = {"data_source": default.data_source, "data_path": default.data_path, "accelerator": default.accelerator}
    return dataclasses.replace(protocol, **loose) == default


def data_text(protocol: Any) -> str:
    """The data flags of ``protocol`` as a README shows them (a path by :func:`public_path`)."""
    flags = [] if protocol.data_source == "auto" else [f"--data.source {protocol.data_source}"]
    if protocol.data_path:
        flags.append(f"--data.path {shlex.quote(public_path(protocol.data_path))}")
    return " ".join(flags)


def with_protocol_vocab(subject: Subject, data: Any, seq_len: int) -> Subject:
    """``subject`` on the validation's windows: with their vocabulary when it is not the model's own (the protocol
    vocabulary, or the proxy tier's top-K + UNK)."""
    if data.vocab["mode"] == "model":
        return subject
    compact = subject.with_vocab(data.vocab["size"])
    if compact is None:
        raise LNStabError(f"{subject.label} cannot take the protocol vocabulary; give --vocab model")
    check_model(compact, data.vocab["size"], seq_len, causal=False)  # the rows are causal by their design
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


