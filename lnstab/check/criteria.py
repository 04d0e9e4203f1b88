"""The report card's criteria and their thresholds.

Every criterion is one number that is *worse when larger* (see :data:`CRITERIA`). Its ``warn`` and ``fail``
thresholds are expressions over what the references measured in the same check, so the defaults need no
hand-picked constants: ``peri``/``pre`` are the Peri-LN and Pre-LN references' values, ``peri_sd``/``pre_sd`` their
spread over seeds (the standard error for a fitted slope) and ``sd`` the larger of the two; ``fp16_max``,
``bf16_max`` and ``max``, ``min``, ``abs``, ``log``, ``log10`` are available too. A value above ``fail`` fails, above
``warn`` warns, else passes; ``null`` never triggers. ``absolute`` gives the thresholds used with
``--no-reference`` (or where a reference has no value), so they name no reference; those are the only constants, and
they are documented here.
A ``--thresholds FILE.yaml`` holds any subset of this mapping and overrides it key by key.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lnstab.check.analysis import BF16_MAX, FP16_MAX
from lnstab.errors import LNStabError
from lnstab.safeload import load_yaml

# The default thresholds are package data (lnstab/check/thresholds.yaml): their history is that file's `git log`.
DEFAULT_THRESHOLDS_YAML = (Path(__file__).parent / "thresholds.yaml").read_text(encoding="utf-8")
DEFAULT_THRESHOLDS: dict[str, dict[str, Any]] = yaml.safe_load(DEFAULT_THRESHOLDS_YAML)
NAMES = ("pre", "peri", "pre_sd", "peri_sd", "sd")
CONSTANTS = {"fp16_max": FP16_MAX, "bf16_max": BF16_MAX}


def _nan_aware(fn: Any) -> Any:
    def apply(*args: float) -> float:
        return math.nan if any(math.isnan(a) for a in args) else fn(*args)

    return apply


FUNCTIONS = {"max": _nan_aware(max), "min": _nan_aware(min), "abs": _nan_aware(abs), "log": _nan_aware(math.log),
             "log10": _nan_aware(math.log10)}
MAX_EXPRESSION = 200  # characters of one threshold expression (the defaults need under 30)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@dataclass(frozen=True)
class Criterion:
    """One row of the card: ``value(summary)`` gives ``(value, sd)``; larger is worse."""

    id: str
    title: str
    unit: str


CRITERIA: tuple[Criterion, ...] = (
    Criterion("divergence", "Divergence rate over the learning-rate ladder", "fraction of runs"),
    Criterion("lr_sensitivity", "LR sensitivity over the ladder (Wortsman et al.)", "nats"),
    Criterion("growth_init", "Growth over depth at initialisation", "doublings, deeper half"),
    Criterion("growth_trained", "Growth over depth after stress training", "doublings, deeper half"),
    Criterion("overflow", "Largest |x| (overflow headroom)", "max |x|"),
    Criterion("attention", "Attention-logit growth (largest |q·k|/√d)", "logit"),
    Criterion("log_z", "Output-logit drift (largest |mean log Z|)", "nats"),
    Criterion("sensitivity", "Jacobian sensitivity against activation scale", "log-log slope"),
    Criterion("bound", "Theorem 4 bound (output norms)", "violations"),
    Criterion("grad_spread", "Gradient-norm spread over layers", "log10 max/min"),
    Criterion("loss", "Learns (final loss at best learning rate)", "nats"),
)
IDS = tuple(c.id for c in CRITERIA)


def criterion_value(criterion: str, summary: dict[str, Any]) -> tuple[float, float]:
    """``(value, sd)`` of ``criterion`` in one subject's :func:`~lnstab.check.analysis.summarise` output."""
    s = summary
    if criterion == "divergence":
        return (s["diverged"] / s["runs"] if s["runs"] else math.nan), 0.0
    if criterion in ("growth_init", "growth_trained", "grad_spread", "loss", "lr_sensitivity", "attention", "log_z"):
        return s[criterion]["mean"], s[criterion]["sd"]
    if criterion == "overflow":
        return s["max_abs"], 0.0
    if criterion == "sensitivity":
        return s["sensitivity"]["slope"], s["sensitivity"]["se"]
    if criterion == "bound":
        return float(s["bound"]["violations"]), 0.0
    raise KeyError(criterion)


def check_expression(where: str, text: Any, names: tuple[str, ...] = NAMES, why: str = "") -> None:
    """Refuse anything but numbers, ``null`` and expressions over ``names``, constants and functions (one line:
    ``where``, the value, what is allowed, then ``why``)."""
    if text is None or (isinstance(text, int | float) and not isinstance(text, bool)):
        return
    shown = repr(text) if len(repr(text)) <= 80 else f"{repr(text)[:60]}…({len(str(text))} characters)"
    if not isinstance(text, str):
        raise LNStabError(f"{where}={shown} is not allowed; give a number, null or an expression")
    try:
        evaluate_expression(text, dict.fromkeys(names, 1.0))
    except LNStabError as exc:
        raise LNStabError(f"{where}={shown} is not allowed; {exc}{why if 'are allowed' in str(exc) else ''}"
                          ) from None


def evaluate_expression(text: Any, names: dict[str, float]) -> float | None:
    """The value of a threshold (``None`` for ``null``; ``nan`` when a name it uses has no value)."""
    if text is None:
        return None
    if isinstance(text, int | float):
        return float(text)
    if len(str(text)) > MAX_EXPRESSION:
        raise LNStabError(f"it has {len(str(text))} characters; a threshold expression has at most {MAX_EXPRESSION}")
    try:
        tree = ast.parse(str(text), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):  # also "too many nested parentheses"
        raise LNStabError("it is not an expression") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name) and (node.id in names or node.id in CONSTANTS):
            return float(names.get(node.id, CONSTANTS.get(node.id)))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and node.args and not node.keywords):
            return float(FUNCTIONS[node.func.id](*[ev(a) for a in node.args]))
        allowed = ", ".join((*names, *CONSTANTS, *FUNCTIONS))
        raise LNStabError(f"only numbers, + - * /, and {allowed} are allowed")

    try:
        return ev(tree)
    except LNStabError:  # a ValueError too, but a user's mistake rather than arithmetic
        raise
    except (ValueError, ZeroDivisionError, OverflowError):  # log10 of a negative reference, division by zero
        return math.nan


def load_thresholds(path: str | Path | None) -> dict[str, dict[str, Any]]:
    """The default thresholds with ``path``'s entries (if given) merged over them, checked."""
    merged = {k: {**v, "absolute": dict(v["absolute"])} for k, v in DEFAULT_THRESHOLDS.items()}
    if path is None:
        return merged
    path = Path(path)
    if not path.is_file():
        raise LNStabError(f"--thresholds {path} is not a file")
    data = load_yaml(path, f"--thresholds {path}") or {}  # bounded: size, UTF-8, nesting, aliases
    if not isinstance(data, dict):
        raise LNStabError(f"--thresholds {path} must hold a mapping of criteria; allowed: {', '.join(IDS)}")
    # An absolute threshold is used where no reference has a value (--no-reference, or a reference without one):
    # it cannot name one. Refused here, before any training, rather than when the card is graded.
    no_reference = (" (an absolute threshold is used where no reference has a value, so it cannot name "
                    f"{', '.join(NAMES)})")
    for cid, entry in data.items():
        if cid not in merged:
            raise LNStabError(f"--thresholds {path}: criterion {cid!r} is not allowed; allowed: {', '.join(IDS)}")
        if not isinstance(entry, dict):
            raise LNStabError(f"--thresholds {path}: {cid} must map warn/fail/absolute to thresholds")
        for key, value in entry.items():
            if key == "absolute" and isinstance(value, dict):
                for sub, expr in value.items():
                    if sub not in ("warn", "fail"):
                        raise LNStabError(f"--thresholds {path}: {cid}.absolute.{sub} is not allowed; use warn, fail")
                    check_expression(f"--thresholds {path}: {cid}.absolute.{sub}", expr, (), no_reference)
                    merged[cid]["absolute"][sub] = expr
            elif key == "absolute":
                raise LNStabError(f"--thresholds {path}: {cid}.absolute as a {type(value).__name__} is not allowed; "
                                  "give a mapping of warn and fail")
            elif key in ("warn", "fail"):
                check_expression(f"--thresholds {path}: {cid}.{key}", value)
                merged[cid][key] = value
            else:
                raise LNStabError(f"--thresholds {path}: {cid}.{key} is not allowed; use warn, fail, absolute")
    return merged


def resolve(spec: dict[str, Any], refs: dict[str, tuple[float, float]] | None) -> dict[str, Any]:
    """The numeric ``warn``/``fail`` of one criterion, from the references when they give every name used."""
    names: dict[str, float] = {}
    if refs:
        pre, peri = refs.get("pre-ln", (math.nan, math.nan)), refs.get("peri-ln", (math.nan, math.nan))
        sds = [v for v in (pre[1], peri[1]) if math.isfinite(v)]
        names = {"pre": pre[0], "peri": peri[0], "pre_sd": pre[1], "peri_sd": peri[1],
                 "sd": max(sds) if sds else math.nan}
    out: dict[str, Any] = {}
    for level in ("warn", "fail"):
        expr, value, source = spec.get(level), None, "relative"
        if refs and expr is not None:
            value = evaluate_expression(expr, names)
        if not refs or (value is not None and not math.isfinite(value)):
            expr, source = spec["absolute"].get(level), "absolute"
            value = evaluate_expression(expr, names)
        out[level] = value
        out[f"{level}_rule"] = None if expr is None else str(expr)
        out[f"{level}_source"] = source
    return out


def status(value: float, thresholds: dict[str, Any]) -> str:
    """``fail``, ``warn``, ``pass`` or ``n/a`` (no value)."""
    if not math.isfinite(value):
        return "n/a"
    fail, warn = thresholds.get("fail"), thresholds.get("warn")
    if fail is not None and math.isfinite(fail) and value > fail:
        return "fail"
    if warn is not None and math.isfinite(warn) and value > warn:
        return "warn"
    return "pass"


def overall(statuses: list[str]) -> str:
    """``fail`` if any row fails, else ``warn`` if any warns, else ``pass``."""
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
