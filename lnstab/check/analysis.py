"""From the stress runs of one subject to the numbers its criteria judge (pure functions, plain floats)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from lnstab.callbacks.divergence_kinds import FATAL
from lnstab.check.runspec import RunResult
from lnstab.measures import (
    best_rate,
    better_law,
    growth_fit,
    jacobian_points,
    ladder_loss,
    ladder_sensitivity,
    layer_depths,
    log_log_slope,
)


def profile(run: RunResult, stat: str, index: int) -> tuple[list[float], list[float]]:
    """Depths and values of ``stat`` at the ``index``-th measurement of ``run`` over its layer sites."""
    values = run.hidden.get(stat, {})
    pairs = [(d, values[t][index]) for t, d in layer_depths(run.hidden_tags).items() if len(values.get(t, ())) > index]
    return [d for d, _ in pairs], [v for _, v in pairs]


def law(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean per-layer exponential rate, mean R² of both fits and the law that fits better on average."""
    mean = lambda key: mean_sd([f[key] for f in fits])[0]  # noqa: E731
    exp_r2, lin_r2 = mean("exp_r2"), mean("lin_r2")
    return {"exp_rate": mean("exp_rate"), "exp_r2": exp_r2, "lin_r2": lin_r2, "law": better_law(exp_r2, lin_r2)}


def measured_index(run: RunResult, step: int) -> int | None:
    """Position of ``step`` in the run's hidden-state series, or ``None``."""
    return run.hidden_steps.index(step) if step in run.hidden_steps else None


def jacobian_at(run: RunResult, step: int) -> list[tuple[float, float]]:
    """``(act_scale, sensitivity)`` of every block measured at ``step`` (:func:`lnstab.measures.jacobian_points`)."""
    return jacobian_points({k: [(step, v)] for k, v in run.metrics.get(step, {}).items()})


def grad_spread(run: RunResult) -> float:
    """Median over steps of ``log10(max / min)`` of the per-layer gradient norms (``nan`` without them)."""
    spreads = []
    for metrics in run.metrics.values():
        norms = [v for k, v in metrics.items() if k.startswith("grad/norm/L")]
        if len(norms) >= 2 and all(math.isfinite(v) for v in norms) and min(norms) > 0:
            spreads.append(math.log10(max(norms) / min(norms)))
    return statistics.median(spreads) if spreads else math.nan


def first_bad(run: RunResult) -> dict[str, Any] | None:
    """Step, kind and layer of the first fatal divergence event of a diverged run."""
    if not run.diverged:
        return None
    fatal = [e for e in run.events if e["kind"] in FATAL]
    if not fatal:
        step = next((i for i, v in enumerate(run.losses) if not math.isfinite(v)), run.diverged_step)
        return {"step": step, "kind": "nonfinite_loss", "layer": None}
    step = min(e["step"] for e in fatal)
    at_step = [e for e in fatal if e["step"] == step]
    layer = next((e["layer"] for e in at_step if e.get("layer")), None)
    return {"step": step, "kind": at_step[0]["kind"], "layer": layer}


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation of the finite ``values`` (``nan`` when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.pstdev(finite) if len(finite) > 1 else 0.0


def worst(runs: list[RunResult], value: Any, pick: Any = max) -> dict[str, Any]:
    """Over learning rates, the largest (``pick=min``: smallest) finite mean of ``value(run)`` over the seeds that did
    not diverge: that ``mean``, its ``sd`` and its ``lr`` (``nan``, ``nan``, ``None`` when none is finite)."""
    per_lr = {lr: mean_sd([value(r) for r in runs if r.lr == lr and not r.diverged]) for lr in {r.lr for r in runs}}
    finite = {lr: v for lr, v in sorted(per_lr.items()) if math.isfinite(v[0])}
    if not finite:
        return {"mean": math.nan, "sd": math.nan, "lr": None}
    lr = pick(finite, key=lambda k: finite[k][0])
    return {"mean": finite[lr][0], "sd": finite[lr][1], "lr": lr}


def mean_profiles(runs: list[RunResult], step: int) -> dict[str, list[list[float]]]:
    """``{stat: [depths, mean values]}`` over ``runs`` (those that measured ``step``) for MA and both variances."""
    out: dict[str, list[list[float]]] = {}
    for stat in ("mean_abs", "var_entry", "var_data"):
        rows = [profile(r, stat, i) for r in runs if (i := measured_index(r, step)) is not None]
        rows = [r for r in rows if r[0]]
        if rows and all(len(r[0]) == len(rows[0][0]) for r in rows):
            out[stat] = [rows[0][0], [statistics.fmean(vals) for vals in zip(*(r[1] for r in rows), strict=True)]]
    return out


def final_loss(run: RunResult) -> float:
    """The run's last training loss: ``inf`` when it diverged, ``nan`` without one."""
    return math.inf if run.diverged else run.losses[-1] if run.losses else math.nan


def lr_sensitivity(runs: list[RunResult]) -> dict[str, Any]:
    """Wortsman et al. (2023)'s LR sensitivity of one subject over its ladder, as :mod:`lnstab.report` computes it:
    ``L(lr)`` = the mean over seeds of :func:`lnstab.measures.ladder_loss`, ``L_init`` the mean first loss of the runs,
    value = mean over the ladder of ``L(lr) − min L``. ``sd`` is the spread of the same value computed seed by seed
    (each seed against its own first loss)."""
    starts = [r.losses[0] for r in runs if r.losses and math.isfinite(r.losses[0])]
    initial = statistics.fmean(starts) if starts else math.nan
    lrs = sorted({r.lr for r in runs})
    points = {lr: statistics.fmean(ladder_loss(final_loss(r), initial) for r in runs if r.lr == lr) for lr in lrs}
    per_seed = []
    for seed in sorted({r.seed for r in runs}):
        mine = [r for r in runs if r.seed == seed]
        start = statistics.fmean(r.losses[0] for r in mine if r.losses) if any(r.losses for r in mine) else math.nan
        per_seed.append(ladder_sensitivity({r.lr: ladder_loss(final_loss(r), start) for r in mine}))
    value = ladder_sensitivity(points) if math.isfinite(initial) else math.nan
    best = best_rate(points)[0] if points and math.isfinite(value) else None
    return {"mean": value, "sd": mean_sd(per_seed)[1] if len(per_seed) > 1 else 0.0, "points": points,
            "best_lr": best, "best": points[best] if best is not None else math.nan, "initial": initial}


def series_max(run: RunResult, prefix: str, from_step: int = 0, to_step: float = math.inf) -> float:
    """The largest ``|value|`` of metrics starting with ``prefix`` over the run's steps from ``from_step`` to
    ``to_step`` (``nan`` when it has none)."""
    values = [abs(v) for step, metrics in run.metrics.items() if from_step <= step <= to_step
              for k, v in metrics.items() if k.startswith(prefix) and math.isfinite(v)]
    return max(values) if values else math.nan


def logit_summary(runs: list[RunResult], prefix: str, from_step: int, event: str) -> dict[str, Any]:
    """The worst learning rate's mean (over seeds, completed runs) of each run's largest ``|metric|``, with its sd,
    its learning rate, the mean over runs of the largest ``|metric|`` at initialisation (step 0), and the number of
    ``event`` divergence events."""
    init = mean_sd([series_max(r, prefix, 0, 0) for r in runs if r.metrics.get(0)])[0]
    events = sum(e["kind"] == event for r in runs for e in r.events)
    return {**worst(runs, lambda r: series_max(r, prefix, from_step)), "init": init, "events": events}


def attention_summary(runs: list[RunResult]) -> dict[str, Any]:
    """Largest attention logit |q·k|/√d over layers and measured steps (worst learning rate), with the largest
    collapsed-row fraction, the smallest entropy and the attention-collapse events."""
    out = logit_summary(runs, "attn/max_logit/", 0, "attention_collapse")
    completed = [r for r in runs if not r.diverged]
    out["collapsed"] = max((series_max(r, "attn/collapsed/") for r in completed), default=math.nan)
    mins = [v for r in completed for m in r.metrics.values() for k, v in m.items() if k.startswith("attn/entropy_min/")]
    out["entropy_min"] = min(mins) if mins else math.nan
    return out


def summarise(runs: list[RunResult], steps: int) -> dict[str, Any]:
    """Every number the criteria and figures need for one subject (depth as :func:`layer_depths` counts it)."""
    first_lr = min(r.lr for r in runs)
    init_runs = [r for r in runs if r.lr == first_lr]

    def fit_at(run: RunResult, step: int) -> dict[str, Any] | None:
        index = measured_index(run, step)
        return None if index is None else growth_fit(*profile(run, "mean_abs", index))

    init_fits = [f for r in init_runs if (f := fit_at(r, 0)) is not None]
    growth_init = {**dict(zip(("mean", "sd"), mean_sd([f["doublings"] for f in init_fits]), strict=True)),
                   **law(init_fits)}
    completed = [r for r in runs if not r.diverged]
    trained = {id(r): fit_at(r, steps) or growth_fit([], []) for r in completed}
    growth_trained = worst(completed, lambda r: trained[id(r)]["doublings"])
    growth_trained.update(law([trained[id(r)] for r in completed if r.lr == growth_trained["lr"]]))
    # runs whose measurement was dropped because a block did not run then (LayerDrop: a training-only branch)
    growth_init["unmeasured"] = sum(measured_index(r, 0) is None for r in init_runs)
    growth_trained["unmeasured"] = sum(measured_index(r, steps) is None for r in completed)
    max_abs = max((v for r in completed for vals in r.hidden.get("max_abs", {}).values() for v in vals
                   if math.isfinite(v)), default=math.nan)
    points = [p for r in init_runs for p in jacobian_at(r, 0)]
    points += [p for r in completed for p in jacobian_at(r, steps)]
    logs = [math.log(s) for s, _ in points]
    spread_ok = len(points) >= 3 and max(logs) - min(logs) >= 0.1
    slope = log_log_slope(points if spread_ok else [])  # none: every field nan
    bound_runs = [r.metrics[max(r.metrics)] for r in runs if r.metrics and any(
        "bound/violations" in m for m in r.metrics.values())]
    violations = sum(int(m.get("bound/violations", 0)) for m in bound_runs) if bound_runs else math.nan
    slacks = [m["bound/slack"] for r in runs for m in r.metrics.values() if "bound/slack" in m]
    return {
        "runs": len(runs),
        "diverged": sum(r.diverged for r in runs),
        "first_bad": [{"lr": r.lr, "seed": r.seed, **fb} for r in runs if (fb := first_bad(r)) is not None],
        "growth_init": growth_init,
        "growth_trained": growth_trained,
        "max_abs": max_abs,
        "sensitivity": {"slope": slope["slope"], "se": slope["se"], "r2": slope["r2"], "points": points},
        "bound": {"violations": violations, "min_slack": min(slacks) if slacks else math.nan},
        "grad_spread": worst(runs, grad_spread),
        "loss": worst(runs, final_loss, pick=min),
        "lr_sensitivity": lr_sensitivity(runs),
        "attention": attention_summary(runs),
        "log_z": logit_summary(runs, "output/log_z_mean", 1, "logit_drift"),  # |mean log Z| after initialisation
        "profiles": {
            "init": mean_profiles(init_runs, 0),
            "trained": {str(lr): mean_profiles([r for r in completed if r.lr == lr], steps)
                        for lr in sorted({r.lr for r in completed})},
        },
        "loss_init": mean_sd([r.losses[0] for r in init_runs if r.losses])[0],
    }
