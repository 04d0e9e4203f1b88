"""Statistics of the residual stream after every half-step: mean |x|, entry-wise and data-wise variance, max |x|."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import nn
from typing_extensions import override

from lnstab import validation as require
from lnstab.errors import ConfigError
from lnstab.rundir import HIDDEN_SERIES_FILE, atomic_write_text, json_safe, run_dir, writes_files

from . import _stats
from ._sites import (
    EMBED_PATTERN,
    FINAL_PATTERN,
    Site,
    auto_sites,
    no_end_sites,
    no_sites,
    resolve_types,
    tensorboard_writer,
)
from ._strategy import require_strategy
from ._tap_callback import MeasuringTapCallback

STATS = ("mean_abs", "var_entry", "var_data", "max_abs")  # the paper's four, logged by default


class HiddenStateStatistics(MeasuringTapCallback):
    """Residual-stream statistics at X_0, after every attention and MLP update, and at the final-norm input.

    For a site's tensor ``x`` of shape ``(B, n, d)`` (any ``(B, ...)``; flattened to ``(B, N)``, ``N = n·d``):

    * ``mean_abs`` = mean of ``|x|`` over all ``B·N`` entries (MA of the paper, averaged over the batch);
    * ``var_entry`` = population variance over the ``N`` entries of each sequence, averaged over the batch;
    * ``var_data`` = population variance across the ``B`` samples of each entry, averaged over the ``N`` entries;
    * ``max_abs`` = max of ``|x|``.

    Each statistic is an entry of the statistics registry (:mod:`lnstab.callbacks._stats`), read through the
    model's shared tap: computed only on logging steps (``global_step % every_n_steps == 0``; the hooks are no-ops
    otherwise), pooled over every micro-batch of that optimizer step, reduced across ranks (DDP, FSDP) so that every
    value equals one process seeing the whole global batch, and read with one host sync per logging event. Per-entry
    moments for ``var_data`` are one float32 vector of ``N`` per site, merged with Chan's update and allocated only
    on logging steps. The whole series is written to ``<run dir>/hidden_stats.json`` at the end of training (not
    under ``fast_dev_run``, which measures and writes no file), and a layer × step heatmap per statistic is added to
    TensorBoard (``hidden/heatmap/<stat>``) when a TensorBoardLogger is attached.

    Args:
        every_n_steps: Log on optimizer steps ``0, N, 2N, …``.
        layer_pattern: Regex searched in module names; its first group is the layer index (``L07``), a second one is
            appended (``L07_attn``), as is a first group that is no number, to the layer's number in depth order
            (``L07_h.7``). ``None``: lnstab's ``h.<i>.resid_(attn|mlp)`` modules, else every block
            ``(h|layers|layer|blocks).<i>`` (Hugging Face GPT-2, ``nn.TransformerEncoder``). For tuple outputs
            the first tensor is used.
        module_types: Module classes (or dotted paths) to watch instead of / besides ``layer_pattern``.
        embed_pattern: Regex of the module whose output is X_0 (``None`` to skip). The default names lnstab's and
            Hugging Face GPT-2's ``transformer.drop``; a pattern that matches no module is said in a warning at setup
            (once), and the ``embed`` site is not measured; one that matches several is refused at setup.
        final_pattern: Regex of the module whose *input* is the final-norm input (``None`` to skip). The default
            names ``transformer.ln_f``; a pattern that matches no module (torch's ``TransformerEncoder`` calls its
            final norm ``encoder.norm``) is said in a warning at setup (once), naming a final norm it could be, and
            the ``final`` site is not measured; one that matches several (``norm$`` on Llama, whose every layer has
            norms) is refused at setup, naming them.
        log_heatmap: Add the heatmaps to TensorBoard at the end of training.
        series_file: File name of the series in the run directory (``None`` to skip).
        stats: One name or a list of registered residual-stream statistics to log (``None``: every one marked
            ``default``: ``mean_abs``, ``var_entry``, ``var_data`` and ``max_abs`` unless a project registers more).
        unroll_repeats: A layer module that one forward runs several times (a looped block, weights shared across
            depth) is measured call by call, each call a layer of its own in call order (``L00 … L03`` for one block
            looped four times): at the first training batch one extra forward on one of its rows (eval mode, no
            grad) counts the calls. ``False``: every call of a module is pooled into its one site, said in a warning.
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics** (``<tag>`` is ``embed``, ``L00_attn``, ``L00_mlp``, …, ``final``):
        ``hidden/mean_abs/<tag>``, ``hidden/var_entry/<tag>``, ``hidden/var_data/<tag>``, ``hidden/max_abs/<tag>``
        (and ``hidden/<stat>/<tag>`` for every further statistic in ``stats``).

    Raises:
        ConfigError: A bad argument, or a strategy it cannot serve (one line naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[HiddenStateStatistics(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        layer_pattern: str | None = None,
        module_types: Any = None,
        embed_pattern: str | None = EMBED_PATTERN,
        final_pattern: str | None = FINAL_PATTERN,
        log_heatmap: bool = True,
        series_file: str | None = HIDDEN_SERIES_FILE,
        stats: str | list[str] | tuple[str, ...] | None = None,
        unroll_repeats: bool = False,
        metric_prefix: str | None = None,
    ) -> None:
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.layer_pattern = require.regex("layer_pattern", layer_pattern)
        self.module_types = resolve_types("module_types", module_types)
        self.embed_pattern = require.regex("embed_pattern", embed_pattern)
        self.final_pattern = require.regex("final_pattern", final_pattern)
        self.log_heatmap = require.flag("log_heatmap", log_heatmap)
        self.series_file = require.file_name("series_file", series_file)
        stream = list(_stats.names_of("stream"))
        names = _stats.default_stats() if stats is None else require.choices("stats", stats, stream)
        if not names:
            raise ConfigError(f"stats={stats!r} is not allowed; give at least one of: {', '.join(stream)}")
        self.stats: tuple[str, ...] = tuple(names)
        self.unroll_repeats = require.flag("unroll_repeats", unroll_repeats)
        self.unroll_hint = "" if self.unroll_repeats else (", so depth within a loop is not resolved "
                                                           "(unroll_repeats=True measures each call)")
        self._unrolled = False
        self.sites: list[Site] = []
        self.steps: list[int] = []
        self.values: dict[str, dict[str, list[float]]] = {s: {} for s in self.stats}
        self.last: dict[str, float] = {}
        self._capture_step: int | None = None
        self._told_ends: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        # what else selects the sites and the file only when it is not the default: older checkpoints keep their key
        extra = {k: str(v) for k, v in (("module_types", [t.__qualname__ for t in self.module_types] or None),
                                        ("stats", None if self.stats == tuple(_stats.default_stats()) else self.stats),
                                        ("series_file", None if self.series_file == HIDDEN_SERIES_FILE
                                         else self.series_file),
                                        ("unroll_repeats", self.unroll_repeats or None)) if v is not None}
        return self._generate_state_key(every_n_steps=self.every_n_steps, layer_pattern=str(self.layer_pattern),
                                        **extra)

    @property
    def tags(self) -> list[str]:
        """Site tags in depth order."""
        return [s.tag for s in self.sites]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__)
        if self.series_file and any(isinstance(c, HiddenStateStatistics) and c is not self and
                                    c.series_file == self.series_file for c in trainer.callbacks):
            raise ConfigError(f"series_file={self.series_file!r} is not allowed for two HiddenStateStatistics; each "
                              "would overwrite the other's: give each its own series_file (or None)")
        self.sites = auto_sites(
            pl_module, self.layer_pattern, self.module_types, self.embed_pattern, self.final_pattern
        )
        if not any(s.tag.startswith("L") for s in self.sites):  # no layer: at most the embedding and final sites
            rank_zero_warn(no_sites(type(self).__name__, self.layer_pattern, self.module_types,
                                    "only the embedding and final sites are measured" if self.sites else
                                    "nothing will be logged"))
        ends = no_end_sites(type(self).__name__, pl_module, self.sites, self.embed_pattern, self.final_pattern)
        if ends is not None and ends not in self._told_ends:  # once, not at every setup of a fit, validate, test
            self._told_ends.add(ends)
            rank_zero_warn(ends)
        self.subscribe(pl_module, self.sites, [self.stats] * len(self.sites))
        self._unrolled = False

    @override
    def unroll(self, pl_module: nn.Module, batch: Any) -> None:
        unrolled = self.unroll_sites(pl_module, batch, self.sites)
        if unrolled is not None:
            self.sites = unrolled[0]
            self.subscribe(pl_module, self.sites, [self.stats] * len(self.sites))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # a step still measuring is finished first
        self._write(trainer)

    def reduce(self, trainer: pl.Trainer) -> torch.Tensor | None:
        """The captured step's statistics as a ``(len(stats), sites)`` device tensor (rows in ``stats`` order),
        reduced over ranks; ``None`` when some site was not captured."""
        sub = self.subscription
        if sub is None or not self.captured_everywhere(trainer):
            return None
        table = sub.reduce(trainer, self.stats)
        return torch.stack([table[name] for name in self.stats])

    def metric_name(self, stat: str, tag: str) -> str:
        return f"hidden/{stat}/{tag}"

    def _finalize(self, trainer: pl.Trainer) -> None:
        """As :class:`MeasuringTapCallback`'s, and the values join the series ``hidden_stats.json`` holds."""
        step, self._capture_step = self._capture_step, None
        self.subscription.active = False
        self.repeats_pooled()
        table = self.reduce(trainer)
        if table is None:
            self.unmeasured(step)
        self.subscription.reset()  # frees the per-site state until the next logging step
        if table is None:
            return
        values = table.tolist()  # the one host sync of this logging event
        self.steps.append(step)
        self.last = {}
        for stat, row in zip(self.stats, values, strict=True):
            for tag, value in zip(self.tags, row, strict=True):
                self.values[stat].setdefault(tag, []).append(value)
                self.last[self.metric_name(stat, tag)] = value
        self.log_step(trainer, self.last, step)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:
        """A checkpoint without this instance's state (its ``every_n_steps`` changed, so its state key did) but with
        one other instance's of the same class over the same sites and statistics: that series is this one's, so the
        run's series file keeps it (before, it was read back from ``<checkpoint>/../../hidden_stats.json``, only where
        the checkpoint sat in its run's ``checkpoints/``)."""
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states or not self.tags:
            return
        mine = [s for k, s in states.items() if k.split("{")[0] == type(self).__name__ and isinstance(s, dict)
                and set(self.stats) <= set(s.get("values", {}))
                and all(set(s["values"][stat]) == set(self.tags) for stat in self.stats)]
        if len(mine) == 1:
            self.load_state_dict(mine[0])
            rank_zero_warn(f"{type(self).__name__}: resumed without its state in the checkpoint (every_n_steps "
                           f"changed); its {len(self.steps)} earlier steps are taken from the checkpoint's "
                           "instance over the same sites")

    @rank_zero_only
    def _write(self, trainer: pl.Trainer) -> None:
        if not self.steps:
            return
        if self.series_file is not None and writes_files(trainer):  # none under fast_dev_run
            series = {"tags": self.tags, "steps": self.steps, "stats": self.values}
            # strict JSON: a diverged run's NaN/inf are tagged {"$float": "nan"}, which read_hidden_series gives back
            text = json.dumps(json_safe(series), indent=1, allow_nan=False)
            atomic_write_text(run_dir(trainer) / self.series_file, text + "\n")
        writer = tensorboard_writer(trainer)
        if self.log_heatmap and writer is not None:
            for stat in self.stats:
                writer.add_figure(self.prefixed(f"hidden/heatmap/{stat}"), self.heatmap(stat),
                                  global_step=trainer.global_step)

    def heatmap(self, stat: str) -> Any:
        """A matplotlib figure: sites (rows, depth downwards) × logged steps (columns), log colour scale."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm

        tags = [t for t in self.tags if t in self.values[stat]]
        data = torch.tensor([self.values[stat][t] for t in tags], dtype=torch.float64).nan_to_num(nan=0.0)
        fig, ax = plt.subplots(figsize=(6, 0.25 * len(tags) + 1.5))
        positive = data[data > 0]
        norm = LogNorm(positive.min().item(), positive.max().item()) if positive.numel() else None
        image = ax.imshow(data.clamp_min(1e-30).numpy(), aspect="auto", norm=norm, interpolation="nearest")
        ax.set_yticks(range(len(tags)), tags, fontsize=6)
        ticks = list(range(0, len(self.steps), max(1, len(self.steps) // 8)))
        ax.set_xticks(ticks, [str(self.steps[i]) for i in ticks], fontsize=6)
        ax.set_xlabel("step")
        ax.set_title(f"hidden/{stat}")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        return fig

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "values": {k: dict(v) for k, v in self.values.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = list(state_dict["steps"])
        self.values = {s: {t: list(v) for t, v in state_dict["values"].get(s, {}).items()} for s in self.stats}
