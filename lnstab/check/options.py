"""``lnstab check``'s command line: the parser, the ``--model.*`` arguments, and the :class:`Protocol` and worker
counts they make. The single check (:mod:`lnstab.check.cli`) and the validation (:mod:`lnstab.check.validation.run`)
both read their options here, so the validation never imports the command line that starts it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

from lnstab import validation
from lnstab.check.criteria import load_thresholds
from lnstab.check.protocol import TIERS, TIERS_FILE, Protocol, tiers
from lnstab.check.runner import VOCAB_MODES
from lnstab.check.runspec import Optimisation
from lnstab.check.subjects import parse_value
from lnstab.check.workers import auto_workers
from lnstab.errors import LNStabError

EXIT_FAILED = 3  # the checked model or the check itself failed: not a verdict
# What `lnstab check --help` says first: the first line of lnstab.check.cli's docstring (cli imports this module).
DESCRIPTION = "A stability report card for any Transformer, measured beside Pre-LN and Peri-LN references of its shape."
# The options that describe a --factory model (argparse dests; --name-with-dashes on the command line).
FACTORY_OPTIONS = ("layer_pattern", "module_types", "embed_pattern", "final_pattern", "norm_pattern", "head_pattern",
                   "q_pattern", "k_pattern", "n_head")
# The quick tier's values of the protocol options whose parser default is a number (the others' defaults are
# computed from the steps, the context or Protocol's fields, as before there were tiers).
QUICK_DEFAULTS = {"steps": 30, "min_lr_ratio": 0.1, "grad_clip": 1.0, "batch_size": 8, "jacobian_iters": 8,
                  "probe_size": 2}
PRESET_ARGS = ("n_layer", "n_embd", "n_head")  # what --model.preset decides


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through lnstab's LNStabError handler, exit 2
        raise LNStabError(f"lnstab check: {message}")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """The options, with every protocol option not given taken from the ``--tier``'s values (refused in one
        line naming the field and the allowed values when the tier is not one of :data:`TIERS`)."""
        parsed = super().parse_args(args, namespace)
        validation.choice("--tier", parsed.tier, TIERS, error=LNStabError)
        for key, value in (QUICK_DEFAULTS if parsed.tier == "quick" else tiers()[parsed.tier]["protocol"]).items():
            if getattr(parsed, key, None) is None:
                setattr(parsed, key, tuple(value) if key in ("lrs", "seeds") else value)
        return parsed


def _list_of(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """An argparse type: a comma-separated list of ``what`` (none for a blank one; an empty item between two is
    refused)."""

    def parse(text: str) -> tuple:
        items = [v.strip() for v in text.split(",")]
        if any(items) and not all(items):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item; give a comma-separated list such as "
                                             "1e-3,1e-2")
        try:
            return tuple(convert(v) for v in items if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The parser of every option but ``--model.KEY VALUE`` (collected by :func:`split_model_args`)."""
    p = _Parser(prog="lnstab check", description=DESCRIPTION, allow_abbrev=False,
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
    pro.add_argument("--tier", default="quick", help="quick (default): the per-PR screen, 30-step runs beside the "
                     "references, where losses end near the unigram level; proxy: docs/proxy's shape (2 layers × 128, "
                     "300 steps of 16 × 128 on the OpenWebText sample's top-4095 vocabulary, --data.path), a "
                     "half-decade ladder 1e-4…3e-1, where the loss and LR sensitivity can fail (lnstab/check/"
                     "tiers.yaml). Options given win over the tier's values.")
    pro.add_argument("--lrs", type=_list_of(float, "numbers"), help="Learning-rate ladder (default 1e-3,1e-2,1e-1).")
    pro.add_argument("--seeds", type=_list_of(int, "integers"), help="Seeds (default 0,1).")
    pro.add_argument("--steps", type=int, help="Optimizer steps per stress run (default 30).")
    pro.add_argument("--warmup-steps", type=int, help="Linear warmup steps (default 3).")
    pro.add_argument("--min-lr-ratio", type=float, help="Cosine end as a fraction of the rate (default 0.1).")
    pro.add_argument("--weight-decay", type=float, help="AdamW decay on matrices (default 0.1).")
    pro.add_argument("--grad-clip", type=float, help="Gradient-norm clipping, 0 for none (default 1).")
    pro.add_argument("--batch-size", type=int, help="Sequences per step (default 8).")
    pro.add_argument("--seq-len", type=int, help="Tokens per sequence (default 64, cut to the context; given: at "
                     "most the context).")
    pro.add_argument("--measure-every", type=int, help="Steps between hidden-state measurements; must divide --steps "
                                                       "(default: the largest divisor up to a third of them).")
    pro.add_argument("--jacobian-iters", type=int, help="Power iterations per Jacobian norm (default 8).")
    pro.add_argument("--probe-size", type=int, help="Sequences in the Jacobian probe (default 2).")
    pro.add_argument("--data.path", dest="data_path", help="Text to train on (e.g. the OpenWebText sample).")
    pro.add_argument("--data.source", dest="data_source", default="auto", help="auto, files or synthetic.")
    pro.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto; always fp32.")
    pro.add_argument("--threads", type=int, help="torch CPU threads in all (default: torch's), shared by the "
                                                 "workers; at most the CPUs this process may use.")
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
    out.add_argument("--no-cache", action="store_true", help="Train the references afresh: do not reuse (or keep) "
                     "reference runs of earlier cards with the same shape, protocol, data, lnstab source, torch and "
                     "CPU kind (kept in $LNSTAB_CHECK_CACHE, default ~/.cache/lnstab/check; off: never).")
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
    args = iter(argv)
    for arg in args:
        if not arg.startswith("--model."):
            rest.append(arg)
            continue
        key, eq, value = arg[len("--model."):].partition("=")
        if not eq and (value := next(args, None)) is None:
            raise LNStabError(f"{arg} needs a value")
        model[key.replace("-", "_")] = parse_value(value)
    return model, rest


def pairs(args: tuple[str, ...]) -> dict[str, Any]:
    """``("--model.a", "1", …)`` as ``{"a": 1, …}``, as :func:`split_model_args` reads them."""
    return split_model_args(list(args))[0]


def make_protocol(args: argparse.Namespace, extra: dict[str, Any]) -> Protocol:
    """The :class:`Protocol` of the flags, ``--model.*`` optimisation arguments filling unset ones."""
    for option, given, example in (("--lrs", args.lrs, "1e-3,1e-2"), ("--seeds", args.seeds, "0,1")):
        if given is not None and not given:
            raise LNStabError(f"{option} '' is not allowed; give a comma-separated list (e.g. {option} {example}) or "
                              f"leave {option} out for the default")
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
    data = tiers()[args.tier].get("data") or {}
    return Protocol(lrs=tuple(lrs), seeds=args.seeds or Protocol.seeds, batch_size=args.batch_size,
                    seq_len=Protocol.seq_len if args.seq_len is None else args.seq_len, measure_every=every,
                    jacobian_iters=args.jacobian_iters, probe_size=args.probe_size, optimisation=optimisation,
                    data_source=args.data_source, data_path=args.data_path, accelerator=args.accelerator,
                    tier=args.tier, vocab_top_k=data.get("vocab_top_k"), val_documents=data.get("val_documents"))


def tier_model_args(tier: str, model_args: dict[str, Any]) -> dict[str, Any]:
    """lnstab's ``--model.*`` arguments with ``tier``'s model shape filled in where not given (with ``preset`` given,
    its layers, width and heads are the preset's); an empty dict stays empty: the model is then ``--hf`` or
    ``--factory``, whose shape is its own."""
    shape = tiers()[tier].get("model") or {}
    if not model_args or not shape:
        return model_args
    skip = PRESET_ARGS if "preset" in model_args else ()
    return {**{k: v for k, v in shape.items() if k not in skip}, **model_args}


def tier_thresholds(tier: str, path: str | None) -> dict[str, dict[str, Any]]:
    """The thresholds of ``tier`` (thresholds.yaml with the tier's file merged over it) with ``--thresholds PATH``'s
    entries merged over those."""
    own = tiers()[tier].get("thresholds")
    return load_thresholds(path, load_thresholds(TIERS_FILE.with_name(own)) if own else None)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS keeps one (a container's or taskset's share),
    else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def checked_threads(threads: int) -> int:
    """``--threads`` when it is 1 … :func:`usable_cpus`; else one line naming the flag and that range (exit 2).
    More threads than CPUs only contend for them (``--threads 1000`` on two cores ran a thousand)."""
    cpus = usable_cpus()
    if isinstance(threads, bool) or not 1 <= threads <= cpus:
        raise LNStabError(f"--threads={threads} is not allowed; it must be an integer in [1, {cpus}], the CPUs this "
                          "process may use")
    return threads


def worker_counts(args: argparse.Namespace, n_runs: int) -> tuple[int, int]:
    """``(workers, torch threads per worker)`` from ``--workers`` and the thread count; never more workers than the
    ``n_runs`` runs (one beyond them would only be spawned and import Lightning)."""
    threads = torch.get_num_threads()
    workers = min(args.workers or auto_workers(n_runs, threads), max(1, n_runs))
    return workers, max(1, threads // workers)
