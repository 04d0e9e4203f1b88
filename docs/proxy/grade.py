"""Grade the proxy grid's pre-registered claims (docs/proxy/preregistration.yaml) from its run directories.

    python docs/proxy/grade.py runs/proxy-designs > docs/proxy/designs/verdicts.md

Prints one Markdown table: claim, source, what was measured, verdict, and why, each rule as the pre-registration
words it (its ``rule`` text is quoted beside the numbers). Designs are named by their grid label, read from the run
directory names (``<design>_lr<rate>_s<seed>``). Nothing here is tuned: thresholds come from the pre-registration.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from lnstab.report.collect import collect
from lnstab.report.ladder import designs, welch_interval
from lnstab.report.logits import logit_metrics
from lnstab.safeload import load_yaml

PREREG = Path(__file__).with_name("preregistration.yaml")


def by_label(records: list) -> tuple[dict, str]:
    """``({grid label: Design}, lr key)``; a design's label is its runs' name up to ``_lr``."""
    key, _keys, found = designs(records)
    out = {}
    for design in found:
        labels = {r.name.rsplit("_lr", 1)[0] for r in design.runs}
        if len(labels) != 1:
            raise SystemExit(f"grade: a configuration spans run names {sorted(labels)}; expected one grid label")
        out[labels.pop()] = design
    return out, key


def interval(d: tuple[float, float, float]) -> str:
    return f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"


def sign(d: tuple[float, float, float]) -> int:
    """+1 when Welch's interval lies above 0, -1 below, 0 when it spans 0."""
    return 1 if d[1] > 0 else -1 if d[2] < 0 else 0


def sens(design) -> str:
    s = design.sensitivities()
    return f"{statistics.fmean(s):.3f}"


def diverged(design, key: str) -> dict[float, tuple[int, int]]:
    """Per rate: (diverged runs, runs)."""
    out = {}
    for lr in sorted({r.config.get(key) for r in design.runs}):
        runs = design.runs_at(lr, key)
        out[lr] = (sum(r.status == "diverged" for r in runs), len(runs))
    return out


def main(paths: list[str]) -> None:
    prereg = load_yaml(PREREG)
    claims = {c["id"]: c for c in prereg["claims"]}
    unigram = 5.577  # H1 of the validation tokens under the training unigram (preregistration: u_shape)
    d, key = by_label(collect(paths, warn=lambda line: print(f"grade: {line}", file=sys.stderr)))
    ladder = [float(x) for x in prereg["ladder"]]
    rows = []

    def row(cid: str, measured: str, verdict: str, why: str) -> None:
        c = claims[cid]
        rows.append(f"| `{cid}`: {c['claim']} | {c['source']} | {measured} | **{verdict}** | {why} |")

    # u_shape, per design
    shapes = []
    for name, design in d.items():
        lr, best = design.best
        interior = ladder[0] < lr < ladder[-1]
        ok = interior and best <= unigram - 0.5
        shapes.append(f"{name}: {lr:g}, {best:.3f}{'' if ok else ' ✗'}")
    holds = {n for n, design in d.items()
             if ladder[0] < design.best[0] < ladder[-1] and design.best[1] <= unigram - 0.5}
    row("u_shape", "best lr, L* per design (✗: rule fails): " + "; ".join(shapes),
        "agrees" if {"pre", "pre_qknorm"} <= holds else "not shown",
        f"holds for {len(holds)} of {len(d)} designs: {', '.join(sorted(holds))}")

    def sensitivity_claim(cid: str, lower: str, than: str, extra: str = "") -> None:
        diff = welch_interval(d[lower].sensitivities(), d[than].sensitivities())
        verdict = {-1: "agrees", 1: "disagrees", 0: "not shown"}[sign(diff)]
        row(cid, f"S({lower}) {sens(d[lower])} against S({than}) {sens(d[than])}; difference {interval(diff)}",
            verdict, "Welch 95 % interval of the difference, 3 seeds each" + extra)

    sensitivity_claim("qknorm_lr_sensitivity", "pre_qknorm", "pre")
    sensitivity_claim("peri_lr_sensitivity", "peri", "pre")

    # attention logits: from the runs' last attn max logit (mean over seeds)
    def max_logit(name: str, lr: float) -> float:
        vals = [logit_metrics(r)["attn_max_logit"] for r in d[name].runs_at(lr, key)]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else float("nan")

    a_low, a_high, q_high = max_logit("pre", 1e-3), max_logit("pre", 0.3), max_logit("pre_qknorm", 0.3)
    ok = a_high >= 100 * a_low and a_high >= 10 * q_high
    row("attention_logit_growth", f"Pre-LN {a_low:.3g} at 1e-3 → {a_high:.3g} at 3e-1; QK-norm {q_high:.3g} at 3e-1",
        "agrees" if ok else "not shown", f"×{a_high / a_low:.3g} over the ladder, ×{a_high / q_high:.3g} above QK-norm")

    # pre_dt1_worse: at rates >= 1e-2, Pre-LN dt=1 against pre_dt0.1 and peri
    high = [lr for lr in ladder if lr >= 1e-2]
    worse = better = 0
    cells = []
    for lr in high:
        a = welch_interval(d["pre"].losses_at(lr), d["pre_dt0.1"].losses_at(lr))
        b = welch_interval(d["pre"].losses_at(lr), d["peri"].losses_at(lr))
        worse += sign(a) > 0 and sign(b) > 0
        better += sign(a) < 0 and sign(b) < 0
        cells.append(f"{lr:g}: −Δt0.1 {interval(a)}, −Peri {interval(b)}")
    verdict = "agrees" if worse > len(high) / 2 else "disagrees" if better > len(high) / 2 else "not shown"
    row("pre_dt1_worse", "final loss, Pre-LN minus each (Welch 95 %): " + "; ".join(cells), verdict,
        f"worse than both at {worse} of {len(high)} rates, better than both at {better}; LR sensitivity "
        f"Pre {sens(d['pre'])}, Δt=0.1 {sens(d['pre_dt0.1'])}, Peri {sens(d['peri'])}")

    # no_ln_diverges
    pre_div, no_div = diverged(d["pre"], key), diverged(d["noln"], key)
    at = [lr for lr in no_div if no_div[lr][0] >= 2 and pre_div.get(lr, (1, 0))[0] == 0]
    row("no_ln_diverges", "no-LN diverged (k/n) per rate: " + ", ".join(f"{lr:g} {k}/{n}" for lr, (k, n) in
                                                                      no_div.items()) +
        f"; Pre-LN {sum(k for k, _ in pre_div.values())}/{sum(n for _, n in pre_div.values())} in all",
        "agrees" if at else "not shown", f"rates where no-LN diverges in ≥ 2 of 3 and Pre-LN in none: "
                                         f"{', '.join(f'{x:g}' for x in at) or 'none'}")

    def post_claim(cid: str, than: str) -> None:
        diff = welch_interval(d["post_xavier"].sensitivities(), d[than].sensitivities())
        xd, td = diverged(d["post_xavier"], key), diverged(d[than], key)
        div_at = [lr for lr in xd if xd[lr][0] > 0 and td.get(lr, (1, 0))[0] == 0]
        verdict = "agrees" if sign(diff) > 0 or div_at else "disagrees" if sign(diff) < 0 else "not shown"
        lr_t, best_t = d[than].best
        if verdict == "agrees" and best_t > unigram - 0.5:
            verdict = "agrees by the rule, hollow"  # the rule's premise (the comparator trains) does not hold
        premise = "" if best_t <= unigram - 0.5 else (
            f"; but {than} never trains 0.5 nats below the unigram level (L* {best_t:.3f} at {lr_t:g}): its low "
            f"sensitivity is a flat curve near the unigram level, not stability")
        row(cid, f"S(post_xavier) {sens(d['post_xavier'])} against S({than}) {sens(d[than])}; difference "
                 f"{interval(diff)}; diverged runs {sum(k for k, _ in xd.values())} against "
                 f"{sum(k for k, _ in td.values())}", verdict, "Welch 95 % interval of the difference" + premise)

    post_claim("xavier_post_ln", "post_gpt2init")
    post_claim("deepnorm_vs_xavier_post", "deepnorm")

    print("| claim | source | measured | verdict | why |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/proxy-designs"])
