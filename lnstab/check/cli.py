"""A stability report card for any Transformer, measured beside Pre-LN and Peri-LN references of its shape.

``lnstab check`` examples::

    lnstab check --model.preset mini --model.norm_placement output --data.path owt-sample.jsonl.gz
    lnstab check --hf ./my-gpt2 --hf-init
    lnstab check --factory mypkg.models:build --layer-pattern 'blocks\\.(\\d+)$' --lrs 1e-3,1e-2

    lnstab check --validate --data.path owt-sample.jsonl.gz      # the validation set: docs/check/validation
    lnstab check --compare runs/check/old runs/check/new         # what changed between two cards (or validations)

Exit status: 0 when no criterion fails, 1 when one does, 2 for a usage error (one line on stderr, nothing
written), 3 when the checked model or the check itself fails (a stress run raised: one line on stderr naming the
run, the traceback in ``<out>/error.txt``), so a CI gate never reads a crash as a verdict; ``128 + signal`` when
SIGINT (Ctrl-C), SIGTERM or SIGHUP ended it (one line, no verdict, :mod:`lnstab.check.signals`); a write the
machine refused (a full disk) is 3 too, one line naming the file and the OS's reason. With ``--validate``:
0 when every row of the validation set agrees with the published outcome, 1 when one does not. With ``--compare``:
0 when the two sides have the same cards with the same verdicts, 1 when not, 2 for a usage error or a malformed or
damaged card (one line naming the file and the field), 3 when the comparison itself failed
(:mod:`lnstab.check.compare`).
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
from lnstab.check.criteria import load_thresholds
from lnstab.check.protocol import Protocol, RunFailed, plan, run_ladder
from lnstab.check.report import terminal
from lnstab.check.runner import VOCAB_MODES, grade, lnstab_version, load_data, machine, public_command
from lnstab.check.runspec import Optimisation
from lnstab.check.signals import Interrupted, interruptible
from lnstab.check.subjects import Subject, context_length, hf_subject, lnstab_subject, parse_value, references
from lnstab.check.validation import supplement_argv
from lnstab.check.workers import RunPool, auto_workers
from lnstab.errors import LNStabError, MachineError, one_line, refused_write
from lnstab.rundir import atomic_write_text, check_writable

DEFAULT_ROOT = Path("runs") / "check"
EXIT_FAILED = 3  # the checked model or the check itself failed: not a verdict
INTERRUPTED = "interrupted.txt"  # in a run directory a signal ended: no verdict
# The options that describe a --factory model (argparse dests; --name-with-dashes on the command line).
FACTORY_OPTIONS = ("layer_pattern", "module_types", "embed_pattern", "final_pattern", "norm_pattern", "head_pattern",
                   "q_pattern", "k_pattern", "n_head")


class CheckFailed(Exception):
    """The check could not finish: a stress run raised, or the check itself did (exit status 3)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through lnstab's LNStabError handler, exit 2
        raise LNStabError(f"lnstab check: {message}")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of every option but ``--model.KEY VALUE`` (collected by :func:`split_model_args`)."""
    p = _Parser(prog="lnstab check", description=__doc__.splitlines()[0], allow_abbrev=False,
                epilog="--model.KEY VALUE: any lnstab GPTModule argument (preset, norm_placement, norm_type, "
                       "residual_scale, n_layer, ...). Exit status: 0 no criterion fails, 1 one fails, 2 usage error, "
                       f"{EXIT_FAILED} the checked model or the check itself failed (one line; traceback in "
                       "<out>/error.txt; a full disk: one line naming the file), 128 + signal when SIGINT, SIGTERM "
                       "or SIGHUP ended it (no verdict). --validate: 0 every row agrees, 1 one does not. --compare: "
                       "0 the same verdicts on the same cards, 1 not, 2 a usage error or a malformed card, "
                       f"{EXIT_FAILED} the comparison failed.")
    src = p.add_argument_group("model to check (one of --model.*, --hf, --factory)")
    src.add_argument("--hf", help="Hugging Face causal LM: local directory or hub name (never remote code).")
    src.add_argument("--hf-init", action="store_true", help="Freshly initialise --hf from its config.")
    src.add_argument("--factory", help="package.module:function: an nn.Module, token ids (B, T) -> logits (B, T, V) "
                     "(alone, first in a tuple or a dict's 'logits'), trained in float32.")
    src.add_argument("--layer-pattern", help="Regex of the blocks' module names (first group: layer index).")
    src.add_argument("--module-types", help="Comma-separated dotted classes of the blocks.")
    src.add_argument("--embed-pattern", help="Regex of the module whose output is X_0 (default: first block input).")
    src.add_argument("--final-pattern", help="Regex of the module whose input is X_D (e.g. the final norm).")
    src.add_argument("--norm-pattern", help="Regex of the output norms, one per residual update (Theorem 4).")
    src.add_argument("--head-pattern", help="Regex of the output head whose output is the logits (default lm_head).")
    src.add_argument("--q-pattern", help="Regex of the query projections, one per layer, for attention the check does "
                                         "not recognise (with --k-pattern and --n-head).")
    src.add_argument("--k-pattern", help="Regex of the key projections, one per layer.")
    src.add_argument("--n-head", type=int, help="Query heads per layer, for --q-pattern.")
    src.add_argument("--z-loss", type=float, help="Train an --hf or --factory model on cross-entropy + Z_LOSS·mean "
                     "(log Z)² (PaLM's z-loss; the references without it; lnstab's GPT: --model.z_loss).")
    pro = p.add_argument_group("protocol")
    pro.add_argument("--lrs", type=_floats, help="Learning-rate ladder (default 1e-3,1e-2,1e-1).")
    pro.add_argument("--seeds", type=_ints, help="Seeds (default 0,1).")
    pro.add_argument("--steps", type=int, default=30, help="Optimizer steps per stress run.")
    pro.add_argument("--warmup-steps", type=int, help="Linear warmup steps (default 3).")
    pro.add_argument("--min-lr-ratio", type=float, default=0.1, help="Cosine end as a fraction of the rate.")
    pro.add_argument("--weight-decay", type=float, help="AdamW decay on matrices (default 0.1).")
    pro.add_argument("--grad-clip", type=float, default=1.0, help="Gradient-norm clipping, 0 for none.")
    pro.add_argument("--batch-size", type=int, default=8)
    pro.add_argument("--seq-len", type=int, help="Tokens per sequence (default 64, cut to the context; given: at "
                     "most the context).")
    pro.add_argument("--measure-every", type=int, help="Steps between hidden-state measurements; must divide --steps "
                                                       "(default: the largest divisor up to a third of them).")
    pro.add_argument("--jacobian-iters", type=int, default=8, help="Power iterations per Jacobian norm.")
    pro.add_argument("--probe-size", type=int, default=2, help="Sequences in the Jacobian probe.")
    pro.add_argument("--data.path", dest="data_path", help="Text to train on (e.g. the OpenWebText sample).")
    pro.add_argument("--data.source", dest="data_source", default="auto", help="auto, files or synthetic.")
    pro.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto; always fp32.")
    pro.add_argument("--threads", type=int, help="torch CPU threads in all (default: torch's), shared by the "
                                                 "workers.")
    pro.add_argument("--workers", type=int, help="Processes running the stress runs, one thread each by default "
                                                 "(default: one per thread, at most 4; 1: this process).")
    pro.add_argument("--vocab", choices=VOCAB_MODES, default="protocol",
                     help="protocol (default): build the models with the distinct tokens of the windows as their "
                          "vocabulary where the model allows it (lnstab's family, --hf-init, a factory taking "
                          "vocab_size); model: the model's own vocabulary.")
    out = p.add_argument_group("output")
    out.add_argument("--no-reference", action="store_true", help="Skip the Pre-LN and Peri-LN references.")
    out.add_argument("--thresholds", help="YAML overriding the default thresholds (see lnstab.check.criteria).")
    out.add_argument("--out", help="Run directory (default runs/check/<name>; never overwritten).")
    out.add_argument("--name", help="Name of the default run directory.")
    out.add_argument("--no-progress", action="store_true", help="No progress bar.")
    out.add_argument("--validate", action="store_true", help="Run the validation set (lnstab.check.validation) at "
                     "the default shape and write its README (--out, default docs/check/validation).")
    out.add_argument("--overwrite", action="store_true", help="With --validate: replace an earlier validation.")
    out.add_argument("--rows", help="With --validate: comma-separated row ids (default: every row).")
    out.add_argument("--set", choices=("main", "heldout"), default="main",
                     help="With --validate: main (default; docs/check/validation) or heldout, the designs that played "
                          "no part in fixing the thresholds (docs/check/validation/heldout).")
    out.add_argument("--supplement", help="With --validate: run one supplement of the main set (lnstab.check."
                                          "validation.SUPPLEMENTS): its rows and arguments, its protocol's expected "
                                          "verdicts (--out default docs/check/validation/supplements/ID).")
    out.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"),
                     help="Compare two cards, or two --validate directories, already made (e.g. on two machines): "
                          "changed verdicts, changed criterion statuses, how far the measurements moved; trains "
                          "nothing. Exit status 0 the same verdicts, 1 a verdict or the set of cards changed, 2 a "
                          f"usage error or a malformed card (one line), {EXIT_FAILED} the comparison failed.")
    return p


def split_model_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``--model.KEY VALUE`` / ``--model.KEY=VALUE`` pairs (values parsed as YAML) and the remaining arguments."""
    model: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--model."):
            key, eq, value = arg[len("--model."):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise LNStabError(f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            model[key.replace("-", "_")] = parse_value(value)
        else:
            rest.append(arg)
        i += 1
    return model, rest


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
        raise LNStabError("--layer-pattern, --module-types, --embed-pattern, --final-pattern, --norm-pattern, "
                          "--head-pattern, --q-pattern, --k-pattern and --n-head describe a --factory model")
    from lnstab.check.subjects import check_z_loss, with_z_loss

    check_z_loss(args.z_loss)  # refused before the model is built
    if model_args:
        subject, extra = lnstab_subject(model_args)
    elif args.hf:
        subject, extra = hf_subject(args.hf, args.hf_init), {}
    else:
        from lnstab.check.factory import factory_subject

        seq_len = Protocol.seq_len if args.seq_len is None else args.seq_len
        subject, extra = factory_subject(args.factory, args.layer_pattern, args.module_types, seq_len,
                                         args.embed_pattern, args.final_pattern, args.norm_pattern, args.head_pattern,
                                         qk=(args.q_pattern, args.k_pattern, args.n_head)), {}
    return with_z_loss(subject, args.z_loss), extra


def make_protocol(args: argparse.Namespace, extra: dict[str, Any]) -> Protocol:
    """The :class:`Protocol` of the flags, ``--model.*`` optimisation arguments filling unset ones."""
    for option, given in (("--lrs", args.lrs), ("--seeds", args.seeds)):
        if given is not None and not given:
            raise LNStabError(f"{option} '' is not allowed; give a comma-separated list (e.g. {option} "
                              f"{'1e-3,1e-2' if option == '--lrs' else '0,1'}) or leave {option} out for the default")
    if "learning_rate" in extra and args.lrs:
        raise LNStabError("give --lrs or --model.learning_rate, not both")
    lrs = args.lrs or ((float(extra["learning_rate"]),) if "learning_rate" in extra else Protocol.lrs)
    default = Optimisation()
    pick = lambda flag, key, fallback: flag if flag is not None else extra.get(key, fallback)  # noqa: E731
    optimisation = Optimisation(
        steps=args.steps,
        warmup_steps=pick(args.warmup_steps, "warmup_steps", min(default.warmup_steps, max(args.steps, 0))),
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=pick(args.weight_decay, "weight_decay", default.weight_decay),
        betas=tuple(extra.get("betas", default.betas)),
        eps=extra.get("eps", default.eps),
        grad_clip=args.grad_clip,
    )
    every = args.measure_every
    if every is None:  # measured at initialisation, about three times during training, and after it
        every = max(d for d in range(1, max(1, args.steps // 3) + 1) if args.steps % d == 0) if args.steps > 0 else 1
    return Protocol(lrs=tuple(lrs), seeds=args.seeds or Protocol.seeds, batch_size=args.batch_size,
                    seq_len=Protocol.seq_len if args.seq_len is None else args.seq_len, measure_every=every,
                    jacobian_iters=args.jacobian_iters,
                    probe_size=args.probe_size, optimisation=optimisation, data_source=args.data_source,
                    data_path=args.data_path, accelerator=args.accelerator)


def check_out(out: str | None) -> None:
    """Refuse, before anything runs, an ``--out`` that is a file, lies under one, or already holds something."""
    if not out:
        return
    path = Path(out)
    if path.is_dir() and any(path.iterdir()):
        what = (" (a check a signal ended: its interrupted.txt says so; remove it to check again there)"
                if (path / INTERRUPTED).is_file() else "")
        raise LNStabError(f"--out {out} already exists and is not empty{what}; a check never overwrites")
    check_writable(out, "--out")  # a file in the way, a dangling link, no write permission


def run_directory(args: argparse.Namespace, name: str) -> Path:
    """A new, empty run directory: ``--out`` (refused if it holds anything) or ``runs/check/<name>[-N]``."""
    if args.out:
        check_out(args.out)
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
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
    typed = list(argv)  # what the user typed, before a supplement's own arguments are added
    model_args, rest = split_model_args(argv)
    args = build_parser().parse_args(rest)
    if args.compare:
        from lnstab.check.compare import main as compare

        compare(args.compare, model_args, rest)
        return
    if args.workers is not None:
        validation.positive_int("--workers", args.workers)
    if args.overwrite and not args.validate:
        raise LNStabError("--overwrite is for --validate; a check never overwrites a run directory")
    if args.rows and not args.validate:
        raise LNStabError("--rows is for --validate")
    if args.set != "main" and not args.validate:
        raise LNStabError("--set is for --validate")
    if args.supplement is not None:
        if not args.validate or args.set != "main":
            raise LNStabError("--supplement is for --validate of the main set (not with --set heldout)")
        argv = supplement_argv(args.supplement, argv)  # its rows, shape and protocol, as if typed
        model_args, rest = split_model_args(argv)
        args = build_parser().parse_args(rest)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(validation.positive_int("--threads", args.threads))
    try:
        with interruptible():
            if args.validate:
                from lnstab.check.validate import main as validate

                validate(args, model_args, argv, typed)
                return
            card = run_check(args, model_args, public_command(argv))
    except Interrupted as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            sys.stderr.write(f"lnstab: lnstab check{' --validate' if args.validate else ''} stopped by "
                             f"{signal.Signals(exc.signum).name}; no verdict{exc.where}\n")
        raise SystemExit(128 + exc.signum) from None
    except MachineError as exc:  # a full disk: one line naming the file and the OS's reason; a failure, no verdict
        if os.environ.get("LNSTAB_DEBUG"):
            raise
        sys.stderr.write(f"lnstab: error: lnstab check: {one_line(exc)}; no verdict\n")
        raise SystemExit(EXIT_FAILED) from None
    except LNStabError:
        raise
    except Exception as exc:
        if os.environ.get("LNSTAB_DEBUG"):
            raise
        message = str(exc) if isinstance(exc, CheckFailed | RunFailed) else (
            f"the check failed: {type(exc).__name__}: {_first_line(exc)}")
        sys.stderr.write(f"lnstab: error: lnstab check: {message}\n")
        raise SystemExit(EXIT_FAILED) from None
    finally:
        torch.set_num_threads(threads)
    sys.stdout.write(terminal(card))
    if card["exit_code"]:
        raise SystemExit(card["exit_code"])


def run_check(args: argparse.Namespace, model_args: dict[str, Any], command: str) -> dict[str, Any]:
    """Validate everything, then train, grade and write the card into a new run directory; the card."""
    started = time.perf_counter()
    check_out(args.out)
    subject, extra = checked_subject(args, model_args)
    protocol = make_protocol(args, extra)
    thresholds = load_thresholds(args.thresholds)
    seq_len = context_length(subject, protocol.seq_len, given=args.seq_len is not None)
    n_runs = len(plan([subject] + ([] if args.no_reference else references(subject, seq_len)), protocol))
    workers, per_worker = worker_counts(args, n_runs)
    out: Path | None = None
    with RunPool(workers, per_worker) as pool:  # the workers start importing now; one of them then reads the data
        try:
            data, subject = load_data(protocol, subject, seq_len, args.vocab, pool)
            subjects = [subject] + ([] if args.no_reference else references(subject, seq_len))
            out = run_directory(args, args.name or subject.name)  # only now: a usage error leaves nothing behind
            provenance = {"lnstab": lnstab_version(), "machine": machine(workers, per_worker)}
            runs = run_ladder(subjects, protocol, data.tokens, out / "tb", progress=not args.no_progress, pool=pool)
        except Interrupted as exc:
            if out is not None:
                note_interrupted(out, exc, f"{pool.finished} of {n_runs} stress runs finished")
            raise
        except Exception as exc:
            if out is None:
                raise
            raise check_failed(out, exc) from exc
    try:  # the workers are gone or going: the grading has the machine to itself
        return grade(subject, subjects, runs, protocol, thresholds, data, seq_len, out, command, started, provenance)
    except Interrupted as exc:
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
    what = str(exc) if isinstance(exc, RunFailed) else f"the check failed: {type(exc).__name__}: {_first_line(exc)}"
    try:
        write_error(out, exc)
    except MachineError as full:  # the disk filled: the line says what failed and why error.txt is not there
        return MachineError(f"{what}; and {full}")
    if isinstance(exc, LNStabError):
        return exc
    return CheckFailed(f"{what}; no verdict (traceback in {out / 'error.txt'})")


def worker_counts(args: argparse.Namespace, n_runs: int) -> tuple[int, int]:
    """``(workers, torch threads per worker)`` from ``--workers`` and the thread count."""
    threads = torch.get_num_threads()
    workers = args.workers or auto_workers(n_runs, threads)
    return workers, max(1, threads // workers)


def write_error(out: Path, exc: BaseException) -> None:
    """``<out>/error.txt``: the traceback, with the one from the process that ran a failed stress run."""
    text = "".join(traceback.format_exception(exc))
    if isinstance(exc, RunFailed) and exc.detail:
        text += "\nThe stress run's own traceback:\n" + exc.detail
    atomic_write_text(out / "error.txt", text)


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:300]
