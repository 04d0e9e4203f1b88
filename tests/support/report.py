"""Fixture run directories for ``lnstab report``: scalars written as TensorBoard events, one run made to order, and a
sweep of eight runs over three configurations with one missing."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from lnstab.rundir import write_json

TAGS = ["embed", "L00_attn", "L00_mlp", "L01_attn", "L01_mlp", "final"]
STEPS = [0, 50, 100]
SCORES = ("rouge1", "rouge2", "rougeL", "bertscore_precision", "bertscore_recall", "bertscore_f1")


def write_scalars(directory: Path, scalars: dict[str, list[tuple[int, float]]], name: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory / "tmp"))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    (written,) = (directory / "tmp").glob("events.out.tfevents.*")
    written.rename(directory / f"events.out.tfevents.{name}")  # names fix the order in which files are read
    (directory / "tmp").rmdir()


def make_run(grid: Path, name: str, placement: str, seed: int, status: str, *, val_loss: float | None = None,
             score: float | None = None, ma: float = 1.0, diverged_step: int | None = None, sens_power: float = 1.0,
             slack: tuple[float, ...] = ()) -> Path:
    """A run directory as lnstab fit leaves it, with values derived from ``ma``, ``score`` and ``sens_power``."""
    d = grid / name
    d.mkdir(parents=True)
    config = {"seed_everything": seed, "model": {"norm_placement": placement, "residual_scale": 1.0},
              "trainer": {"max_steps": 100, "logger": {"class_path": "TensorBoardLogger",
                                                       "init_args": {"save_dir": str(grid), "version": name}}},
              "data": {"init_args": {"seed": seed}}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {"status": status, "final_step": diverged_step or 100, "diverged_step": diverged_step}
    if val_loss is not None:
        summary["val"] = {"loss": val_loss, "step": 100}
    write_json(d / "summary.json", summary)
    if score is not None:
        metrics = {"loss": val_loss + 0.5, "ppl_exp_mean_loss": math.exp(val_loss + 0.5),
                   "ppl_mean_seq": math.exp(val_loss + 0.5) + 1, **{k: score for k in SCORES}}
        write_json(d / "eval.json", {"schema": 1, "metrics": metrics})
    depth = {tag: i for i, tag in enumerate(TAGS)}
    last = [math.nan] if diverged_step else []
    stats = {stat: {tag: [factor * ma * (1 + depth[tag]) * (s + 1) / 101 for s in STEPS] + last for tag in TAGS}
             for stat, factor in (("mean_abs", 1.0), ("var_entry", 2.0), ("var_data", 0.5), ("max_abs", 10.0))}
    write_json(d / "hidden_stats.json", {"tags": TAGS, "steps": STEPS + ([101] if diverged_step else []),
                                         "stats": stats})
    scalars = {"train/loss": [(s, 6.0 - s / 50) for s in STEPS], "growth/exp_rate": [(0, 0.1), (100, 0.3)],
               "growth/exp_r2": [(100, 0.9)]}
    if val_loss is not None:
        scalars["val/loss"] = [(50, val_loss + 1), (100, val_loss)]
    if slack:
        scalars["bound/slack"] = list(zip(STEPS, slack, strict=True))
        scalars["bound/violations"] = [(s, 0.0) for s in STEPS]
        scalars["bound/ma_bound"] = [(s, 50.0) for s in STEPS]
        scalars["bound/ma_final"] = [(s, 50.0 - v) for s, v in zip(STEPS, slack, strict=True)]
    for layer, scale in (("L00", 2.0), ("L01", 8.0)):
        scalars[f"jacobian/act_scale/{layer}"] = [(0, scale), (100, scale * 4)]
        scalars[f"jacobian/sensitivity/{layer}"] = [(0, 3 * scale**sens_power), (100, 3 * (scale * 4) ** sens_power)]
    write_scalars(d, scalars, "1")
    return d


def write_grid(tmp_path: Path) -> Path:
    """Three configurations (placement pre / peri / none) over seeds; peri_s2 was planned but never started."""
    g = tmp_path / "runs" / "fixture"
    make_run(g, "pre_s0", "pre", 0, "completed", val_loss=3.0, score=0.25, ma=100.0, sens_power=0.5)
    make_run(g, "pre_s1", "pre", 1, "completed", val_loss=3.4, score=0.35, ma=300.0, sens_power=0.5)
    make_run(g, "pre_s2", "pre", 2, "interrupted", val_loss=3.9, ma=200.0, sens_power=0.5)
    make_run(g, "peri_s0", "peri", 0, "completed", val_loss=3.1, score=0.5, ma=2.0, sens_power=-1.0,
             slack=(4.0, 1.5, 2.0))
    make_run(g, "peri_s1", "peri", 1, "completed", val_loss=3.3, score=0.5, ma=4.0, sens_power=-1.0,
             slack=(3.0, 2.5, 0.5))
    make_run(g, "none_s0", "none", 0, "diverged", val_loss=9.0, score=0.01, ma=1e5, diverged_step=17)
    make_run(g, "none_s1", "none", 1, "completed", val_loss=4.0, score=0.2, ma=50.0)
    runs = [{"name": f"{p}_s{s}", "overrides": {"model.norm_placement": p, "seed_everything": s}}
            for p in ("pre", "peri", "none") for s in range(3) if (p, s) != ("none", 2)]
    write_json(g / ".sweep" / "manifest.json", {"grid": "fixture.yaml", "base": "base.yaml", "runs": runs})
    return g
