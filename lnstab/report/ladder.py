"""Outcomes over a learning-rate ladder, with the seeds' spread: Wortsman et al. (2023)'s Figure 1 and its table.

:mod:`lnstab.report.lr_sensitivity` reads one LR sensitivity per configuration off the mean curve over seeds. This
module keeps the seeds apart, so a difference between two designs comes with an interval:

* per configuration and seed, the ladder ``min(L(η), L_init)`` over the learning rates that seed ran, and its LR
  sensitivity ``S = mean over η of [min(L(η), L_init) − L*]`` (:mod:`lnstab.report.lr_sensitivity`'s definition;
  ``L_init`` and the final loss of a run are read the same way, a diverged run counting as ``L_init``);
* per configuration: the mean of ``S`` over seeds with Student's 95 % interval, and the difference to the *first*
  configuration (the reference: a grid's first design) with Welch's 95 % interval;
* per configuration and rate: the final loss's mean, min and max over seeds and the diverged runs
  (:func:`lnstab.report.figures.lr_ladder` draws them beside the largest attention logit and the last mean log Z).

A seed that ran fewer than two rates of a ladder has no sensitivity and is left out of ``S`` (it still shows in the
per-rate rows).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from lnstab.formatting import interval, number
from lnstab.measures import ladder_loss, ladder_sensitivity
from lnstab.report.collect import RunRecord
from lnstab.report.lr_sensitivity import Ladder, final_loss, ladders
from lnstab.report.tables import (
    Table,
    _norm,
    _show,
    is_seed,
    short_names,
)
from lnstab.validation import is_number


def t_quantile(df: float, level: float = 0.975) -> float:
    """Student's t quantile (two-sided 95 % by default) for ``df`` degrees of freedom (fractional for Welch)."""
    from scipy.stats import t  # scipy: a dependency of the report's statistics only

    return float(t.ppf(level, df))


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its two-sided 95 % Student interval (``nan`` bounds below two values)."""
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """``(mean(a) − mean(b), low, high)`` with Welch's 95 % interval (``nan`` bounds below two values in either)."""
    if not a or not b:
        return math.nan, math.nan, math.nan
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(df) * se
    return diff, diff - half, diff + half


@dataclass
class SeedLadder:
    """One seed of one configuration: ``min(L(η), L_init)`` per learning rate."""

    seed: Any
    points: dict[float, float] = field(default_factory=dict)

    @property
    def sensitivity(self) -> float | None:
        """Mean over the rates of ``min(L(η), L_init) − L*`` (``None`` below two rates)."""
        return ladder_sensitivity(self.points) if len(self.points) >= 2 else None


@dataclass
class Design(Ladder):
    """A configuration (every varying value but the learning rate and the seed) over the ladder: its
    :class:`~lnstab.report.lr_sensitivity.Ladder` (the mean curve, ``best``) with each seed's ladder kept apart."""

    seeds: dict[str, SeedLadder] = field(default_factory=dict)

    def sensitivities(self) -> list[float]:
        """Each seed's LR sensitivity (seeds with fewer than two rates left out)."""
        return [s for s in (ladder.sensitivity for ladder in self.seeds.values()) if s is not None]

    def rates(self) -> list[float]:
        """Every learning rate a seed of this design finished, ascending."""
        return sorted({lr for ladder in self.seeds.values() for lr in ladder.points})

    def losses_at(self, lr: float) -> list[float]:
        """``min(L(η), L_init)`` of each seed that finished ``lr``."""
        return [ladder.points[lr] for ladder in self.seeds.values() if lr in ladder.points]

    def runs_at(self, lr: float, key: str) -> list[RunRecord]:
        """The runs of this design at ``lr``."""
        return [r for r in self.runs if rate(r, key) == lr]


def rate(run: RunRecord, key: str) -> float | None:
    """The run's learning rate under ``key`` (``None``: not a number)."""
    lr = run.config.get(key)
    return float(lr) if is_number(lr) else None


def _seed(run: RunRecord) -> str:
    return _norm(tuple(sorted((k, _norm(v)) for k, v in run.config.items() if is_seed(k))))


def designs(records: list[RunRecord]) -> tuple[str | None, list[str], list[Design]]:
    """``(LR key, configuration keys, one Design per configuration in first-seen order)``: the configurations and
    initial losses of :func:`lnstab.report.lr_sensitivity.ladders`, each seed's ladder kept apart."""
    key, keys, found = ladders(records)
    out = [Design(**{f.name: getattr(ladder, f.name) for f in fields(Ladder)}) for ladder in found]
    for design in out if key is not None else []:
        for r in design.runs:
            lr, loss = rate(r, key), final_loss(r)
            if lr is None or loss is None or design.initial is None:
                continue
            ladder = design.seeds.setdefault(_seed(r), SeedLadder(_seed(r)))
            ladder.points[lr] = ladder_loss(loss, design.initial)
        for ladder in design.seeds.values():
            ladder.points = dict(sorted(ladder.points.items()))
    return key, keys, out


def ladder_table(records: list[RunRecord]) -> Table:
    """Per configuration: LR sensitivity per seed, mean and 95 % interval, the difference to the first configuration
    with Welch's interval, best rate and loss, and the final loss at each rate (mean [min, max] over seeds)."""
    key, keys, found = designs(records)
    names = short_names(keys)
    found = [d for d in found if d.seeds]
    if key is None or not found:
        return Table(["runs"], [], ["runs"], [])
    ladder = sorted({lr for d in found for lr in d.rates()})
    reference = found[0].sensitivities()
    rows, md = [], []
    for d in found:
        sens = d.sensitivities()
        mean, low, high = mean_interval(sens)
        # the first configuration is the reference: its difference to itself is no measurement (blank, not 0 ± w)
        diff, dlow, dhigh = welch_interval(sens, reference) if d is not found[0] else (math.nan,) * 3
        best = d.best
        finished = [r for r in d.runs if r.status in ("completed", "diverged")]  # as the divergence table counts
        diverged = sum(r.status == "diverged" for r in finished)
        cells = {names[k]: _show(d.values[k]) for k in keys}
        row: dict[str, Any] = {**cells, "seeds": len(d.seeds), "lr_sensitivity": mean, "ci_low": low, "ci_high": high,
                               "per_seed": " ".join(f"{s:.4g}" for s in sens), "diff_vs_first": diff,
                               "diff_ci_low": dlow, "diff_ci_high": dhigh, "best_lr": best[0] if best else None,
                               "best_loss": best[1] if best else None, "initial_loss": d.initial,
                               "diverged": diverged, "finished": len(finished), "runs": len(d.runs)}
        shown = {**cells, "seeds": str(len(d.seeds)),  # every seed with a finished run, one rate or more
                 "LR sensitivity (95 % CI)": f"{number(mean, blank_nan=True)} {interval(low, high)}",
                 "per seed": ", ".join(f"{s:.3g}" for s in sens) or "–",
                 f"− {found[0].label} (Welch 95 %)": "–" if d is found[0] else
                 f"{number(diff, 3, blank_nan=True)} {interval(dlow, dhigh)}",
                 "best lr": number(best[0] if best else None), "L*": number(best[1] if best else None),
                 "diverged": f"{diverged}/{len(finished)}"}
        for lr in ladder:
            losses = d.losses_at(lr)
            row[f"loss@{lr:g}"] = statistics.fmean(losses) if losses else None
            shown[f"{lr:g}"] = (f"{statistics.fmean(losses):.3f}" + (f" [{min(losses):.2f}, {max(losses):.2f}]"
                                                                       if len(losses) > 1 else "")) if losses else "–"
        rows.append(row)
        md.append(shown)
    return Table(list(rows[0]), rows, list(md[0]), md)
