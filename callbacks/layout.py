"""A TensorBoard custom-scalars layout: each statistic one chart, one line per layer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from . import _stats
from ._sites import tensorboard_writer

CHARTS: dict[str, list[str]] = {
    "grad": ["grad/norm", "weight/norm"],
    "jacobian": ["jacobian/residual", "jacobian/sensitivity", "jacobian/act_scale"],
    "bound": ["bound/ma", "bound/var", "bound/slack", "bound/violations"],
    "growth": ["growth/linear", "growth/exp"],
    "divergence": ["divergence/events"],
    "attention": ["attn/max_logit", "attn/entropy_mean", "attn/entropy_min", "attn/collapsed"],
    "output": ["output/log_z", "output/max_logit"],
}


def charts() -> dict[str, list[str]]:
    """Category → chart prefixes: one ``hidden/<stat>`` chart per per-site statistic in the registry, then
    :data:`CHARTS`."""
    hidden = [f"hidden/{name}" for name in _stats.names_of("stream")]
    return {"hidden": hidden, **CHARTS}


def stability_layout() -> dict[str, dict[str, list[Any]]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: category → chart → ``["Multiline", [regex]]``; an
    instrument's ``metric_prefix`` (``mlp/hidden/mean_abs/L00``) puts its lines in the same chart, named by their
    tags."""
    return {
        category: {chart: ["Multiline", [rf"^(?:[\w.-]+/)*{chart}(/.*|_.*)?$"]] for chart in prefixes}
        for category, prefixes in charts().items()
    }


class StabilityLayout(Callback):
    """Adds :func:`stability_layout` to the TensorBoard run once, in ``setup`` (no-op without a TensorBoardLogger).

    **Logged metrics**: none (a layout in the TensorBoard *Custom Scalars* tab).

    Example::

        trainer = Trainer(logger=TensorBoardLogger("runs"), callbacks=[StabilityLayout(), HiddenStateStatistics()])
    """

    def __init__(self) -> None:
        self.added = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.added:
            self._add(trainer)
            self.added = True

    @rank_zero_only
    def _add(self, trainer: pl.Trainer) -> None:
        writer = tensorboard_writer(trainer)
        if writer is not None:
            writer.add_custom_scalars(stability_layout())
