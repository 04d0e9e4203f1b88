"""The rows of the report card: each criterion's value, the references' values, thresholds, status and why."""

from __future__ import annotations

import math
from typing import Any

from lnstab.check.analysis import BF16_MAX, FP16_MAX
from lnstab.check.criteria import CRITERIA, criterion_value, resolve, status

# How each criterion reads when the checked model sits near a reference, below both, above both.
PHRASES: dict[str, tuple[str, str, str]] = {
    "divergence": ("diverges as often as {ref}", "diverges less often than both references",
                   "diverges more often than both references"),
    "growth_init": ("grows like {ref}", "grows slower than both references", "grows faster than both references"),
    "growth_trained": ("grows like {ref}", "grows slower than both references",
                       "grows faster than both references"),
    "overflow": ("peaks like {ref}", "peaks lower than both references", "peaks higher than both references"),
    "lr_sensitivity": ("as sensitive to the learning rate as {ref}", "less sensitive to the learning rate than both "
                       "references", "more sensitive to the learning rate than both references"),
    "attention": ("attention logits grow like {ref}", "attention logits stay smaller than both references'",
                  "attention logits grow larger than both references'"),
    "log_z": ("log Z drifts like {ref}", "log Z stays nearer 0 than both references'",
              "log Z drifts further from 0 than both references'"),
    "sensitivity": ("{insensitive} to activation scale", "loses sensitivity with scale faster than both references",
                    "keeps more sensitivity at large scale than both references"),
    "grad_spread": ("spreads gradients like {ref}", "spreads gradients less than both references",
                    "spreads gradients more than both references"),
    "loss": ("learns like {ref}", "learns faster than both references", "learns slower than both references"),
}
LABELS = {"pre-ln": "Pre-LN", "peri-ln": "Peri-LN"}
# Criteria measured on a log scale and read as a factor: gradient spread in decades, growth in doublings.
FACTOR_BASES = {"grad_spread": 10.0, "growth_init": 2.0, "growth_trained": 2.0}


def as_factor(cid: str, value: float) -> float:
    """A log-scale criterion's value as the factor the card reads (``×2.1e6`` for a spread of 6.32 decades)."""
    return FACTOR_BASES[cid] ** value


def relation(cid: str, value: float, sd: float, refs: dict[str, tuple[float, float]]) -> str:
    """``grows like Pre-LN`` / ``… than both references`` / ``between Peri-LN and Pre-LN`` (empty without refs)."""
    finite = {k: v for k, v in refs.items() if math.isfinite(v[0])}
    if cid not in PHRASES or not finite or not math.isfinite(value):
        return ""
    near, low, high = PHRASES[cid]
    margin = 2 * max([0.0] + [v[1] for v in finite.values() if math.isfinite(v[1])])  # as the default thresholds
    tolerance = max(margin, 1e-12 * max(1.0, abs(value)))
    distance = {k: abs(value - v[0]) for k, v in finite.items()}
    close = sorted((k for k in finite if distance[k] <= tolerance), key=distance.get)
    if close:
        ref = "both references" if len(close) == 2 else LABELS[close[0]]
        insensitive = {"both references": "responds like both references", "Pre-LN": "as sensitive as Pre-LN",
                       "Peri-LN": "as insensitive as Peri-LN"}[ref]
        return near.format(ref=ref, insensitive=insensitive)
    if value < min(v[0] for v in finite.values()):
        return low
    if value > max(v[0] for v in finite.values()):
        return high
    return "between " + " and ".join(LABELS[k] for k in sorted(finite, key=lambda k: finite[k][0]))


def fmt(value: float, digits: int = 3) -> str:
    """A short number (``n/a`` for ``nan``)."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}g}"


def _refs_text(cid: str, refs: dict[str, dict[str, Any]], show: Any) -> str:
    parts = [f"{LABELS[k]} {show(s)}" for k, s in refs.items()]
    return f" ({', '.join(parts)})" if parts else ""


def why(cid: str, s: dict[str, Any], refs: dict[str, dict[str, Any]], value: float, sd: float,
        rel: str, sites: dict[str, Any]) -> str:
    """One sentence saying what was measured and how it compares."""
    tail = f"; {rel}" if rel else ""
    if cid == "divergence":
        text = f"{s['diverged']} of {s['runs']} runs diverged"
        if s["first_bad"]:
            fb = min(s["first_bad"], key=lambda f: (f["lr"], f["step"] if f["step"] is not None else 1 << 30))
            where = f" in {fb['layer']}" if fb.get("layer") else ""
            text += f", first at lr {fb['lr']:g} (seed {fb['seed']}) step {fb['step']}{where} ({fb['kind']})"
        return text + tail + _refs_text(cid, refs, lambda r: f"{r['diverged']}/{r['runs']}")
    if cid in ("growth_init", "growth_trained"):
        g = s[cid]
        when = "after training" if cid == "growth_trained" else "at initialisation"
        skipped = (f"{g['unmeasured']} run(s) not measured {when}: a block did not run at that step (a branch that "
                   "skips blocks in training, such as LayerDrop), or a looped one ran another number of times"
                   ) if g.get("unmeasured") else ""
        if not math.isfinite(value):
            if cid == "growth_trained" and s["diverged"] == s["runs"]:
                return "every run diverged"
            return (f"{skipped}, and no other run fits a growth law" if skipped
                    else "fewer than two layer sites to fit a growth law over depth")
        at = f" at lr {g['lr']:g}" if cid == "growth_trained" and g.get("lr") is not None else ""
        text = (f"mean |x| grows ×{as_factor(cid, value):.3g} over the deeper half{at} (linear from 0: ×2); "
                f"{g['law']} law fits better (R² {fmt(g['exp_r2'], 2)} exponential at ×{fmt(math.exp(g['exp_rate']))}"
                f"/layer, {fmt(g['lin_r2'], 2)} linear)")
        text += f" ({skipped}; the others are graded)" if skipped else ""
        return text + tail + _refs_text(cid, refs, lambda r: f"×{fmt(as_factor(cid, r[cid]['mean']))}")
    if cid == "overflow":
        if not math.isfinite(value):
            return "no run completed, so no finite activations to compare with fp16/bf16"
        peak = value
        head = (f"{FP16_MAX / peak:.3g}× below fp16's max" if peak < FP16_MAX else
                f"{peak / FP16_MAX:.3g}× above fp16's max 65504")
        text = f"largest |x| {peak:.3g}: {head}, {BF16_MAX / peak:.2g}× below bf16's"
        return text + tail + _refs_text(cid, refs, lambda r: fmt(r["max_abs"]))
    if cid == "sensitivity":
        if not math.isfinite(value):
            return ("no blocks were probed" if not s["sensitivity"]["points"] else
                    "activation scale does not vary enough over layers to fit a slope")
        n = len(s["sensitivity"]["points"])
        text = (f"slope {value:+.2f} ± {fmt(sd, 2)} over {n} blocks×measurements "
                "(−1: scale-invariant blocks, ≥ 0: sensitivity does not fall as activations grow)")
        return text + tail + _refs_text(cid, refs, lambda r: f"{r['sensitivity']['slope']:+.2f}")
    if cid == "bound":
        if not math.isfinite(value):
            if sites.get("bound_unchecked"):
                return (f"output norms were located but not checked: {sites['bound_unchecked']} (give a layer "
                        "pattern at the residual updates, or norms that match them one to one)")
            where = (f"no output norms matched {sites['norm_pattern']}" if sites.get("norm_pattern") else
                     "no output norms were located (lnstab's placements with output norms, Hugging Face Gemma 2/3 and "
                     "OLMo 2, or --norm-pattern)")
            return f"{where}, so Theorem 4 does not apply (it needs one output norm per residual update)"
        slack = s["bound"]["min_slack"]
        verdict = "holds, as Theorem 4 says" if value == 0 else "is violated"
        return f"MA(X_D) ≤ RMS(X_0) + ΣΔt(γmax+βmax) {verdict}: {int(value)} violations, smallest slack {fmt(slack)}"
    if cid == "lr_sensitivity":
        ls = s["lr_sensitivity"]
        if not math.isfinite(value):
            return "needs at least two learning rates (--lrs)" if len(ls["points"]) < 2 else "no initial loss"
        ladder = ", ".join(f"{float(lr):g}: {fmt(v, 4)}" for lr, v in ls["points"].items())
        text = (f"mean over the ladder of min(L, L_init) − L* = {value:.3f} nats (L_init {fmt(ls['initial'], 4)}; "
                f"min(L, L_init) by lr {ladder}; a diverged run counts as L_init)")
        return text + tail + _refs_text(cid, refs, lambda r: fmt(r["lr_sensitivity"]["mean"]))
    if cid == "attention":
        a = s["attention"]
        if not math.isfinite(value):
            if not sites.get("attention", True):
                return ("q and k were not found (lnstab's GPT, Hugging Face GPT-2, Llama, Gemma, Mistral, Mixtral, "
                        "Qwen2/3, Gemma 2/3, OLMo and OLMo 2 are recognised; name a factory model's with --q-pattern, "
                        "--k-pattern and --n-head), so the attention logits were not measured")
            return "every run diverged" if s["diverged"] == s["runs"] else "no attention logits were measured"
        text = (f"largest |q·k|/√d {value:.3g} at lr {a['lr']:g} (from {fmt(a['init'])} at initialisation); largest "
                f"collapsed-row fraction {fmt(a['collapsed'], 2)}, smallest row entropy {fmt(a['entropy_min'], 2)} "
                f"nats; {a['events']} attention_collapse events")
        return text + tail + _refs_text(cid, refs, lambda r: fmt(r["attention"]["mean"]))
    if cid == "log_z":
        z = s["log_z"]
        if not math.isfinite(value):
            if not sites.get("logits", True):
                return "the output logits were not found (an lm_head, or --head-pattern), so log Z was not measured"
            return "every run diverged" if s["diverged"] == s["runs"] else "log Z was not measured"
        text = (f"largest |mean log Z| {value:.3g} at lr {z['lr']:g} after initialisation (log Z {fmt(z['init'])} at "
                f"initialisation); {z['events']} logit_drift events")
        return text + tail + _refs_text(cid, refs, lambda r: fmt(r["log_z"]["mean"]))
    if cid == "grad_spread":
        if not math.isfinite(value):
            if sites.get("param_pattern", "") is None:
                return "no per-layer gradient norms (block names need a numeric index, e.g. layers.3)"
            return "every run diverged" if s["diverged"] == s["runs"] else "no per-layer gradient norms were measured"
        text = (f"per-layer gradient norms span ×{as_factor(cid, value):.3g} (median over steps, worst at lr "
                f"{s[cid]['lr']:g})")
        return text + tail + _refs_text(cid, refs, lambda r: f"×{fmt(as_factor(cid, r[cid]['mean']))}")
    if cid == "loss":
        if not math.isfinite(value):
            return "every run diverged"
        text = f"final loss {value:.3f} at lr {s['loss']['lr']:g} (from {fmt(s['loss_init'], 4)} at initialisation)"
        return text + tail + _refs_text(cid, refs, lambda r: fmt(r["loss"]["mean"], 4))
    raise KeyError(cid)


def build_rows(summaries: dict[str, dict[str, Any]], thresholds: dict[str, dict[str, Any]],
               sites: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per criterion for the subject ``checked`` against the others in ``summaries``."""
    checked = summaries["checked"]
    ref_summaries = {k: v for k, v in summaries.items() if k != "checked"}
    rows = []
    for criterion in CRITERIA:
        cid = criterion.id
        value, sd = criterion_value(cid, checked)
        refs = {k: criterion_value(cid, v) for k, v in ref_summaries.items()}
        limits = resolve(thresholds[cid], refs or None)
        verdict = status(value, limits)
        rel = relation(cid, value, sd, refs)
        rows.append({
            "id": cid,
            "title": criterion.title,
            "unit": criterion.unit,
            "measured": value,
            "sd": sd,
            "references": {k: v[0] for k, v in refs.items()},
            **limits,
            "status": verdict,
            "why": why(cid, checked, ref_summaries, value, sd, rel, sites),
        })
    return rows
