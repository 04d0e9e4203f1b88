"""The paper's figures from run records, as PNG (matplotlib's object API, no display, no global state).

One colour per configuration (:func:`lnstab.report.tables.group`) and per design (a configuration without its
learning rate: the lines of the per-learning-rate panels and of the LR-sensitivity figure), the same in every figure
(:func:`palette`); where a configuration has several runs (seeds), a line is their mean over the runs that have a
finite value at that point, and a line of one point is drawn as a marker. A panel without data is not drawn, nor is a
legend entry for a line without points. Each figure function returns the :class:`~matplotlib.figure.Figure`, or
``None`` when no run has the data (the report says so instead of drawing an empty plot); :func:`draw_all` writes
them.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lnstab.report.collect import RunRecord
from lnstab.report.ladder import Design, designs
from lnstab.report.ladder import rate as design_rate
from lnstab.report.logits import logit_metrics
from lnstab.report.lr_sensitivity import ladders
from lnstab.report.tables import Configuration, _norm, config_label, jacobian_pairs, last_site, short_names

STATS = (("mean_abs", "mean |x| (MA)"), ("var_entry", "entry-wise variance"), ("var_data", "data-wise variance"))
DPI = 110


# matplotlib's ten default colours, then ten more of other hues, so that a grid's 11th-20th configurations are not
# drawn in the colours of its first ten.
COLOURS = [f"C{i}" for i in range(10)] + [
    "#000000", "#1b9e77", "#3f007d", "#08306b", "#e6ab02", "#66a61e", "#e7298a", "#67000d", "#9ecae1", "#3f4f1f",
]


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


def palette(configs: list[Configuration]) -> dict[str, str]:
    """One colour per label, the same in every figure of ``configs``: the designs' labels first (a configuration
    without its learning rate), then the configurations' own, each in first-seen order."""
    designs = [label for _, members in _by_learning_rate(configs) for label, _ in members]
    designs += [ladder.label for ladder in ladders([r for c in configs for r in c.runs])[2]]
    colours: dict[str, str] = {}
    for label in [*designs, *(c.label for c in configs)]:
        colours.setdefault(label, _colour(len(colours)))
    return colours


def _line(ax: Any, xs: list, ys: list, colour: str, label: str | None, **kwargs: Any) -> None:
    """``ax.plot`` that draws a line of one point as a marker (a line alone would draw nothing)."""
    if len(xs) == 1 and not kwargs.get("marker"):
        kwargs["marker"] = "o"
    ax.plot(xs, ys, color=colour, label=label, **kwargs)


def _has_data(artist: Any) -> bool:
    if hasattr(artist, "get_xdata"):
        return len(artist.get_xdata()) > 0
    if hasattr(artist, "get_offsets"):
        return len(artist.get_offsets()) > 0
    return True


def _mean_by_key(pairs: list[tuple[Any, float]]) -> tuple[list[Any], list[float]]:
    sums: dict[Any, list[float]] = {}
    for key, value in pairs:
        if isinstance(value, int | float) and math.isfinite(value):
            sums.setdefault(key, []).append(float(value))
    keys = sorted(sums)
    return keys, [sum(sums[k]) / len(sums[k]) for k in keys]


def _save(fig: Figure, path: Path) -> Path:
    with warnings.catch_warnings():  # a legend of long labels leaves it no room; bbox_inches="tight" takes it in
        warnings.filterwarnings("ignore", message="Tight layout not applied", category=UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # the legend sits outside the panels
    return path


def _legend(fig: Figure) -> None:
    """One legend for every panel of ``fig`` (one entry per label, only for what has points), to the right of the
    rightmost panel, where it hides no line."""
    handles: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if _has_data(handle):
                handles.setdefault(label, handle)
    if handles:
        fig.axes[-1].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left",
                            bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


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


def _three_stats(configs: list[Configuration], points: Callable[[RunRecord, str], list[tuple]],
                 title: str, xlabel: str, marker: str | None = None) -> Figure | None:
    """One panel per statistic of ``STATS`` that some run has (log scale), one line per configuration: the mean over
    its runs of the ``(x, y)`` points that ``points(run, stat)`` gives."""
    colours = palette(configs)
    lines = {stat: [(c, *_mean_by_key([p for r in c.runs for p in points(r, stat)])) for c in configs]
             for stat, _ in STATS}
    shown = [(stat, name) for stat, name in STATS if any(xs for _, xs, _ in lines[stat])]
    if not shown:
        return None
    fig = Figure(figsize=(4.4 * len(shown) + 1.0, 4))
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, (stat, name) in zip(axes, shown, strict=True):
        for c, xs, ys in lines[stat]:
            if xs:
                _line(ax, xs, ys, colours[c.label], c.label, marker=marker)
        ax.set_title(f"{name}, {title}")
        ax.set_xlabel(xlabel)
        _log_if_positive(ax)
    _legend(fig)
    return fig


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


def depth_profile(configs: list[Configuration]) -> Figure | None:
    """MA, entry-wise and data-wise variance against depth at the end of training (log scale)."""
    return _three_stats(configs, _end_of_training_by_depth, "end of training",
                        "depth (layers; half steps: attention, MLP)", marker=".")


def last_layer_over_steps(configs: list[Configuration]) -> Figure | None:
    """MA, entry-wise and data-wise variance of the last layer's output over training steps (log scale)."""
    return _three_stats(configs, _last_layer_by_step, "last layer", "step")


def jacobian_vs_scale(configs: list[Configuration]) -> Figure | None:
    """Jacobian sensitivity ‖Δt·∇f‖ against the layer's activation scale, every layer and probe (Props. 7/8)."""
    colours = palette(configs)
    fig = Figure(figsize=(6.5, 5))
    ax = fig.subplots()
    drawn = False
    for c in configs:
        points = [p for r in c.runs for p in jacobian_pairs(r)]
        if points:
            ax.scatter([x for x, _ in points], [y for _, y in points], s=10, alpha=0.6, color=colours[c.label],
                       label=c.label)
            drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("activation scale of the layer's input")
    ax.set_ylabel("Jacobian sensitivity (spectral norm of Δt·∇f)")
    ax.set_title("Sensitivity against activation scale, per layer and probe")
    _legend(fig)
    return fig


def theorem4(configs: list[Configuration]) -> Figure | None:
    """Theorem 4's bound on the final MA (dashed) beside the measured MA (solid), over training steps."""
    colours = palette(configs)
    fig = Figure(figsize=(7.5, 5))
    ax = fig.subplots()
    drawn = False
    for c in configs:
        bound = _mean_by_key([p for r in c.runs for p in r.series("bound/ma_bound")])
        measured = _mean_by_key([p for r in c.runs for p in r.series("bound/ma_final")])
        if bound[0]:
            _line(ax, *bound, colours[c.label], f"{c.label}: bound", linestyle="--")
            drawn = True
        if measured[0]:
            _line(ax, *measured, colours[c.label], f"{c.label}: measured MA")
            drawn = True
    if not drawn:
        return None
    _log_if_positive(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("mean |x| of the final-norm input")
    ax.set_title("Theorem 4 (Peri-LN): bound and measured MA")
    _legend(fig)
    return fig


def loss_curves(configs: list[Configuration]) -> Figure | None:
    """Training and validation loss of every run (colour = configuration), divergence points marked ×; a panel
    only for a loss some run logged."""
    colours = palette(configs)
    runs = [r for c in configs for r in c.runs]
    tags = [t for t in ("train/loss", "val/loss") if any(math.isfinite(v) for r in runs for _, v in r.series(t))]
    if not tags and any(r.diverged_step is not None for r in runs):
        tags = ["train/loss"]  # only divergence marks, at the top edge
    if not tags:
        return None
    fig = Figure(figsize=(6 * len(tags), 4.5))
    axes = fig.subplots(1, len(tags), squeeze=False)[0]
    for c in configs:
        colour = colours[c.label]
        for ax, tag in zip(axes, tags, strict=True):
            labelled = False
            for r in c.runs:
                series = [(s, v) for s, v in r.series(tag) if math.isfinite(v)]
                step = r.diverged_step
                if series:
                    _line(ax, [s for s, _ in series], [v for _, v in series], colour,
                          None if labelled else c.label, alpha=0.8, linewidth=1)
                    labelled = True
                if step is None:
                    continue
                before = [v for s, v in series if s <= step]
                label = None if labelled else c.label
                if before:  # on the curve, at the last finite loss before the divergence
                    ax.scatter([step], [before[-1]], marker="x", s=60, color=colour, zorder=3, label=label)
                else:  # diverged before any finite loss was logged: at the top edge
                    ax.scatter([step], [0.97], marker="x", s=60, color=colour, zorder=3, label=label,
                               transform=ax.get_xaxis_transform(), clip_on=False)
                labelled = True
            ax.set_title(f"{tag} (× = divergence)")
            ax.set_xlabel("step")
    _legend(fig)
    return fig


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
        label = config_label(names, {k: v for k, v in c.values.items() if k != lr})
        panels.setdefault(c.values.get(lr), []).append((label, c))
    return sorted(panels.items(), key=lambda item: (item[0] is None, item[0] if item[0] is not None else 0))


def _lr_text(lr: Any) -> str:
    return f"lr={lr:g}" if isinstance(lr, int | float) else f"lr={lr}"


def _over_steps(configs: list[Configuration], series: Callable[[RunRecord], list[tuple[int, float]]],
                ylabel: str, title: str, log: bool) -> Figure | None:
    """One line per configuration over steps; one panel per learning rate where the configurations vary in one
    (same colour for the same design in every panel, shared y axis); a learning rate without data (every run
    diverged before it logged) gets no panel, and the title says so."""
    colours = palette(configs)
    panels = [(lr, [(label, *_mean_by_key([p for r in c.runs for p in series(r)])) for label, c in members])
              for lr, members in _by_learning_rate(configs)]
    shown = [(lr, lines) for lr, lines in panels if any(xs for _, xs, _ in lines)]
    if not shown:
        return None
    fig = Figure(figsize=(3.2 * len(shown) + 2.5, 4.2))
    axes = fig.subplots(1, len(shown), sharey=True, squeeze=False)[0]
    for ax, (lr, lines) in zip(axes, shown, strict=True):
        for label, xs, ys in lines:
            if xs:
                _line(ax, xs, ys, colours[label], label)
        ax.set_xlabel("step")
        if lr is not None:
            ax.set_title(_lr_text(lr), fontsize=9)
    if log:
        for ax in axes:
            _log_if_positive(ax)
    axes[0].set_ylabel(ylabel)
    empty = [_lr_text(lr) for lr, lines in panels if lr is not None and not any(xs for _, xs, _ in lines)]
    fig.suptitle(title + (f" (no data at {', '.join(empty)})" if empty else ""))
    _legend(fig)
    return fig


def attention_max_logit(configs: list[Configuration]) -> Figure | None:
    """The largest attention logit |q·k|/√d_h over every layer (``attn/max_logit/*``), over training steps."""
    return _over_steps(configs, lambda r: max_over_layers(r, "attn/max_logit"),
                       "max |q·k|/√d_h, largest over layers", "Attention-logit growth (max over layers)", log=True)


def log_z_over_steps(configs: list[Configuration]) -> Figure | None:
    """The mean over tokens of log Z = logsumexp of the output logits (``output/log_z_mean``), over steps."""
    return _over_steps(configs, lambda r: r.series("output/log_z_mean"), "mean log Z (nats)",
                       "Output-logit drift: mean log Z (z-loss pulls it to 0)", log=True)


def lr_sensitivity(configs: list[Configuration]) -> Figure | None:
    """Final loss against learning rate (log x), one line per configuration without the learning rate: Wortsman et
    al.'s form; a diverged run counts as the initial loss (×: an LR where some run diverged)."""
    records = [r for c in configs for r in c.runs]
    _, _, found = ladders(records)
    colours = palette(configs)
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    drawn = False
    for ladder in found:
        if len(ladder.points) < 2:
            continue
        lrs = list(ladder.points)
        colour = colours[ladder.label]
        ax.plot(lrs, [ladder.points[lr] for lr in lrs], marker="o", color=colour, label=ladder.label)
        bad = [lr for lr in lrs if ladder.diverged.get(lr)]
        if bad:
            ax.scatter(bad, [ladder.points[lr] for lr in bad], marker="x", s=70, color=colour, zorder=3)
        drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final loss, min(L, L_init)")
    ax.set_title("Final loss against learning rate (× = a run diverged; counted as L_init)")
    _legend(fig)
    return fig


def _per_rate_logit(design: Design, key: str, metric: str, finished_only: bool = False
                    ) -> tuple[list[float], list[float]]:
    """``(rates, mean over the design's runs at each rate of one of logits.LOGIT_METRICS)``; ``finished_only``: leave
    out diverged runs (a diverged run's last log Z is its blow-up, thousands of nats, not where the model ended)."""
    xs, ys = [], []
    for lr in sorted({lr for r in design.runs if (lr := design_rate(r, key)) is not None}):
        values = [v for r in design.runs_at(lr, key) if (v := logit_metrics(r).get(metric)) is not None
                  and math.isfinite(v) and not (finished_only and r.status == "diverged")]
        if values:
            xs.append(lr)
            ys.append(statistics.fmean(values))
    return xs, ys


def lr_ladder(configs: list[Configuration]) -> Figure | None:
    """Wortsman et al.'s Figure 1 with the seeds' spread, beside its mechanisms: the final loss against learning rate
    (mean over seeds; the band from the best to the worst seed; × where a run diverged, counted as L_init), the
    largest attention logit and the last mean log Z against learning rate; one line per design (a configuration
    without its learning rate), in its colour of every figure."""
    key, _, found = designs([r for c in configs for r in c.runs])
    found = [d for d in found if len(d.rates()) >= 2]
    if key is None or not found:
        return None
    colours = palette(configs)
    fig = Figure(figsize=(15, 4.6))
    loss_ax, logit_ax, z_ax = fig.subplots(1, 3)
    for d in found:
        colour = colours.get(d.label, _colour(len(colours)))
        rates = d.rates()
        losses = [d.losses_at(lr) for lr in rates]
        _line(loss_ax, rates, [statistics.fmean(v) for v in losses], colour, d.label, marker="o", ms=4)
        loss_ax.fill_between(rates, [min(v) for v in losses], [max(v) for v in losses], color=colour, alpha=0.15,
                             linewidth=0)
        bad = [lr for lr in rates if any(r.status == "diverged" for r in d.runs_at(lr, key))]
        if bad:
            loss_ax.scatter(bad, [statistics.fmean(d.losses_at(lr)) for lr in bad], marker="x", s=60, color=colour,
                            zorder=3)
        for ax, metric in ((logit_ax, "attn_max_logit"), (z_ax, "log_z_last")):
            xs, ys = _per_rate_logit(d, key, metric, finished_only=metric == "log_z_last")
            if xs:
                _line(ax, xs, ys, colour, d.label, marker="o", ms=4)
    if found[0].initial is not None:
        loss_ax.axhline(found[0].initial, color="grey", lw=0.8, ls=":", label="L_init")
    loss_ax.set_title("Final loss (band: seeds; ×: diverged)")
    loss_ax.set_ylabel("final validation loss, min(L, L_init)")
    logit_ax.set_title("Largest attention logit")
    z_ax.set_title("Last mean log Z (runs not diverged)")
    for ax in (loss_ax, logit_ax, z_ax):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    _log_if_positive(logit_ax)
    for ax in (logit_ax, z_ax):
        if not ax.get_lines():
            ax.set_title(ax.get_title() + ": not logged")
    _legend(fig)
    return fig


FIGURES: dict[str, tuple[str, Callable[[list[Configuration]], Figure | None]]] = {
    "depth_profile.png": ("MA, entry-wise and data-wise variance against depth at the end of training", depth_profile),
    "last_layer_steps.png": ("the same for the last layer over training steps", last_layer_over_steps),
    "jacobian_scale.png": ("Jacobian sensitivity against activation scale per layer (Props. 7/8)", jacobian_vs_scale),
    "theorem4_bound.png": ("Theorem 4 bound beside the measured MA", theorem4),
    "loss_curves.png": ("training and validation loss, divergence points marked", loss_curves),
    "attention_max_logit.png": ("the largest attention logit over layers, over training steps", attention_max_logit),
    "log_z.png": ("mean log Z of the output logits over training steps", log_z_over_steps),
    "lr_sensitivity.png": ("final loss against learning rate, one line per configuration", lr_sensitivity),
    "lr_ladder.png": ("final loss with the seeds' band, largest attention logit and log Z against learning rate",
                      lr_ladder),
}


def draw_all(configs: list[Configuration], out: Path) -> dict[str, Path | None]:
    """Every figure of :data:`FIGURES` into ``out``; ``None`` for those without data."""
    written: dict[str, Path | None] = {}
    for name, (_, draw) in FIGURES.items():
        fig = draw(configs)
        written[name] = None if fig is None else _save(fig, out / name)
    return written
