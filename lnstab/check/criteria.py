"""The report card's criteria, one :class:`Criterion` record each in :data:`CRITERIA`, and their thresholds.

The thresholds are data (``thresholds.yaml``; ``--thresholds`` overrides them key by key): numbers or expressions over
what the references measured in the same check (docs/check/README.md, Criteria). Above ``fail`` fails, above ``warn``
warns, else passes; ``null`` never triggers.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lnstab.errors import LNStabError
from lnstab.formatting import card_quote, card_short
from lnstab.measures import BF16_MAX, FP16_MAX
from lnstab.safeload import load_yaml
from lnstab.validation import is_number

NAMES = ("pre", "peri", "pre_sd", "peri_sd", "sd")
OWN = ("loss_init",)  # the checked model's own numbers: an absolute threshold may name them (no reference needed)
CONSTANTS = {"fp16_max": FP16_MAX, "bf16_max": BF16_MAX}
# each function with the fewest and most arguments it takes (None: no most); a nan argument gives nan
FUNCTIONS = {"max": (max, 2, None), "min": (min, 2, None), "abs": (abs, 1, 1), "log": (math.log, 1, 2),
             "log10": (math.log10, 1, 1)}
MAX_EXPRESSION = 200  # characters of one threshold expression (the defaults need under 30)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


Summary = dict[str, Any]  # one subject's :func:`~lnstab.check.analysis.summarise` output


@dataclass(frozen=True)
class Criterion:
    """One row of the card, all of it in one place (its thresholds are data: ``thresholds.yaml``).

    Args:
        id: The key of the row in ``thresholds.yaml``, ``report.json`` and ``--compare``.
        value: ``(value, sd)`` of one subject's summary, in ``unit``; larger is always worse.
        explain: The sentence for a finite value, from ``(summary, value, sd, references' summaries)``.
        missing: The sentence for a value that is not finite, from ``(summary, sites)`` (``None``: ``explain``'s).
        quote: How a reference's value is quoted after the sentence (``None``: not quoted).
        phrases: How the value reads near a reference (``{ref}``), below both, above both (``None``: not compared).
        factor_base: A log-scale value reads as the factor ``factor_base ** value`` (decades: 10, doublings: 2).
        show: The value as the card and the validation notes read it (``None``: see :func:`display`).
        mechanism: Why it warns and never fails, said on a warning when ``thresholds.yaml`` makes it a mechanism.
    """

    id: str
    title: str
    unit: str
    value: Callable[[Summary], tuple[float, float]]
    explain: Callable[[Summary, float, float, dict[str, Summary]], str]
    missing: Callable[[Summary, dict[str, Any]], str] | None = None
    quote: Callable[[Summary], str] | None = None
    phrases: tuple[str, str, str] | None = None
    factor_base: float | None = None
    show: Callable[[float], str] | None = None
    mechanism: str = ("a mechanism, so it warns and never fails: only outcomes (divergence, loss, LR sensitivity) "
                      "fail")

    def as_factor(self, value: float) -> float:
        """A log-scale value as the factor the card reads (``×2.1e6`` for a spread of 6.32 decades)."""
        return self.factor_base ** value if self.factor_base else value


LABELS = {"pre-ln": "Pre-LN", "peri-ln": "Peri-LN"}
# A collapsed-row fraction within this of the references' reads "as the references" (wording, not a threshold).
COLLAPSED_AS_MUCH = 0.05


def _mean(cid: str) -> Callable[[Summary], tuple[float, float]]:
    return lambda s: (s[cid]["mean"], s[cid]["sd"])


def _all_diverged(s: Summary, what: str) -> str:
    return "every run diverged" if s["diverged"] == s["runs"] else what


def _divergence(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    text = f"{s['diverged']} of {s['runs']} runs diverged"
    if s["first_bad"]:
        fb = min(s["first_bad"], key=lambda f: (f["lr"], f["step"] if f["step"] is not None else 1 << 30))
        where = f" in {fb['layer']}" if fb.get("layer") else ""
        text += f", first at lr {fb['lr']:g} (seed {fb['seed']}) step {fb['step']}{where} ({fb['kind']})"
    return text


def _learned_nothing(ls: dict[str, Any]) -> bool:
    """No rung took the loss below its initial value: L* = L_init, so the sensitivity is 0 whatever the model does."""
    return math.isfinite(ls.get("best", math.nan)) and ls["best"] >= ls["initial"]


def _lr_sensitivity_value(s: Summary) -> tuple[float, float]:
    ls = s["lr_sensitivity"]
    return (math.nan, math.nan) if _learned_nothing(ls) else (ls["mean"], ls["sd"])


def _lr_sensitivity_missing(s: Summary, sites: dict[str, Any]) -> str:
    ls = s["lr_sensitivity"]
    if _learned_nothing(ls):
        return (f"no learning rate took the loss below its initial {card_short(ls['initial'], 4)} (best "
                f"{card_short(ls['best'], 4)} at lr {ls['best_lr']:g}): a model that learns nothing loses nothing over "
                "the ladder, so its sensitivity is not graded (see Learns)")
    return "needs at least two learning rates (--lrs)" if len(ls["points"]) < 2 else "no initial loss"


def _lr_sensitivity(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    ls = s["lr_sensitivity"]
    ladder = ", ".join(f"{float(lr):g}: {card_short(v, 4)}" for lr, v in ls["points"].items())
    return (f"mean over the ladder of min(L, L_init) − L* = {value:.3f} nats (L_init {card_short(ls['initial'], 4)}; "
            f"min(L, L_init) by lr {ladder}; a diverged run counts as L_init)")


def _growth(cid: str, title: str) -> Criterion:
    """``growth_init`` or ``growth_trained``: the doublings of mean |x| over the deeper half of the depth."""
    trained = cid == "growth_trained"

    def skipped(s: Summary) -> str:
        return (f"{s[cid]['unmeasured']} run(s) not measured {'after training' if trained else 'at initialisation'}: "
                "a block did not run at that step (a branch that skips blocks in training, such as LayerDrop), or a "
                "looped one ran another number of times") if s[cid].get("unmeasured") else ""

    def missing(s: Summary, sites: dict[str, Any]) -> str:
        if trained and s["diverged"] == s["runs"]:
            return "every run diverged"
        skip = skipped(s)
        return (f"{skip}, and no other run fits a growth law" if skip
                else "fewer than two layer sites to fit a growth law over depth")

    def explain(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
        g, skip = s[cid], skipped(s)
        at = f" at lr {g['lr']:g}" if trained and g.get("lr") is not None else ""
        text = (f"mean |x| grows ×{2.0 ** value:.3g} over the deeper half{at} (linear from 0: ×2); "
                f"{g['law']} law fits better (R² {card_short(g['exp_r2'], 2)} exponential at "
                f"×{card_short(math.exp(g['exp_rate']))}/layer, {card_short(g['lin_r2'], 2)} linear)")
        return text + (f" ({skip}; the others are graded)" if skip else "")

    return Criterion(cid, title, "doublings, deeper half", value=_mean(cid), explain=explain, missing=missing,
                     quote=lambda r: f"×{card_short(2.0 ** r[cid]['mean'])}",
                     phrases=("grows like {ref}", "grows slower than both references",
                              "grows faster than both references"), factor_base=2.0)


def _overflow(s: Summary, peak: float, sd: float, refs: dict[str, Summary]) -> str:
    head = (f"{FP16_MAX / peak:.3g}× below fp16's max" if peak < FP16_MAX else
            f"{peak / FP16_MAX:.3g}× above fp16's max 65504")
    return f"largest |x| {peak:.3g}: {head}, {BF16_MAX / peak:.2g}× below bf16's"


def _attention_missing(s: Summary, sites: dict[str, Any]) -> str:
    if not sites.get("attention", True):
        return ("q and k were not found (lnstab's GPT, Hugging Face GPT-2, Llama, Gemma, Mistral, Mixtral, Qwen2/3, "
                "Gemma 2/3, OLMo and OLMo 2 are recognised; name a factory model's with --q-pattern, --k-pattern and "
                "--n-head), so the attention logits were not measured")
    return _all_diverged(s, "no attention logits were measured")


def _collapsed(a: dict[str, Any], refs: dict[str, Summary]) -> str:
    """The checked model's largest collapsed-row fraction beside the references' (``as the references`` when they
    collapse as much: a PASS beside 95 % collapsed rows is then what the references do too)."""
    theirs = {k: r["attention"]["collapsed"] for k, r in refs.items()
              if k in LABELS and math.isfinite(r["attention"].get("collapsed", math.nan))}
    text = f"largest collapsed-row fraction {card_short(a['collapsed'], 2)}"
    if not theirs or not math.isfinite(a["collapsed"]):
        return text
    if a["collapsed"] > max(theirs.values()) + COLLAPSED_AS_MUCH:
        word = "more than the references"
    elif a["collapsed"] < min(theirs.values()) - COLLAPSED_AS_MUCH:
        word = "less than the references"
    else:
        word = "as the references"
    return f"{text}, {word} ({', '.join(f'{LABELS[k]} {card_short(v, 2)}' for k, v in theirs.items())})"


def _attention(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    a = s["attention"]
    return (f"largest |q·k|/√d {value:.3g} at lr {a['lr']:g} (from {card_short(a['init'])} at initialisation); "
            f"{_collapsed(a, refs)}, smallest row entropy {card_short(a['entropy_min'], 2)} nats; "
            f"{a['events']} attention_collapse events")


def _log_z_missing(s: Summary, sites: dict[str, Any]) -> str:
    if not sites.get("logits", True):
        return "the output logits were not found (an lm_head, or --head-pattern), so log Z was not measured"
    return _all_diverged(s, "log Z was not measured")


def _log_z(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    z = s["log_z"]
    return (f"largest |mean log Z| {value:.3g} at lr {z['lr']:g} after initialisation (log Z "
            f"{card_short(z['init'])} at initialisation); {z['events']} logit_drift events")


def _sensitivity_missing(s: Summary, sites: dict[str, Any]) -> str:
    return ("no blocks were probed" if not s["sensitivity"]["points"] else
            "activation scale does not vary enough over layers to fit a slope")


def _sensitivity(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    return (f"slope {value:+.2f} ± {card_short(sd, 2)} over {len(s['sensitivity']['points'])} blocks×measurements "
            "(−1: scale-invariant blocks, ≥ 0: sensitivity does not fall as activations grow)")


def _bound_missing(s: Summary, sites: dict[str, Any]) -> str:
    if sites.get("bound_unchecked"):
        return (f"output norms were located but not checked: {sites['bound_unchecked']} (give a layer pattern at the "
                "residual updates, or norms that match them one to one)")
    where = (f"no output norms matched {sites['norm_pattern']}" if sites.get("norm_pattern") else
             "no output norms were located (lnstab's placements with output norms, Hugging Face Gemma 2/3 and OLMo 2, "
             "or --norm-pattern)")
    return f"{where}, so Theorem 4 does not apply (it needs one output norm per residual update)"


def _bound(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    verdict = "holds, as Theorem 4 says" if value == 0 else "is violated"
    return (f"MA(X_D) ≤ RMS(X_0) + ΣΔt(γmax+βmax) {verdict}: {int(value)} violations, smallest slack "
            f"{card_short(s['bound']['min_slack'])}")


def _grad_spread_missing(s: Summary, sites: dict[str, Any]) -> str:
    if sites.get("param_pattern", "") is None:
        return "no per-layer gradient norms (block names need a numeric index, e.g. layers.3)"
    return _all_diverged(s, "no per-layer gradient norms were measured")


def _grad_spread(s: Summary, value: float, sd: float, refs: dict[str, Summary]) -> str:
    return (f"per-layer gradient norms span ×{10.0 ** value:.3g} (median over steps, worst at lr "
            f"{s['grad_spread']['lr']:g})")


CRITERIA: tuple[Criterion, ...] = (
    Criterion("divergence", "Divergence rate over the learning-rate ladder", "fraction of runs",
              value=lambda s: ((s["diverged"] / s["runs"] if s["runs"] else math.nan), 0.0), explain=_divergence,
              quote=lambda r: f"{r['diverged']}/{r['runs']}",
              phrases=("diverges as often as {ref}", "diverges less often than both references",
                       "diverges more often than both references"), show=lambda v: f"{v:.0%}"),
    Criterion("lr_sensitivity", "LR sensitivity over the ladder (Wortsman et al.)", "nats",
              value=_lr_sensitivity_value, explain=_lr_sensitivity, missing=_lr_sensitivity_missing,
              quote=lambda r: card_short(r["lr_sensitivity"]["mean"]),
              phrases=("as sensitive to the learning rate as {ref}", "less sensitive to the learning rate than both "
                       "references", "more sensitive to the learning rate than both references")),
    _growth("growth_init", "Growth over depth at initialisation"),
    _growth("growth_trained", "Growth over depth after stress training"),
    Criterion("overflow", "Largest |x| (overflow headroom)", "max |x|", value=lambda s: (s["max_abs"], 0.0),
              explain=_overflow,
              missing=lambda s, sites: "no run completed, so no finite activations to compare with fp16/bf16",
              quote=lambda r: card_short(r["max_abs"]),
              phrases=("peaks like {ref}", "peaks lower than both references", "peaks higher than both references")),
    Criterion("attention", "Attention-logit growth (largest |q·k|/√d)", "logit", value=_mean("attention"),
              explain=_attention, missing=_attention_missing, quote=lambda r: card_short(r["attention"]["mean"]),
              phrases=("attention logits grow like {ref}", "attention logits stay smaller than both references'",
                       "attention logits grow larger than both references'")),
    Criterion("log_z", "Output-logit drift (largest |mean log Z|)", "nats", value=_mean("log_z"), explain=_log_z,
              missing=_log_z_missing, quote=lambda r: card_short(r["log_z"]["mean"]),
              phrases=("log Z drifts like {ref}", "log Z stays nearer 0 than both references'",
                       "log Z drifts further from 0 than both references'"), show=lambda v: card_quote(v, 3)),
    Criterion("sensitivity", "Jacobian sensitivity against activation scale", "log-log slope",
              value=lambda s: (s["sensitivity"]["slope"], s["sensitivity"]["se"]), explain=_sensitivity,
              missing=_sensitivity_missing, quote=lambda r: f"{r['sensitivity']['slope']:+.2f}",
              phrases=("{insensitive} to activation scale", "loses sensitivity with scale faster than both references",
                       "keeps more sensitivity at large scale than both references"),
              show=lambda v: f"{v:+.2f}".replace("-", "−")),
    Criterion("bound", "Theorem 4 bound (output norms)", "violations",
              value=lambda s: (float(s["bound"]["violations"]), 0.0), explain=_bound, missing=_bound_missing,
              show=lambda v: f"{v:.0f}"),
    Criterion("grad_spread", "Gradient-norm spread over layers", "log10 max/min", value=_mean("grad_spread"),
              explain=_grad_spread, missing=_grad_spread_missing,
              quote=lambda r: f"×{card_short(10.0 ** r['grad_spread']['mean'])}",
              phrases=("spreads gradients like {ref}", "spreads gradients less than both references",
                       "spreads gradients more than both references"), factor_base=10.0,
              mechanism="a mechanism, so it warns and never fails: unbalanced gradients are not the root cause of "
                        "instability (Liu et al. 2020), the scale of the model update is (DeepNet §3)"),
    Criterion("loss", "Learns (final loss at best learning rate)", "nats", value=_mean("loss"),
              explain=lambda s, v, sd, refs: f"final loss {v:.3f} at lr {s['loss']['lr']:g} (from "
                                             f"{card_short(s['loss_init'], 4)} at initialisation)",
              missing=lambda s, sites: "every run diverged", quote=lambda r: card_short(r["loss"]["mean"], 4),
              phrases=("learns like {ref}", "learns faster than both references", "learns slower than both references"),
              show=lambda v: f"{v:.2f}"),
)
IDS = tuple(c.id for c in CRITERIA)
BY_ID: dict[str, Criterion] = {c.id: c for c in CRITERIA}
KINDS = ("outcome", "mechanism")


def refuse_mechanism_fail(where: str, cid: str, thresholds: dict[str, dict[str, Any]]) -> None:
    """Only an outcome criterion can fail: a ``fail`` threshold (relative or absolute) on a mechanism is refused in
    one line naming ``where`` and the criterion (``thresholds``: every criterion's, with its ``kind``)."""
    entry = thresholds[cid]
    if entry.get("kind") != "mechanism":
        return
    outcomes = ", ".join(k for k, v in thresholds.items() if isinstance(v, dict) and v.get("kind") == "outcome")
    for key, value in (("fail", entry.get("fail")), ("absolute.fail", (entry.get("absolute") or {}).get("fail"))):
        if value is not None:
            raise LNStabError(f"{where}: {cid}.{key}={value!r} is not allowed; {cid} is a mechanism criterion, which "
                              f"warns and never fails (only outcome criteria fail: {outcomes}); "
                              "give null or a warn threshold")


def read_defaults(path: str | Path) -> dict[str, dict[str, Any]]:
    """The package's thresholds file, checked: every criterion once, each with its ``kind`` (``outcome`` or
    ``mechanism``) and no ``fail`` threshold on a mechanism."""
    data = load_yaml(Path(path), str(path))
    if not isinstance(data, dict) or set(data) != set(IDS):
        raise LNStabError(f"{path} must map every criterion ({', '.join(IDS)}) and no other to its thresholds")
    for cid, entry in data.items():
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind not in KINDS:
            raise LNStabError(f"{path}: {cid}.kind={kind!r} is not allowed; use {', '.join(KINDS)}")
        refuse_mechanism_fail(str(path), cid, data)
    return data


# The default thresholds are package data (lnstab/check/thresholds.yaml): their history is that file's `git log`.
DEFAULT_PATH = Path(__file__).parent / "thresholds.yaml"
DEFAULT_THRESHOLDS: dict[str, dict[str, Any]] = read_defaults(DEFAULT_PATH)


def display(cid: str, value: float | None) -> str:
    """A criterion's value as the card reads it: spreads and growth as factors, losses in nats to 0.01."""
    if value is None or not math.isfinite(value):
        return "n/a"
    criterion = BY_ID.get(cid)
    if criterion and criterion.show:
        return criterion.show(value)
    return "×" + card_quote(criterion.as_factor(value)) if criterion and criterion.factor_base else card_quote(value, 2)


def check_expression(where: str, text: Any, names: tuple[str, ...] = NAMES + OWN, why: str = "") -> None:
    """Refuse anything but numbers, ``null`` and expressions over ``names``, constants and functions (one line:
    ``where``, the value, what is allowed, then ``why``)."""
    shown = repr(text) if len(repr(text)) <= 80 else f"{repr(text)[:60]}…({len(str(text))} characters)"
    if isinstance(text, float) and not math.isfinite(text):  # YAML's .nan/.inf: it was swapped for the absolute one
        raise LNStabError(f"{where}={shown} is not allowed; give a finite number, null or an expression")
    if text is None or is_number(text):
        return
    if not isinstance(text, str):
        raise LNStabError(f"{where}={shown} is not allowed; give a number, null or an expression")
    try:
        value = evaluate_expression(text, dict.fromkeys(names, 1.0))
    except LNStabError as exc:
        raise LNStabError(f"{where}={shown} is not allowed; {exc}{why if 'are allowed' in str(exc) else ''}"
                          ) from None
    uses = {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)} & set(NAMES + OWN)
    if not uses and (value is None or not math.isfinite(value)):  # 1/0, log(0): it would silently grade nothing
        raise LNStabError(f"{where}={shown} is not allowed; it is {value} (not a finite number); give a finite "
                          "number, null or an expression")


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
        if isinstance(node, ast.Constant) and is_number(node.value):
            return float(node.value)
        if isinstance(node, ast.Name) and (node.id in names or node.id in CONSTANTS):
            return float(names.get(node.id, CONSTANTS.get(node.id)))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and node.args and not node.keywords):
            fn, low, high = FUNCTIONS[node.func.id]
            if not low <= len(node.args) <= (high or len(node.args)):
                takes = f"{low}" if low == high else f"{low} to {high}" if high else f"{low} or more"
                raise LNStabError(f"{node.func.id}() takes {takes} argument{'s' * (takes != '1')}, not "
                                  f"{len(node.args)}")
            args = [ev(a) for a in node.args]
            return math.nan if any(math.isnan(a) for a in args) else float(fn(*args))
        allowed = ", ".join((*names, *CONSTANTS, *FUNCTIONS))
        raise LNStabError(f"only numbers, + - * /, and {allowed} are allowed")

    try:
        return ev(tree.body)
    except LNStabError:  # a ValueError too, but a user's mistake rather than arithmetic
        raise
    except (ValueError, ZeroDivisionError, OverflowError):  # log10 of a negative reference, division by zero
        return math.nan


def load_thresholds(path: str | Path | None, base: dict[str, dict[str, Any]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """The default thresholds (or ``base``, a tier's) with ``path``'s entries (if given) merged over them, checked."""
    merged = {k: {**v, "absolute": dict(v["absolute"])} for k, v in (base or DEFAULT_THRESHOLDS).items()}
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
                    check_expression(f"--thresholds {path}: {cid}.absolute.{sub}", expr, OWN, no_reference)
                    merged[cid]["absolute"][sub] = expr
            elif key == "absolute":
                raise LNStabError(f"--thresholds {path}: {cid}.absolute as a {type(value).__name__} is not allowed; "
                                  "give a mapping of warn and fail")
            elif key in ("warn", "fail"):
                check_expression(f"--thresholds {path}: {cid}.{key}", value)
                merged[cid][key] = value
            elif key == "kind":  # a card's thresholds.yaml given back says it; it cannot change it
                if value != merged[cid]["kind"]:
                    raise LNStabError(f"--thresholds {path}: {cid}.kind={value!r} is not allowed; {cid}'s kind is "
                                      f"{merged[cid]['kind']!r} (lnstab/check/thresholds.yaml), which a thresholds "
                                      "file cannot change")
            else:
                raise LNStabError(f"--thresholds {path}: {cid}.{key} is not allowed; use warn, fail, absolute")
        refuse_mechanism_fail(f"--thresholds {path}", cid, merged)
        refuse_warn_above_fail(f"--thresholds {path}", cid, merged[cid])
    return merged


def refuse_warn_above_fail(where: str, cid: str, spec: dict[str, Any]) -> None:
    """Two numbers with ``warn`` above ``fail`` leave no value that warns: refused (equal ones mean no warning band,
    as divergence's defaults may)."""
    for prefix, pair in ((cid, spec), (f"{cid}.absolute", spec["absolute"])):
        warn, fail = pair.get("warn"), pair.get("fail")
        if is_number(warn) and is_number(fail) and warn > fail:
            raise LNStabError(f"{where}: {prefix}.warn={warn} is not allowed above {prefix}.fail={fail}; a warn "
                              "threshold must be at most the fail threshold (equal: no warning band), or null")


def resolve(spec: dict[str, Any], refs: dict[str, tuple[float, float]] | None,
            own: dict[str, float] | None = None) -> dict[str, Any]:
    """The numeric ``warn``/``fail`` of one criterion, from the references when they give every name used; ``own``:
    the checked model's :data:`OWN` numbers (``nan`` where not given)."""
    names: dict[str, float] = {k: math.nan for k in OWN} | (own or {})
    if refs:
        pre, peri = refs.get("pre-ln", (math.nan, math.nan)), refs.get("peri-ln", (math.nan, math.nan))
        sds = [v for v in (pre[1], peri[1]) if math.isfinite(v)]
        names |= {"pre": pre[0], "peri": peri[0], "pre_sd": pre[1], "peri_sd": peri[1],
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
    if all(out[level] is not None and math.isfinite(out[level]) for level in ("warn", "fail")) and \
            out["warn"] >= out["fail"]:  # no warning band (divergence where Peri-LN diverges as often as Pre-LN)
        out["warn"] = out["warn_rule"] = None
    return out


def status(value: float, thresholds: dict[str, Any]) -> str:
    """``fail``, ``warn``, ``pass`` or ``n/a`` (no value)."""
    if not math.isfinite(value):
        return "n/a"
    for level in ("fail", "warn"):
        limit = thresholds.get(level)
        if limit is not None and math.isfinite(limit) and value > limit:
            return level
    return "pass"


def overall(statuses: list[str]) -> str:
    """``fail`` if any row fails, else ``warn`` if any warns, else ``pass``."""
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
