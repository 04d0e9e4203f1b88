"""Wortsman et al. (2023)'s learning-rate sensitivity: how much final loss a configuration loses over an LR ladder.

For one configuration (every varying config value but the learning rate and the seed) trained at learning rates
``η`` of a ladder::

    LR sensitivity = mean over η of [ min(L(η), L_init) − L* ],   L* = min over η of min(L(η), L_init)

``L(η)`` is the final loss at ``η`` (the mean over its seeds of ``min(L_run, L_init)``), ``L_init`` the initial loss
(the mean over the configuration's runs of :func:`initial_loss`: the loss at step 0, else ``ln V``), so a diverged run
counts as ``L_init``: no better than not training. A run's final loss is its validation loss (``summary.json``), else
its last finite ``train/loss``; a diverged run's, or a completed run's without a finite loss, is infinite. Runs that
did not finish (missing, running, interrupted, failed, damaged) do not count. A configuration trained at one learning
rate has no sensitivity (``–``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from lnstab.formatting import number
from lnstab.measures import best_rate, ladder_loss, ladder_sensitivity
from lnstab.report.collect import RunRecord
from lnstab.report.tables import Table, _norm, _show, config_label, short_names, varying_keys
from lnstab.validation import is_integer, is_number

LR_NAMES = ("learning_rate", "lr")


def lr_key(records: list[RunRecord]) -> str | None:
    """The config key of the learning rate (``model.learning_rate``, any ``*.lr``), ``None`` when no run has one."""
    keys = [k for r in records for k in r.config if k.rsplit(".", 1)[-1] in LR_NAMES]
    return min(keys, key=lambda k: (k.count("."), k)) if keys else None


def final_loss(run: RunRecord) -> float | None:
    """The run's final loss for the ladder: ``inf`` if it diverged, ``None`` if it did not finish (module doc)."""
    if run.status == "diverged":
        return math.inf
    if run.status != "completed":
        return None
    if "val_loss" in run.metrics:
        return run.metrics["val_loss"]
    train = run.series("train/loss")
    finite = [v for _, v in train if math.isfinite(v)]
    return finite[-1] if finite and math.isfinite(train[-1][1]) else (math.inf if train else None)


def initial_loss(run: RunRecord) -> float | None:
    """The loss before training: ``train/loss`` logged at step 0; else ``ln(vocab_size)``, the loss of the near-uniform
    logits a GPT has at initialisation (a loss first logged at step 9 or 49 has already trained at the run's own
    learning rate, which would make ``L_init`` depend on it); else the first finite ``train/loss`` logged."""
    series = run.series("train/loss")
    if series and series[0][0] == 0 and math.isfinite(series[0][1]):
        return series[0][1]
    vocab = run.config.get("model.vocab_size")
    if vocab is None and "model.preset" in run.config:  # lnstab's GPT: the preset's vocabulary (GPT-2's 50257)
        vocab = _preset_vocab(run.config)
    if is_integer(vocab) and vocab > 1:
        return math.log(vocab)
    return next((v for _, v in series if math.isfinite(v)), None)


def _preset_vocab(config: dict[str, Any]) -> int | None:
    from lnstab.moduleargs import gpt_config

    model = {k.removeprefix("model."): v for k, v in config.items() if k.startswith("model.")}
    try:
        return gpt_config(model).vocab_size
    except Exception:  # noqa: BLE001 - not a GPTModule config after all
        return None


@dataclass
class Ladder:
    """One configuration over the learning-rate ladder."""

    values: dict[str, Any]
    label: str
    runs: list[RunRecord] = field(default_factory=list)
    initial: float | None = None
    points: dict[float, float] = field(default_factory=dict)  # η -> min(L(η), L_init), mean over seeds
    diverged: dict[float, int] = field(default_factory=dict)  # η -> diverged runs
    counted: int = 0

    @property
    def best(self) -> tuple[float, float] | None:
        """``(η*, L*)``: the learning rate of the lowest final loss and that loss."""
        return best_rate(self.points)

    @property
    def sensitivity(self) -> float | None:
        """Mean over the ladder of ``min(L(η), L_init) − L*`` (``None`` below two learning rates)."""
        return ladder_sensitivity(self.points) if len(self.points) >= 2 else None


def ladders(records: list[RunRecord]) -> tuple[str | None, list[str], list[Ladder]]:
    """``(LR key, configuration keys, one Ladder per configuration in first-seen order)``."""
    key = lr_key(records)
    keys = [k for k in varying_keys(records) if k != key]
    names = short_names(keys)
    out: dict[tuple[str, ...], Ladder] = {}
    for r in records:
        ident = tuple(_norm(r.config.get(k)) for k in keys)
        if ident not in out:
            values = {k: r.config.get(k) for k in keys}
            out[ident] = Ladder(values, config_label(names, values))
        out[ident].runs.append(r)
    for ladder in out.values():
        starts = [v for v in map(initial_loss, ladder.runs) if v is not None]
        ladder.initial = statistics.fmean(starts) if starts else None
        by_lr: dict[float, list[float]] = {}
        for r in ladder.runs:
            lr, loss = r.config.get(key) if key else None, final_loss(r)
            if not is_number(lr) or loss is None or ladder.initial is None:
                continue
            by_lr.setdefault(float(lr), []).append(ladder_loss(loss, ladder.initial))
            ladder.diverged[float(lr)] = ladder.diverged.get(float(lr), 0) + (r.status == "diverged")
            ladder.counted += 1
        ladder.points = {lr: statistics.fmean(v) for lr, v in sorted(by_lr.items())}
    return key, keys, list(out.values())


def lr_sensitivity_table(records: list[RunRecord]) -> Table:
    """LR sensitivity, best learning rate and loss, initial loss and the ladder, per configuration."""
    key, keys, found = ladders(records)
    names = short_names(keys)
    rows, md = [], []
    for ladder in found:
        cells = {names[k]: _show(ladder.values[k]) for k in keys}
        best = ladder.best
        sens = ladder.sensitivity
        row = {**cells, "lr_sensitivity": sens, "best_lr": best[0] if best else None,
               "best_loss": best[1] if best else None, "initial_loss": ladder.initial,
               "ladder": " ".join(format(lr, "g") for lr in ladder.points), "runs": ladder.counted,
               "all_runs": len(ladder.runs), "diverged": sum(ladder.diverged.values())}
        rows.append(row)
        md.append({**cells, "LR sensitivity": number(sens), "best lr": number(row["best_lr"]),
                   "L*": number(row["best_loss"]), "L_init": number(ladder.initial),
                   "ladder (lr)": ", ".join(format(lr, "g") for lr in ladder.points) or "–",
                   "runs": f"{ladder.counted}/{len(ladder.runs)}", "diverged": str(row["diverged"])})
    columns = [*names.values(), "lr_sensitivity", "best_lr", "best_loss", "initial_loss", "ladder", "runs",
               "all_runs", "diverged"]
    md_columns = [*names.values(), "LR sensitivity", "best lr", "L*", "L_init", "ladder (lr)", "runs", "diverged"]
    return Table(columns, rows, md_columns, md)
