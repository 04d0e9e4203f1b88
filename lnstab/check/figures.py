"""The card's PNG figures: growth over depth, Jacobian sensitivity against activation scale, loss curves per rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from lnstab.check.runspec import RunResult
from lnstab.measures import log_log_slope

COLORS = {"checked": "tab:red", "pre-ln": "tab:blue", "peri-ln": "tab:green"}
# The checked model is drawn last, dashed / hollow, so it stays visible on top of a reference identical to it.
LINE = {"checked": {"ls": "--", "lw": 1.6, "zorder": 3}}
STATS = {"mean_abs": "mean |x| (MA)", "var_entry": "entry-wise variance", "var_data": "data-wise variance"}


def ordered(items: dict[str, Any]) -> list[tuple[str, Any]]:
    """``items`` with the references first and ``checked`` last."""
    return sorted(items.items(), key=lambda kv: kv[0] == "checked")


def _save(fig: Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path.name


def graded_lr(summaries: dict[str, dict[str, Any]]) -> dict[str, str | None]:
    """Per subject, the learning rate whose trained profile is drawn: the rate its growth-after-training criterion
    grades and names (its worst, ``growth_trained.lr``), else (no rate graded) the largest rate every subject
    completed, else its own largest completed rate."""
    done = {k: set(s["profiles"]["trained"]) for k, s in summaries.items()}
    shared = set.intersection(*done.values()) if done else set()
    return {k: str(lr) if (lr := s.get("growth_trained", {}).get("lr")) is not None and str(lr) in done[k]
            else max(shared or done[k], key=float, default=None) for k, s in summaries.items()}


def growth_figure(summaries: dict[str, dict[str, Any]], labels: dict[str, str], path: Path) -> str:
    """MA and both variances over depth, at initialisation and after training (log scale); after training, each
    subject at the learning rate its growth criterion names (:func:`graded_lr`)."""
    fig = Figure(figsize=(13, 7))  # matplotlib's object API: no pyplot state, nothing to close
    axes = fig.subplots(2, 3, squeeze=False)
    lrs = graded_lr(summaries)
    for row, when in enumerate(("init", "trained")):
        for col, (stat, title) in enumerate(STATS.items()):
            ax = axes[row][col]
            for key, summary in ordered(summaries):
                profiles = summary["profiles"]["init"] if when == "init" else (
                    summary["profiles"]["trained"].get(lrs[key] or "", {}))
                if stat in profiles:
                    depths, values = profiles[stat]
                    suffix = f" (lr {float(lrs[key]):g})" if when == "trained" and lrs[key] else ""
                    ax.plot(depths, values, marker="o", ms=3, color=COLORS.get(key), label=labels[key] + suffix,
                            **LINE.get(key, {}))
            ax.set_yscale("log")
            ax.set_xlabel("depth (layers)")
            ax.set_title(f"{title}, {'initialisation' if when == 'init' else 'after stress training'}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    return _save(fig, path)


def sensitivity_figure(summaries: dict[str, dict[str, Any]], labels: dict[str, str], path: Path) -> str:
    """Each block's Jacobian sensitivity against its input's mean |x| (log–log) with the fitted slope."""
    fig = Figure(figsize=(6.5, 5))
    ax = fig.subplots()
    for key, summary in ordered(summaries):
        sens = summary["sensitivity"]
        points = sens["points"]
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        slope = sens["slope"]
        label = labels[key] + (f" (slope {slope:+.2f})" if math.isfinite(slope) else " (slope n/a)")
        if key == "checked":
            ax.scatter(xs, ys, s=36, facecolors="none", edgecolors=COLORS[key], linewidths=1.2, label=label, zorder=3)
        else:
            ax.scatter(xs, ys, s=12, alpha=0.6, color=COLORS.get(key), label=label)
        if math.isfinite(slope):  # the fitted line (lnstab.measures.log_log_slope) across the points
            ends, intercept = [min(xs), max(xs)], log_log_slope(points)["intercept"]
            ax.plot(ends, [math.exp(intercept + slope * math.log(x)) for x in ends], color=COLORS.get(key),
                    **{"lw": 1.2, **LINE.get(key, {})})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("activation scale: mean |x| at the block's input")
    ax.set_ylabel("sensitivity Δt·‖∂f/∂X‖₂")
    ax.set_title("Jacobian sensitivity against activation scale", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.collections:
        ax.legend(fontsize=7)
    return _save(fig, path)


def loss_figure(runs: dict[str, list[RunResult]], labels: dict[str, str], lrs: list[float], path: Path) -> str:
    """Training loss per step, one panel per learning rate, one line per subject and seed (× marks divergence)."""
    fig = Figure(figsize=(4.2 * len(lrs), 3.6))
    axes = fig.subplots(1, len(lrs), squeeze=False)
    for ax, lr in zip(axes[0], lrs, strict=True):
        named: set[str] = set()  # subjects already in this panel's legend: each is named once, by what it drew first
        for key, subject_runs in ordered(runs):
            for run in (r for r in subject_runs if r.lr == lr):
                finite = [(s, v) for s, v in enumerate(run.losses) if math.isfinite(v)]
                if finite:
                    ax.plot(*zip(*finite, strict=True), color=COLORS.get(key), alpha=0.8,
                            label=None if key in named else labels[key], **{"lw": 1, **LINE.get(key, {})})
                    named.add(key)
                if run.diverged:  # a run with no finite loss draws only this mark, so the mark names its subject
                    step = run.diverged_step if run.diverged_step is not None else len(run.losses) - 1
                    y = finite[-1][1] if finite else 0.0
                    ax.plot([step], [y], marker="x", ms=9, linestyle="none", color=COLORS.get(key),
                            label=None if key in named else labels[key])
                    named.add(key)
        ax.set_title(f"lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        if named:
            ax.legend(fontsize=7)
    return _save(fig, path)


def write_figures(out: Path, summaries: dict[str, dict[str, Any]], runs: dict[str, list[RunResult]],
                  labels: dict[str, str], lrs: list[float]) -> list[str]:
    """All three figures into ``out``; their file names."""
    return [
        growth_figure(summaries, labels, out / "growth.png"),
        sensitivity_figure(summaries, labels, out / "sensitivity.png"),
        loss_figure(runs, labels, lrs, out / "loss.png"),
    ]
