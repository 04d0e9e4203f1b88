"""The measures that the instruments, ``lnstab report`` and ``lnstab check`` share, once: plain floats, no torch.

* :func:`fit_line`, least squares, and the growth of a depth profile (its sites' depths: :func:`layer_depths`):
  :func:`growth_law`, its exponential and linear fits (:class:`lnstab.callbacks.GrowthBoundMonitor` logs them
  live), and :func:`growth_fit`, those with the doublings over the deeper half (:func:`deep_doublings`) that the
  check grades;
* :func:`ladder_loss`, :func:`ladder_sensitivity`, :func:`best_rate`: Wortsman et al. (2023)'s LR sensitivity;
* :func:`jacobian_points` and :func:`log_log_slope`: the Jacobian probe's ``(activation scale, sensitivity)`` pairs
  and the slope Propositions 7/8 predict (−1).

How a run's losses and metrics are read stays with its reader (:mod:`lnstab.report` reads run directories, the check
its stress runs); these functions take what was read. No Lightning and no product imports: the model's layer, the
callbacks and the check's parent all import this module.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

FP16_MAX = 65504.0  # the largest finite float16 and bfloat16: where an activation overflows in that precision
BF16_MAX = 3.3895313892515355e38
SENSITIVITY = "jacobian/sensitivity/"
ACT_SCALE = "jacobian/act_scale/"


def fit_line(x: list[float], y: list[float], *, complete: bool = False) -> dict[str, float]:
    """Least squares ``y = a + b·x``: ``slope``, ``intercept``, ``r2``, the slope's standard error ``se`` and ``n``.

    Pairs with a non-finite value are left out; with ``complete`` a single one makes the fit undefined (all ``nan``).
    Fewer than two pairs, or no spread in ``x``, give ``nan`` too.
    """
    pts = [(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)]
    n = len(pts)
    nan = {"slope": math.nan, "intercept": math.nan, "r2": math.nan, "se": math.nan, "n": n}
    if n < 2 or (complete and n < len(x)):
        return nan
    if min(a for a, _ in pts) == max(a for a, _ in pts):
        return nan  # no spread in x (sxx from rounded means would be a few ulps, not 0)
    mx, my = sum(a for a, _ in pts) / n, sum(b for _, b in pts) / n
    sxx = sum((a - mx) ** 2 for a, _ in pts)
    sxy = sum((a - mx) * (b - my) for a, b in pts)
    syy = sum((b - my) ** 2 for _, b in pts)
    slope = sxy / sxx
    sse = max(0.0, syy - slope * sxy)
    r2 = 1.0 - sse / syy if syy > 0 else 1.0
    se = math.sqrt(sse / (n - 2) / sxx) if n > 2 else 0.0
    return {"slope": slope, "intercept": my - slope * mx, "r2": r2, "se": se, "n": n}


def layer_depths(tags: list[str]) -> dict[str, float]:
    """Depth in layers of every layer site (tags ``L00``, ``L00_attn`` …): half-step ``k`` of a two-site block sits at
    ``(k + 1) / 2``. ``embed`` (X_0, whose scale is arbitrary next to the updates') and ``final`` are left out."""
    layers = [t for t in tags if t.startswith("L")]
    n_layers = len({t.split("_")[0] for t in layers}) or 1
    per_layer = len(layers) / n_layers
    return {t: (k + 1) / per_layer for k, t in enumerate(layers)}


def interpolate(depths: list[float], values: list[float], at: float) -> float:
    """``values`` linearly interpolated at depth ``at`` (``nan`` outside the measured depths)."""
    for (d0, v0), (d1, v1) in zip(zip(depths, values, strict=True), zip(depths[1:], values[1:], strict=True),
                                  strict=False):
        if d0 <= at <= d1:
            return v0 if d1 == d0 else v0 + (v1 - v0) * (at - d0) / (d1 - d0)
    return values[0] if depths and at == depths[0] else math.nan


def deep_doublings(depths: list[float], values: list[float]) -> float:
    """``log2(MA(D) / MA(D/2))``: how often the profile doubles over the deeper half of the depth ``D``.

    Any linear law ``a + b·depth`` with ``a ≥ 0`` (Theorem 4's envelope) gives at most 1, ``√depth`` gives 0.5,
    a quadratic 2, and an exponential ``e^(r·depth)`` gives ``r·D / (2 ln 2)``, which grows with depth.
    """
    if len(depths) < 2:
        return math.nan
    top, mid = values[-1], interpolate(depths, values, depths[-1] / 2)
    finite = mid > 0 and top > 0 and math.isfinite(top) and math.isfinite(mid)
    return math.log2(top / mid) if finite else math.nan


def growth_law(depths: list[float], values: list[float], *, complete: bool = False) -> dict[str, Any]:
    """The exponential fit of a profile over depth (``exp_rate``: the per-layer rate of ``log y``, ``exp_r2``), the
    linear fit (``lin_slope``, ``lin_r2``) and which of the two laws fits better (``law``). ``complete``: as in
    :func:`fit_line` (a value that is not positive and finite has no logarithm, so it leaves the exponential fit
    undefined)."""
    logs = [math.log(v) if v > 0 and math.isfinite(v) else math.nan for v in values]
    exp, lin = fit_line(depths, logs, complete=complete), fit_line(depths, values, complete=complete)
    return {"exp_rate": exp["slope"], "exp_r2": exp["r2"], "lin_slope": lin["slope"], "lin_r2": lin["r2"],
            "law": better_law(exp["r2"], lin["r2"])}


def better_law(exp_r2: float, lin_r2: float) -> str:
    """``exponential`` or ``linear``, whichever fit has the higher R² (``n/a`` unless both are finite)."""
    if not (math.isfinite(exp_r2) and math.isfinite(lin_r2)):
        return "n/a"
    return "exponential" if exp_r2 > lin_r2 else "linear"


def growth_fit(depths: list[float], values: list[float]) -> dict[str, Any]:
    """:func:`deep_doublings` (``doublings``) and :func:`growth_law` of a profile over depth."""
    return {"doublings": deep_doublings(depths, values), **growth_law(depths, values)}


def best_rate(points: Mapping[float, float]) -> tuple[float, float] | None:
    """``(η*, L*)``: the learning rate of the lowest loss of a ladder ``{η: L(η)}`` (the lowest η of a tie) and that
    loss (``None`` for an empty ladder)."""
    return min(points.items(), key=lambda p: (p[1], p[0])) if points else None


def ladder_loss(final: float, initial: float) -> float:
    """``min(L_final, L_init)``, a run's point on an LR ladder: a final loss that is not finite (a diverged run's)
    counts as ``L_init``, no better than not training (Wortsman et al. 2023)."""
    return min(final, initial) if math.isfinite(final) else initial


def ladder_sensitivity(points: Mapping[float, float]) -> float:
    """Wortsman et al. (2023)'s LR sensitivity of a ladder ``{η: min(L(η), L_init)}``: the mean over it of
    ``L(η) − L*``, ``L* = min L`` (``nan`` below two learning rates or with a loss that is not finite)."""
    finite = [v for v in points.values() if math.isfinite(v)]
    if len(points) < 2 or len(finite) != len(points):
        return math.nan
    best = min(finite)
    return statistics.fmean(v - best for v in finite)


def jacobian_points(scalars: Mapping[str, Iterable[tuple[int, float]]]) -> list[tuple[float, float]]:
    """``(activation scale, sensitivity)`` of every block and step that measured both, positive and finite, from
    ``{tag: [(step, value)]}`` (:class:`lnstab.callbacks.JacobianSensitivity`'s ``jacobian/sensitivity/<L>`` and
    ``jacobian/act_scale/<L>``): block by block in the order of ``scalars``, step by step ascending."""
    points = []
    for tag, series in scalars.items():
        if not tag.startswith(SENSITIVITY):
            continue
        sens, scale = dict(series), dict(scalars.get(ACT_SCALE + tag.rsplit("/", 1)[-1], ()))
        for step in sorted(sens.keys() & scale.keys()):
            s, j = scale[step], sens[step]
            if math.isfinite(s) and math.isfinite(j) and s > 0 and j > 0:
                points.append((s, j))
    return points


def log_log_slope(points: list[tuple[float, float]]) -> dict[str, float]:
    """:func:`fit_line` of ``log y`` on ``log x`` over positive ``(x, y)`` points (Propositions 7/8: −1 for the
    Jacobian sensitivity against the activation scale)."""
    return fit_line([math.log(x) for x, _ in points], [math.log(y) for _, y in points])
