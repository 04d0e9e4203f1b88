"""A stability report card for any Transformer, measured beside Pre-LN and Peri-LN references of its shape.

``lnstab check`` examples::

    lnstab check --model.preset mini --model.norm_placement output --data.path $LNSTAB_OWT_SAMPLE
    lnstab check --hf ./my-gpt2 --hf-init
    lnstab check --factory mypkg.models:build --layer-pattern 'blocks\\.(\\d+)$' --lrs 1e-3,1e-2

    lnstab check --validate --data.path $LNSTAB_OWT_SAMPLE      # the validation set: docs/check/validation
    lnstab check --compare runs/check/old runs/check/new         # what changed between two cards (or validations)

Exit status (0 pass, 1 a criterion fails, 2 usage error, 3 the model or the check failed, 128 + signal; and those of
``--validate`` and ``--compare``): docs/check/README.md, "Output and exit status", and ``lnstab check --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from lnstab import validation
from lnstab.check.cache import cache_root
from lnstab.check.compare import main as compare
from lnstab.check.factory import factory_subject, own_vocabulary_note
from lnstab.check.options import (
    EXIT_FAILED,
    FACTORY_OPTIONS,
    build_parser,
    checked_threads,
    make_protocol,
    split_model_args,
    tier_model_args,
    tier_thresholds,
    worker_counts,
)
from lnstab.check.protocol import Protocol, RunFailed, plan, run_ladder
from lnstab.check.report import ERROR, INTERRUPTED, terminal
from lnstab.check.runner import grade, load_data, provenance, public_command
from lnstab.check.signals import Interrupted, interruptible
from lnstab.check.subjects import (
    Subject,
    check_z_loss,
    context_length,
    hf_subject,
    lnstab_subject,
    references,
    with_z_loss,
)
from lnstab.check.validation import checked_supplement
from lnstab.check.workers import RunPool
from lnstab.errors import LNStabError, MachineError, first_line, one_line, refused_write
from lnstab.rundir import atomic_write_text, check_name_lengths, check_writable

DEFAULT_ROOT = Path("runs") / "check"
CARD_FILES = ("report.md", "report.json", "thresholds.yaml")  # what report.write_report writes
CLAIM = ".claimed"  # an --out this check writes into, while it runs (removed as it ends)
_claimed: list[Path] = []


class CheckFailed(Exception):
    """The check could not finish: a stress run raised, or the check itself did (exit status 3)."""


def checked_subject(args: argparse.Namespace, model_args: dict[str, Any]) -> tuple[Subject, dict[str, Any]]:
    """The model to check and the optimisation settings its ``--model.*`` arguments carry."""
    given = [name for name, on in (("--model.*", bool(model_args)), ("--hf", bool(args.hf)),
                                   ("--factory", bool(args.factory))) if on]
    if len(given) != 1:
        raise LNStabError("give the model to check as exactly one of --model.KEY VALUE (lnstab's GPT), "
                          f"--hf PATH_OR_NAME or --factory package.module:function (got {', '.join(given) or 'none'})")
    if args.hf_init and not args.hf:
        raise LNStabError("--hf-init needs --hf PATH_OR_NAME")
    if not args.factory and any(getattr(args, p) is not None for p in FACTORY_OPTIONS):
        *named, last = (f"--{p.replace('_', '-')}" for p in FACTORY_OPTIONS)
        raise LNStabError(f"{', '.join(named)} and {last} describe a --factory model")
    check_z_loss(args.z_loss)  # refused before the model is built
    if model_args:
        subject, extra = lnstab_subject(model_args)
    elif args.hf:
        subject, extra = hf_subject(args.hf, args.hf_init), {}
    else:
        seq_len = Protocol.seq_len if args.seq_len is None else args.seq_len
        subject, extra = factory_subject(args.factory, args.layer_pattern, args.module_types, seq_len,
                                         args.embed_pattern, args.final_pattern, args.norm_pattern, args.head_pattern,
                                         qk=(args.q_pattern, args.k_pattern, args.n_head)), {}
    return with_z_loss(subject, args.z_loss), extra


def check_out(out: str | None) -> None:
    """Refuse, before anything runs, an ``--out`` that is a file, lies under one, or already holds something."""
    if not out:
        return
    path = Path(out)
    check_name_lengths(path, "--out")  # before is_dir(), which raised 'File name too long' (exit 3)
    if path.is_dir() and any(path.iterdir()):
        what = (" (a check a signal ended: its interrupted.txt says so; remove it to check again there)"
                if (path / INTERRUPTED).is_file() else
                " (a check that failed: its error.txt says why; remove it to check again there)"
                if (path / ERROR).is_file() else
                " (a check is writing into it, or one killed before it ended (kill -9, out of memory) left its "
                f"{CLAIM} there; remove it to check again there)" if (path / CLAIM).is_file() else "")
        raise LNStabError(f"--out {out} already exists and is not empty{what}; a check never overwrites")
    check_writable(out, "--out")  # a file in the way, a dangling link, no write permission


def check_name(name: str | None) -> None:
    """Refuse, before anything runs, a ``--name`` that is not one directory name under ``runs/check`` (no path, not
    ``.`` or ``..``, not longer than the filesystem takes)."""
    if not name:
        return
    if "/" in name or os.sep in name or (os.altsep and os.altsep in name) or name in (".", "..") or "\0" in name:
        raise LNStabError(f"--name {name!r} is not allowed; it names one directory under {DEFAULT_ROOT} (no '/', "
                          "not '.' or '..'); give --out DIR for a directory elsewhere")
    check_name_lengths(DEFAULT_ROOT / name, "--name")


def run_directory(args: argparse.Namespace, name: str) -> Path:
    """A new, empty run directory: ``--out`` (refused if it holds anything) or ``runs/check/<name>[-N]``."""
    if args.out:
        check_out(args.out)
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            os.close(os.open(out / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            _claimed.append(out / CLAIM)
        except FileExistsError:  # two checks found it empty at once: one writes into it, the other is refused
            raise LNStabError(f"--out {out} is being written by another lnstab check started at the same time; a "
                              "check never overwrites: give another --out") from None
        except OSError as exc:
            raise LNStabError(f"--out {out} cannot be created ({exc.strerror or type(exc).__name__})") from None
        return out
    try:
        DEFAULT_ROOT.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LNStabError(f"{DEFAULT_ROOT} cannot be created ({exc.strerror or type(exc).__name__}); give --out DIR"
                          ) from None
    for n in range(10_000):
        out = DEFAULT_ROOT / (name if n == 0 else f"{name}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
    raise LNStabError(f"no free run directory for {name!r} under {DEFAULT_ROOT}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``lnstab check`` (called by ``lnstab``'s console script with the arguments after ``check``).

    Raises:
        LNStabError: A usage error (``lnstab`` prints it as one line, exit status 2).
        SystemExit: With status 1 when a criterion fails, 3 (one line on stderr) when the checked model or the
            check itself fails (``LNSTAB_DEBUG=1`` raises the original error instead).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, rest = split_model_args(argv)
    args = build_parser().parse_args(rest)
    if args.compare:
        compare(args.compare, model_args, rest)
        return
    if args.workers is not None:
        validation.positive_int("--workers", args.workers)
    if args.overwrite and not args.validate:
        raise LNStabError("--overwrite is for --validate; a check never overwrites a run directory")
    if args.rows and not args.validate:
        raise LNStabError("--rows is for --validate")
    if args.supplement is not None and args.tier != "quick":
        raise LNStabError(f"--tier {args.tier} is not allowed with --supplement: a supplement is its own protocol "
                          "(give --tier quick or leave it out)")
    if args.set != "main" and not args.validate:
        raise LNStabError("--set is for --validate")
    sup = None
    if args.supplement is not None:
        if not args.validate or args.set != "main":
            raise LNStabError("--supplement is for --validate of the main set (not with --set heldout)")
        sup = checked_supplement(args.supplement, argv)
        own_model, own = split_model_args(list(sup.args))  # its rows, shape and protocol, which argv cannot give
        model_args = {**model_args, **own_model}
        build_parser().parse_args(own, namespace=args)  # sets the options it gives, no others
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(checked_threads(args.threads))
    try:
        with interruptible():
            if args.validate:
                from lnstab.check.validation.run import main as validate

                validate(args, model_args, argv, sup)
                return
            card = run_check(args, model_args, public_command(argv))
    except Interrupted as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            sys.stderr.write(f"lnstab: lnstab check{' --validate' if args.validate else ''} stopped by "
                             f"{signal.Signals(exc.signum).name}; no verdict{exc.where}\n")
        raise SystemExit(128 + exc.signum) from None
    except Exception as exc:
        if (isinstance(exc, LNStabError) and not isinstance(exc, MachineError)) or os.environ.get("LNSTAB_DEBUG"):
            raise  # a usage error (lnstab's one line, exit 2), or LNSTAB_DEBUG's traceback
        # a full disk (one line naming the file and the OS's reason), a failed run or check: exit 3, no verdict
        message = f"{one_line(exc)}; no verdict" if isinstance(exc, MachineError) else _failure(exc)
        sys.stderr.write(f"lnstab: error: lnstab check: {message}\n")
        raise SystemExit(EXIT_FAILED) from None
    finally:
        torch.set_num_threads(threads)
        while _claimed:
            with contextlib.suppress(OSError):
                _claimed.pop().unlink(missing_ok=True)
    sys.stdout.write(terminal(card))
    if card["exit_code"]:
        raise SystemExit(card["exit_code"])


def run_check(args: argparse.Namespace, model_args: dict[str, Any], command: str) -> dict[str, Any]:
    """Validate everything, then train, grade and write the card into a new run directory; the card."""
    started = time.perf_counter()
    check_out(args.out)
    check_name(args.name)
    subject, extra = checked_subject(args, tier_model_args(args.tier, model_args))
    protocol = make_protocol(args, extra)
    thresholds = tier_thresholds(args.tier, args.thresholds)
    seq_len = context_length(subject, protocol.seq_len, given=args.seq_len is not None)
    n_runs = len(plan([subject] + ([] if args.no_reference else references(subject, seq_len)), protocol))
    workers, per_worker = worker_counts(args, n_runs)
    out: Path | None = None
    with RunPool(workers, per_worker) as pool:  # the workers start importing now; one of them then reads the data
        try:
            data, subject = load_data(protocol, subject, seq_len, args.vocab, pool)
            if args.factory and args.vocab == "protocol":  # a factory without vocab_size: what that costs, said now
                if note := own_vocabulary_note(subject, data.tokens):
                    sys.stderr.write(f"lnstab: lnstab check: {note}\n")
            subjects = [subject] + ([] if args.no_reference else references(subject, seq_len))
            out = run_directory(args, args.name or subject.name)  # only now: a usage error leaves nothing behind
            made_by = provenance(workers, per_worker)
            runs = run_ladder(subjects, protocol, data.tokens, out / "tb", progress=not args.no_progress, pool=pool,
                              cache=cache_root(args.no_cache))
        except Interrupted as exc:
            if out is not None:
                note_interrupted(out, exc, f"{pool.finished} of {n_runs} stress runs finished")
            raise
        except Exception as exc:
            if out is None:
                raise
            raise check_failed(out, exc) from exc
    try:  # the workers are gone or going: the grading has the machine to itself
        return grade(subject, subjects, runs, protocol, thresholds, data, seq_len, out, command, started, made_by)
    except Interrupted as exc:
        for name in CARD_FILES:  # a card cut off between its files (report.md without report.json): no verdict
            (out / name).unlink(missing_ok=True)
        note_interrupted(out, exc, f"all {n_runs} stress runs finished, the card not yet written")
        raise
    except Exception as exc:
        raise check_failed(out, exc) from exc


def note_interrupted(out: Path, exc: Interrupted, done: str) -> None:
    """``<out>/interrupted.txt`` and the end of ``lnstab check``'s one line: what a signal left in ``out``."""
    atomic_write_text(out / INTERRUPTED, f"{signal.Signals(exc.signum).name} ended this check after {done}; no "
                      "verdict. The finished runs' logs are under tb/.\n")
    exc.where = f" ({done}; their logs are in {out})"


def check_failed(out: Path, exc: Exception) -> Exception:
    """The error to raise for ``exc`` after the run directory exists: the traceback goes into ``<out>/error.txt``,
    beside the runs' logs; a usage error stays one, and a write the machine refused (a full disk) is its own one line
    (error.txt could not be written either)."""
    refused = exc if isinstance(exc, MachineError) else refused_write(exc, f"a file in {out}")
    if refused is not None:
        return refused
    what = _failure(exc)
    text = "".join(traceback.format_exception(exc))
    if isinstance(exc, RunFailed) and exc.detail:  # with the traceback of the process that ran the failed run
        text += "\nThe stress run's own traceback:\n" + exc.detail
    try:
        atomic_write_text(out / ERROR, text)
    except MachineError as full:  # the disk filled: the line says what failed and why error.txt is not there
        return MachineError(f"{what}; and {full}")
    if isinstance(exc, LNStabError):
        return exc
    return CheckFailed(f"{what}; no verdict (traceback in {out / ERROR})")


def _failure(exc: BaseException) -> str:
    """What ``lnstab check``'s one line says of a failed run or check."""
    if isinstance(exc, CheckFailed | RunFailed):
        return str(exc)
    return f"the check failed: {type(exc).__name__}: {first_line(exc)[:300]}"
