"""A TensorBoard custom-scalars layout: every tag lnstab logs in one chart, each chart one kind of quantity.

A chart holds either one statistic at every site or layer (one line each; a total never joins its parts) or a few
quantities of one unit meant to be read against each other (train, val and test loss; a bound and the value it bounds;
the R² of the two growth fits). TensorBoard matches each regex with Python's ``re.match`` against every scalar tag of
a run, so a chart shows whatever tags it matches, and a tag no regex matches is in no chart.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from . import _stats
from ._sites import tensorboard_writer

PREFIX = r"^(?:[\w.-]+/)*"  # an instrument's metric_prefix (``mlp/hidden/mean_abs/L00``) keeps its lines in the chart


@dataclass(frozen=True)
class Chart:
    """One chart: its title, the regexes of its tags and what logs them: a callback class, ``z_loss`` (a module
    trained with a z-loss, ``train/z_loss``) or ``None`` (the LightningModule's or the trainer's own, always charted).
    """

    title: str
    regexes: tuple[str, ...]
    source: str | None = None


def per_site(stat: str, source: str) -> Chart:
    """One line per site or layer of ``stat`` (``stat/L00``, ``stat/L00_attn``, ``stat/embed``), never its total."""
    return Chart(stat, (rf"{PREFIX}{re.escape(stat)}/(?!total$)[^/]+$",), source)


def named(title: str, source: str | None, *tags: str, prefix: str = PREFIX) -> Chart:
    """The listed tags (``metric_prefix`` allowed where ``prefix`` is :data:`PREFIX`)."""
    return Chart(title, (f"{prefix}(?:{'|'.join(re.escape(t) for t in tags)})$",), source)


def exact(title: str, source: str | None, *tags: str) -> Chart:
    """The listed tags exactly (the module's, the trainer's and :class:`Throughput`'s, which take no prefix)."""
    return named(title, source, *tags, prefix="^")


def categories() -> dict[str, list[Chart]]:
    """Category → charts, in dashboard order: training first, then the stability instruments, then the final
    evaluation. The hidden-state, attention and output-logit charts follow the statistics registry (one chart per
    statistic registered when this is called)."""
    hidden = [per_site(f"hidden/{name}", "HiddenStateStatistics") for name in _stats.names_of("stream")]
    attention = [per_site(f"attn/{name.removeprefix('attn_')}", "AttentionLogitStatistics")
                 for name in _stats.names_of("attention")]
    output = [named(f"output/{name.removeprefix('output_')}", "OutputLogitStatistics",
                    f"output/{name.removeprefix('output_')}") for name in _stats.names_of("logits")]
    bound, norms, grads = "GrowthBoundMonitor", "GrowthBoundMonitor:norms", "GradientStatistics"
    return {
        "Training": [
            exact("loss (train, val, test)", None, "train/loss", "val/loss", "test/loss"),
            exact("perplexity (val, test)", None, "val/ppl", "test/ppl"),
            exact("z-loss", "z_loss", "train/z_loss"),
            exact("learning rate", None, "train/lr"),
            exact("tokens seen", None, "train/tokens"),
            exact("tokens/s (all devices, one device)", "Throughput",
                  "throughput/tokens_per_s", "throughput/device/tokens_per_s"),
            exact("samples/s", "Throughput", "throughput/samples_per_s"),
            exact("FLOP/s (one device, its peak)", "Throughput", "throughput/device/flops_per_s",
                  "throughput/peak_flops"),
            exact("MFU", "Throughput", "throughput/mfu"),
            exact("epoch", None, "epoch"),
        ],
        "Hidden states": hidden,
        "Growth bound": [  # only where the monitor found output norms (GrowthBoundMonitor.layout_sources)
            named("bound/ma: final mean |h| and its bound", norms, "bound/ma_final", "bound/ma_bound"),
            named("bound/slack: bound - mean |h|, min over sequences", norms, "bound/slack"),
            named("bound/var: final variance and its bound", norms, "bound/var_final", "bound/var_bound"),
            named("bound/var_slack: bound - variance", norms, "bound/var_slack"),
            named("bound/violations", norms, "bound/violations"),
        ],
        "Growth across depth": [
            named("growth/linear_slope", bound, "growth/linear_slope"),
            named("growth/exp_rate", bound, "growth/exp_rate"),
            named("growth R² (linear, exponential fit)", bound, "growth/linear_r2", "growth/exp_r2"),
        ],
        "Gradients and weights": [
            per_site("grad/norm", grads),
            named("grad/norm/total", grads, "grad/norm/total"),
            per_site("weight/norm", grads),
            named("weight/norm/total", grads, "weight/norm/total"),
        ],
        "Jacobian": [per_site(f"jacobian/{name}", "JacobianSensitivity")
                     for name in ("residual", "sensitivity", "act_scale")],
        "Attention logits": attention,
        "Output logits": output,
        "Divergence": [named("divergence/events (cumulative)", "DivergenceMonitor", "divergence/events")],
        "Evaluation": [
            exact("eval/loss", "FinalEvaluation", "eval/loss"),
            exact("eval perplexity (exp mean loss, mean per sequence)", "FinalEvaluation",
                  "eval/ppl_exp_mean_loss", "eval/ppl_mean_seq"),
            exact("eval ROUGE (1, 2, L) and copy rate", "FinalEvaluation", "eval/rouge1", "eval/rouge2", "eval/rougeL",
                  "eval/copy_rate"),
            exact("eval BERTScore (precision, recall, F1)", "FinalEvaluation",
                  "eval/bertscore_precision", "eval/bertscore_recall", "eval/bertscore_f1"),
        ],
    }


def stability_layout(sources: Collection[str] | None = None) -> dict[str, dict[str, list[Any]]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: category → chart title → ``["Multiline", [regex]]``.

    Args:
        sources: Names of the callback classes present, and ``z_loss`` where the module trains with a z-loss
            (``None``: every chart). A chart whose source is not named is left out, and so is a category left empty.
    """
    out: dict[str, dict[str, list[Any]]] = {}
    for category, charts in categories().items():
        kept = {c.title: ["Multiline", list(c.regexes)] for c in charts
                if sources is None or c.source is None or c.source in sources}
        if kept:
            out[category] = kept
    return out


def layout_sources(callback: Callback, pl_module: pl.LightningModule) -> set[str]:
    """The chart sources ``callback`` fills: its ``layout_sources(pl_module)`` where it has one (an instrument that
    logs some of its charts only on some models), else the names of its class and its bases."""
    own = getattr(callback, "layout_sources", None)
    if callable(own):
        return set(own(pl_module))
    return {cls.__name__ for cls in type(callback).__mro__}


class StabilityLayout(Callback):
    """Adds :func:`stability_layout` to the TensorBoard run in ``setup`` (no-op without a TensorBoardLogger): the
    training charts (z-loss where the module's ``hparams.z_loss`` > 0) and those of the instruments among
    ``trainer.callbacks`` (subclasses count) that they will fill (:func:`layout_sources`: Theorem 4's charts only
    where ``GrowthBoundMonitor`` finds output norms, the evaluation's only where ``FinalEvaluation`` runs). Once per
    TensorBoard run (log directory): a new run, such as each fit of a seed loop that reuses one callbacks list with a
    new trainer and logger, gets its own layout; a later ``setup`` into the run it was added to (a ``validate`` after
    the fit, a resume in the same process) adds nothing.

    **Logged metrics**: none (a layout in the TensorBoard *Custom Scalars* tab; docs/dashboard.md).

    Example::

        trainer = Trainer(logger=TensorBoardLogger("runs"), callbacks=[StabilityLayout(), HiddenStateStatistics()])
    """

    def __init__(self) -> None:
        self.added_to: str | None = None  # the log directory of the TensorBoard run the layout was last added to

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._add(trainer, pl_module)

    @rank_zero_only
    def _add(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        writer = tensorboard_writer(trainer)
        if writer is None:
            return
        log_dir = str(writer.get_logdir())
        if log_dir == self.added_to:
            return  # this run has it: a later stage, or a resume into it
        sources = {source for callback in trainer.callbacks for source in layout_sources(callback, pl_module)}
        z_loss = pl_module.hparams.get("z_loss")
        if isinstance(z_loss, int | float) and z_loss > 0:
            sources.add("z_loss")
        writer.add_custom_scalars(stability_layout(sources))
        self.added_to = log_dir
