"""Statistics of the residual stream after every half-step: mean |x|, entry-wise and data-wise variance, max |x|."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lnstab.rundir import HIDDEN_SERIES_FILE, atomic_write_text, run_dir

from ._sites import (
    BLOCK_PATTERN,
    EMBED_PATTERN,
    FINAL_PATTERN,
    LNSTAB_RESIDUALS,
    Site,
    TapCallback,
    all_reduce_,
    check_positive_int,
    check_regex,
    find_sites,
    log_metrics,
    tensorboard_writer,
)

STATS = ("mean_abs", "var_entry", "var_data", "max_abs")


def resolve_types(name: str, value: Any) -> tuple[type, ...]:
    """Module types given as classes or dotted paths (``torch.nn.TransformerEncoderLayer``), as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    types = []
    for item in items:
        if isinstance(item, str) and "." in item:
            module, _, attr = item.rpartition(".")
            try:
                item = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                raise ValueError(f"{name}={value!r} is not allowed; {item!r} cannot be imported") from None
        if not isinstance(item, type):
            raise ValueError(f"{name}={value!r} is not allowed; give module classes or dotted class paths")
        types.append(item)
    return tuple(types)


def auto_sites(
    root: torch.nn.Module,
    layer_pattern: re.Pattern | None,
    module_types: tuple[type, ...],
    embed_pattern: re.Pattern | None,
    final_pattern: re.Pattern | None,
) -> list[Site]:
    """Sites with the user's selection, or lnstab's residual modules, or else every block (``h.3``, ``layers.3``)."""
    if layer_pattern is not None or module_types:
        return find_sites(root, layer_pattern, module_types, embed_pattern, final_pattern)
    sites = find_sites(root, re.compile(LNSTAB_RESIDUALS), (), embed_pattern, final_pattern)
    if not any(s.tag.startswith("L") for s in sites):
        sites = find_sites(root, re.compile(BLOCK_PATTERN), (), embed_pattern, final_pattern)
    return sites


class HiddenStateStatistics(TapCallback):
    """Residual-stream statistics at X_0, after every attention and MLP update, and at the final-norm input.

    For a site's tensor ``x`` of shape ``(B, n, d)`` (any ``(B, ...)``; flattened to ``(B, N)``, ``N = n·d``):

    * ``mean_abs`` = mean of ``|x|`` over all ``B·N`` entries (MA of the paper, averaged over the batch);
    * ``var_entry`` = population variance over the ``N`` entries of each sequence, averaged over the batch;
    * ``var_data`` = population variance across the ``B`` samples of each entry, averaged over the ``N`` entries;
    * ``max_abs`` = max of ``|x|``.

    Statistics are computed only on logging steps (``global_step % every_n_steps == 0``; hooks are no-ops
    otherwise), from sums on the device (float64), reduced across DDP ranks as sums (max for ``max_abs``) so that
    every value equals one process seeing the whole global batch, and read with one host sync per logging event.
    With gradient accumulation the micro-batches of the step are pooled. The whole series is written to
    ``<run dir>/hidden_stats.json`` at the end of training, and a layer × step heatmap per statistic is added to
    TensorBoard (``hidden/heatmap/<stat>``) when a TensorBoardLogger is attached.

    Args:
        every_n_steps: Log on optimizer steps ``0, N, 2N, …``.
        layer_pattern: Regex searched in module names; its first group is the layer index (``L07``), a second one is
            appended (``L07_attn``). ``None``: lnstab's ``h.<i>.resid_(attn|mlp)`` modules, else every block
            ``(h|layers|layer|blocks).<i>`` (Hugging Face GPT-2, ``nn.TransformerEncoder``). For tuple outputs
            the first tensor is used.
        module_types: Module classes (or dotted paths) to watch instead of / besides ``layer_pattern``.
        embed_pattern: Regex of the module whose output is X_0 (``None`` to skip).
        final_pattern: Regex of the module whose *input* is the final-norm input (``None`` to skip).
        log_heatmap: Add the heatmaps to TensorBoard at the end of training.
        series_file: File name of the series in the run directory (``None`` to skip).

    **Logged metrics** (``<tag>`` is ``embed``, ``L00_attn``, ``L00_mlp``, …, ``final``):
        ``hidden/mean_abs/<tag>``, ``hidden/var_entry/<tag>``, ``hidden/var_data/<tag>``, ``hidden/max_abs/<tag>``.

    Raises:
        ValueError: A bad argument (the message names it).

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
    ) -> None:
        self.every_n_steps = check_positive_int("every_n_steps", every_n_steps)
        self.layer_pattern = check_regex("layer_pattern", layer_pattern)
        self.module_types = resolve_types("module_types", module_types)
        self.embed_pattern = check_regex("embed_pattern", embed_pattern)
        self.final_pattern = check_regex("final_pattern", final_pattern)
        self.log_heatmap = bool(log_heatmap)
        if series_file is not None and (not isinstance(series_file, str) or not series_file or "/" in series_file):
            raise ValueError(f"series_file={series_file!r} is not allowed; give a plain file name or None")
        self.series_file = series_file
        self.sites: list[Site] = []
        self.steps: list[int] = []
        self.values: dict[str, dict[str, list[float]]] = {s: {} for s in STATS}
        self.last: dict[str, float] = {}
        self._buffers: list[list[torch.Tensor] | None] = []
        self._capture_step: int | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, layer_pattern=str(self.layer_pattern))

    @property
    def tags(self) -> list[str]:
        """Site tags in depth order."""
        return [s.tag for s in self.sites]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.sites = auto_sites(
            pl_module, self.layer_pattern, self.module_types, self.embed_pattern, self.final_pattern
        )
        if not self.sites:
            rank_zero_warn(f"{type(self).__name__}: no module matched; nothing will be logged")
        self.attach_tap(self.sites, pl_module)

    def _capture(self, i: int, x: torch.Tensor) -> None:
        flat = x.reshape(x.shape[0], -1).to(torch.float64)  # (B, N)
        parts = [
            torch.stack(
                [
                    flat.abs().sum(),
                    torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
                    flat.var(dim=1, correction=0).sum(),
                    torch.tensor(float(flat.shape[0]), dtype=torch.float64, device=flat.device),
                    flat.abs().amax(),
                ]
            ),  # (5,)
            flat.sum(0),  # (N,)
            flat.square().sum(0),  # (N,)
        ]
        old = self._buffers[i]
        if old is None:
            self._buffers[i] = parts
        else:  # another micro-batch of the same optimizer step
            old[0] = torch.cat([old[0][:4] + parts[0][:4], torch.maximum(old[0][4:], parts[0][4:])])
            old[1] += parts[1]
            old[2] += parts[2]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tap is None:
            return
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step not in self.steps:
            if self._capture_step != step:
                self._buffers = [None] * len(self.sites)
                self._capture_step = step
            self.tap.active = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tap is None:
            return
        self.tap.active = False
        if self._capture_step is not None and trainer.global_step != self._capture_step:
            self._finalize(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._capture_step is not None:
            self._finalize(trainer)
        self._write(trainer)

    def reduce(self, trainer: pl.Trainer) -> torch.Tensor | None:
        """The captured step's statistics as a ``(4, sites)`` device tensor (rows in ``STATS`` order), reduced."""
        bufs = self._buffers
        if not bufs or any(b is None for b in bufs):
            return None
        sums = torch.cat([torch.cat([b[0][:4], b[1], b[2]]) for b in bufs])
        maxes = torch.stack([b[0][4] for b in bufs])
        all_reduce_(sums, "sum", trainer)  # one collective for every sum of every site
        all_reduce_(maxes, "max", trainer)
        rows, offset = [], 0
        for b in bufs:
            n = b[1].numel()
            s = sums[offset : offset + 4 + 2 * n]
            offset += 4 + 2 * n
            count, seqs = s[1], s[3]
            mean = s[4 : 4 + n] / seqs  # (N,) per-entry mean over samples
            var_data = (s[4 + n :] / seqs - mean.square()).clamp_min(0).mean()
            rows.append(torch.stack([s[0] / count, s[2] / seqs, var_data]))
        return torch.cat([torch.stack(rows, 1), maxes[None]], 0)  # (4, S)

    def _finalize(self, trainer: pl.Trainer) -> None:
        step, self._capture_step = self._capture_step, None
        table = self.reduce(trainer)
        self._buffers = []
        if table is None:
            return
        values = table.tolist()  # the one host sync of this logging event
        self.steps.append(step)
        self.last = {}
        for stat, row in zip(STATS, values, strict=True):
            for tag, value in zip(self.tags, row, strict=True):
                self.values[stat].setdefault(tag, []).append(value)
                self.last[f"hidden/{stat}/{tag}"] = value
        log_metrics(trainer, self.last, step)

    @rank_zero_only
    def _write(self, trainer: pl.Trainer) -> None:
        if not self.steps:
            return
        if self.series_file is not None:
            series = {"tags": self.tags, "steps": self.steps, "stats": self.values}
            atomic_write_text(run_dir(trainer) / self.series_file, json.dumps(series, indent=1) + "\n")
        writer = tensorboard_writer(trainer)
        if self.log_heatmap and writer is not None:
            for stat in STATS:
                writer.add_figure(f"hidden/heatmap/{stat}", self.heatmap(stat), global_step=trainer.global_step)

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
        self.values = {s: {t: list(v) for t, v in state_dict["values"].get(s, {}).items()} for s in STATS}
