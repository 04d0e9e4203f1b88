"""The paper's figures from run records, as PNG (matplotlib's object API, no display, no global state).

One colour per configuration (:func:`lnstab.report.tables.group`); where a configuration has several runs (seeds),
a line is their mean over the runs that have a finite value at that point. Each function returns the path written,
or ``None`` when no run has the data (the report says so instead of drawing an empty plot).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lnstab.report.collect import RunRecord
from lnstab.report.lr_sensitivity import ladders
from lnstab.report.tables import Configuration, _norm, jacobian_points, join_label, label_part, last_site, short_names

STATS = (("mean_abs", "mean |x| (MA)"), ("var_entry", "entry-wise variance"), ("var_data", "data-wise variance"))
DPI = 110


# matplotlib's ten default colours, then ten more of other hues, so that a grid's 11th-20th configurations are not
# drawn in the colours of its first ten.
COLOURS = [f"C{i}" for i in range(10)] + [
    "#000000", "#1b9e77", "#3f007d", "#08306b", "#e6ab02", "#66a61e", "#e7298a", "#67000d", "#9ecae1", "#3f4f1f",
]


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


def _mean_by_key(pairs: list[tuple[Any, float]]) -> tuple[list[Any], list[float]]:
    sums: dict[Any, list[float]] = {}
    for key, value in pairs:
        if isinstance(value, int | float) and math.isfinite(value):
            sums.setdefault(key, []).append(float(value))
    keys = sorted(sums)
    return keys, [sum(sums[k]) / len(sums[k]) for k in keys]


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # the legend sits outside the panels
    return path


def _legend(ax: Any) -> None:
    """The legend to the right of ``ax`` (the rightmost panel), where it hides no line."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _log_if_positive(ax: Any) -> None:
    """Log scale where every value is positive and they span more than a factor of 10."""
    values = [y for line in ax.get_lines() for y in line.get_ydata()]
    if values and min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale("log")


def site_depth(tag: str) -> float | None:
    """Depth of a hidden-state site in layers: ``embed`` 0, ``L03_attn`` 3.5, ``L03_mlp`` 4 (``None``: other)."""
    if tag == "embed":
        return 0.0
    if tag.startswith("L") and "_" in tag and tag[1:].split("_")[0].isdigit():
        layer, part = tag[1:].split("_", 1)
        return int(layer) + (0.5 if part == "attn" else 1.0)
    return None


def _three_stats(configs: list[Configuration], path: Path, points: Callable[[RunRecord, str], list[tuple]],
                 title: str, xlabel: str, marker: str | None = None) -> Path | None:
    """One panel per statistic of ``STATS`` (log scale), one line per configuration: the mean over its runs of the
    ``(x, y)`` points that ``points(run, stat)`` gives."""
    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    drawn = False
    for i, c in enumerate(configs):
        for ax, (stat, name) in zip(axes, STATS, strict=True):
            xs, ys = _mean_by_key([p for r in c.runs for p in points(r, stat)])
            if xs:
                ax.plot(xs, ys, marker=marker, color=_colour(i), label=c.label)
                drawn = True
            ax.set_title(f"{name}, {title}")
            ax.set_xlabel(xlabel)
    if not drawn:
        return None
    for ax in axes:
        _log_if_positive(ax)
    _legend(axes[-1])
    return _save(fig, path)


def _end_of_training_by_depth(run: RunRecord, stat: str) -> list[tuple[float, float]]:
    series = ((run.hidden or {}).get("stats") or {}).get(stat) or {}
    out = []
    for tag, values in series.items():
        depth = site_depth(tag)
        finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
        if depth is not None and finite:
            out.append((depth, finite[-1]))
    return out


def _last_layer_by_step(run: RunRecord, stat: str) -> list[tuple]:
    hidden = run.hidden or {}
    site = last_site(hidden) if hidden else None
    values = ((hidden.get("stats") or {}).get(stat) or {}).get(site, []) if site else []
    return list(zip(hidden.get("steps") or [], values, strict=False))


def depth_profile(configs: list[Configuration], path: Path) -> Path | None:
    """MA, entry-wise and data-wise variance against depth at the end of training (log scale)."""
    return _three_stats(configs, path, _end_of_training_by_depth, "end of training",
                        "depth (layers; half steps: attention, MLP)", marker=".")


def last_layer_over_steps(configs: list[Configuration], path: Path) -> Path | None:
    """MA, entry-wise and data-wise variance of the last layer's output over training steps (log scale)."""
    return _three_stats(configs, path, _last_layer_by_step, "last layer", "step")


def jacobian_vs_scale(configs: list[Configuration], path: Path) -> Path | None:
    """Jacobian sensitivity ‖Δt·∇f‖ against the layer's activation scale, every layer and probe (Props. 7/8)."""
    fig = Figure(figsize=(6.5, 5))
    ax = fig.subplots()
    drawn = False
    for i, c in enumerate(configs):
        points = [p for r in c.runs for p in jacobian_points(r)[1]]
        if points:
            ax.scatter([x for x, _ in points], [y for _, y in points], s=10, alpha=0.6, color=_colour(i),
                       label=c.label)
            drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("activation scale of the layer's input")
    ax.set_ylabel("Jacobian sensitivity (spectral norm of Δt·∇f)")
    ax.set_title("Sensitivity against activation scale, per layer and probe")
    _legend(ax)
    return _save(fig, path)


def theorem4(configs: list[Configuration], path: Path) -> Path | None:
    """Theorem 4's bound on the final MA (dashed) beside the measured MA (solid), over training steps."""
    fig = Figure(figsize=(7.5, 5))
    ax = fig.subplots()
    drawn = False
    for i, c in enumerate(configs):
        bound = _mean_by_key([p for r in c.runs for p in r.series("bound/ma_bound")])
        measured = _mean_by_key([p for r in c.runs for p in r.series("bound/ma_final")])
        if bound[0]:
            ax.plot(*bound, linestyle="--", color=_colour(i), label=f"{c.label}: bound")
            ax.plot(*measured, color=_colour(i), label=f"{c.label}: measured MA")
            drawn = True
    if not drawn:
        return None
    _log_if_positive(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("mean |x| of the final-norm input")
    ax.set_title("Theorem 4 (Peri-LN): bound and measured MA")
    _legend(ax)
    return _save(fig, path)


def loss_curves(configs: list[Configuration], path: Path) -> Path | None:
    """Training and validation loss of every run (colour = configuration), divergence points marked ×."""
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    drawn = False
    for i, c in enumerate(configs):
        for ax, tag in zip(axes, ("train/loss", "val/loss"), strict=True):
            labelled = False
            for r in c.runs:
                series = [(s, v) for s, v in r.series(tag) if math.isfinite(v)]
                step = r.diverged_step
                if series:
                    ax.plot([s for s, _ in series], [v for _, v in series], color=_colour(i), alpha=0.8,
                            linewidth=1, label=None if labelled else c.label)
                    labelled = drawn = True
                if step is None:
                    continue
                before = [v for s, v in series if s <= step]
                label = None if labelled else c.label
                if before:  # on the curve, at the last finite loss before the divergence
                    ax.scatter([step], [before[-1]], marker="x", s=60, color=_colour(i), zorder=3, label=label)
                else:  # diverged before any finite loss was logged: at the top edge
                    ax.scatter([step], [0.97], marker="x", s=60, color=_colour(i), zorder=3, label=label,
                               transform=ax.get_xaxis_transform(), clip_on=False)
                labelled = drawn = True
            ax.set_title(f"{tag} (× = divergence)")
            ax.set_xlabel("step")
    if not drawn:
        return None
    _legend(axes[-1])
    return _save(fig, path)


def max_over_layers(run: RunRecord, prefix: str) -> list[tuple[int, float]]:
    """Per step, the largest value over the layers of the scalars ``<prefix>/<layer>`` (a NaN layer makes it NaN)."""
    by_step: dict[int, float] = {}
    for tag, points in run.scalars().items():
        if tag.startswith(prefix + "/"):
            for step, value in points:
                old = by_step.get(step, -math.inf)
                by_step[step] = value if math.isnan(value) or math.isnan(old) else max(old, value)
    return sorted(by_step.items())


def _by_learning_rate(configs: list[Configuration]) -> list[tuple[Any, list[tuple[str, Configuration]]]]:
    """``[(lr, [(label without the lr, configuration), …]), …]``: one panel per learning rate where the
    configurations vary in one (a grid over a ladder has too many lines for one panel), else one panel."""
    keys = {k for c in configs for k in c.values}
    lr = next((k for k in sorted(keys) if k.rsplit(".", 1)[-1] in ("learning_rate", "lr")), None)
    if lr is None or len({_norm(c.values.get(lr)) for c in configs}) < 2:
        return [(None, [(c.label, c) for c in configs])]
    names = short_names(sorted(keys))
    panels: dict[Any, list[tuple[str, Configuration]]] = {}
    for c in configs:
        label = join_label([label_part(names[k], v) for k, v in c.values.items() if k != lr]) or "all runs"
        panels.setdefault(c.values.get(lr), []).append((label, c))
    return sorted(panels.items(), key=lambda item: (item[0] is None, item[0] if item[0] is not None else 0))


def _over_steps(configs: list[Configuration], path: Path, series: Callable[[RunRecord], list[tuple[int, float]]],
                ylabel: str, title: str, log: bool) -> Path | None:
    """One line per configuration over steps; one panel per learning rate where the configurations vary in one
    (same colour for the same configuration in every panel, shared y axis)."""
    panels = _by_learning_rate(configs)
    fig = Figure(figsize=(3.2 * len(panels) + 2.5, 4.2))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    colours: dict[str, str] = {}
    drawn = False
    for ax, (lr, members) in zip(axes, panels, strict=True):
        for label, c in members:
            xs, ys = _mean_by_key([p for r in c.runs for p in series(r)])
            if xs:
                colour = colours.setdefault(label, _colour(len(colours)))
                ax.plot(xs, ys, color=colour, label=label)  # one legend entry per label, built below
                drawn = True
        ax.set_xlabel("step")
        if lr is not None:
            ax.set_title(f"lr={lr:g}" if isinstance(lr, int | float) else f"lr={lr}", fontsize=9)
    if not drawn:
        return None
    if log:
        for ax in axes:
            _log_if_positive(ax)
    axes[0].set_ylabel(ylabel)
    fig.suptitle(title)
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    if handles:
        axes[-1].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left",
                        bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return _save(fig, path)


def attention_max_logit(configs: list[Configuration], path: Path) -> Path | None:
    """The largest attention logit |q·k|/√d_h over every layer (``attn/max_logit/*``), over training steps."""
    return _over_steps(configs, path, lambda r: max_over_layers(r, "attn/max_logit"),
                       "max |q·k|/√d_h, largest over layers", "Attention-logit growth (max over layers)", log=True)


def log_z_over_steps(configs: list[Configuration], path: Path) -> Path | None:
    """The mean over tokens of log Z = logsumexp of the output logits (``output/log_z_mean``), over steps."""
    return _over_steps(configs, path, lambda r: r.series("output/log_z_mean"), "mean log Z (nats)",
                       "Output-logit drift: mean log Z (z-loss pulls it to 0)", log=True)


def lr_sensitivity(configs: list[Configuration], path: Path) -> Path | None:
    """Final loss against learning rate (log x), one line per configuration without the learning rate: Wortsman et
    al.'s form; a diverged run counts as the initial loss (×: an LR where some run diverged)."""
    records = [r for c in configs for r in c.runs]
    _, _, found = ladders(records)
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    drawn = False
    for i, ladder in enumerate(found):
        if len(ladder.points) < 2:
            continue
        lrs = list(ladder.points)
        ax.plot(lrs, [ladder.points[lr] for lr in lrs], marker="o", color=_colour(i), label=ladder.label)
        bad = [lr for lr in lrs if ladder.diverged.get(lr)]
        ax.scatter(bad, [ladder.points[lr] for lr in bad], marker="x", s=70, color=_colour(i), zorder=3)
        drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final loss, min(L, L_init)")
    ax.set_title("Final loss against learning rate (× = a run diverged; counted as L_init)")
    _legend(ax)
    return _save(fig, path)


FIGURES: dict[str, tuple[str, Callable[[list[Configuration], Path], Path | None]]] = {
    "depth_profile.png": ("MA, entry-wise and data-wise variance against depth at the end of training", depth_profile),
    "last_layer_steps.png": ("the same for the last layer over training steps", last_layer_over_steps),
    "jacobian_scale.png": ("Jacobian sensitivity against activation scale per layer (Props. 7/8)", jacobian_vs_scale),
    "theorem4_bound.png": ("Theorem 4 bound beside the measured MA", theorem4),
    "loss_curves.png": ("training and validation loss, divergence points marked", loss_curves),
    "attention_max_logit.png": ("the largest attention logit over layers, over training steps", attention_max_logit),
    "log_z.png": ("mean log Z of the output logits over training steps", log_z_over_steps),
    "lr_sensitivity.png": ("final loss against learning rate, one line per configuration", lr_sensitivity),
}


def draw_all(configs: list[Configuration], out: Path) -> dict[str, Path | None]:
    """Every figure of :data:`FIGURES` into ``out``; ``None`` for those without data."""
    return {name: draw(configs, out / name) for name, (_, draw) in FIGURES.items()}
