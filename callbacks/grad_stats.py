"""Per-layer gradient and weight norms, and the total gradient norm, with one host sync per logging event."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lnstab import validation as require

from ._sites import PARAM_LAYER_PATTERN, LogsMetrics, clean_name
from ._strategy import reduce_over_shards_, require_strategy


def group_squares(tensors: list[torch.Tensor], groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Squared L2 norm of each group of ``tensors`` (``groups[i]`` is tensor i's group, -1 for none) and of all of
    them, as one float64 vector ``(n_groups + 1,)`` (the total last): sums, so shards add up exactly."""
    squares = torch.stack(torch._foreach_norm(tensors)).double().square()  # (P,)
    per_group = torch.zeros(n_groups + 1, device=squares.device, dtype=squares.dtype)
    per_group.index_add_(0, groups.to(squares.device) + 1, squares)
    return torch.cat([per_group[1:], squares.sum()[None]])


def group_norms(tensors: list[torch.Tensor], groups: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of each group of ``tensors`` and of all of them (:func:`group_squares`, square-rooted)."""
    norms = group_squares(tensors, groups, n_groups).sqrt()
    return norms[:-1], norms[-1]


class GradientStatistics(LogsMetrics, Callback):
    """Per-layer L2 norms of the gradients and of the weights, and the total gradient norm.

    Computed in ``on_before_optimizer_step`` — once per optimizer step, after the last micro-batch's backward, DDP's
    all-reduce and AMP's unscaling, so the values are the ones the optimizer sees — every ``every_n_steps`` optimizer
    steps with ``torch._foreach_norm``; all squared norms are stacked, summed over ranks when FSDP shards the
    parameters and gradients (one collective), and read with one host sync. A parameter belongs to the layer
    given by the first capture group of ``layer_pattern`` searched in its name; other parameters (embeddings, final
    norm) only count in the totals.

    Args:
        every_n_steps: Log on optimizer steps ``0, N, 2N, …``.
        layer_pattern: Regex with one capture group, the layer index; default matches ``h.<i>.`` (lnstab, Hugging
            Face GPT-2) and ``layers.<i>.`` (``nn.TransformerEncoder``).
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics**:
        ``grad/norm/L07``, ``weight/norm/L07`` (each layer), ``grad/norm/total``, ``weight/norm/total``.

    Raises:
        ConfigError: A bad argument, or a strategy it cannot serve (one line naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[GradientStatistics(every_n_steps=100)])
    """

    def __init__(self, every_n_steps: int = 100, layer_pattern: str = PARAM_LAYER_PATTERN,
                 metric_prefix: str | None = None) -> None:
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.layer_pattern = require.regex("layer_pattern", layer_pattern, optional=False, groups=1)
        self.params: list[torch.nn.Parameter] = []
        self.layers: list[str] = []
        self.layer_of: list[int] = []
        self.last: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, layer_pattern=self.layer_pattern.pattern)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__, reads_parameters=True)
        names: dict[int, str] = {}
        unnumbered: tuple[str, str] | None = None  # a parameter the pattern matched, its group no layer index
        self.params, self.layer_of = [], []
        for name, param in pl_module.named_parameters():  # tied weights are listed once
            if not param.requires_grad:
                continue
            match = self.layer_pattern.search(clean_name(name))
            index = int(match.group(1)) if match and (match.group(1) or "").isdigit() else None
            if index is not None:
                names.setdefault(index, f"L{index:02d}")
            elif match and unnumbered is None:
                unnumbered = (clean_name(name), match.group(1))
            self.params.append(param)
            self.layer_of.append(-1 if index is None else index)
        order = sorted(names)
        position = {index: k for k, index in enumerate(order)}
        self.layers = [names[i] for i in order]
        self.layer_of = [position.get(i, -1) for i in self.layer_of]
        if not self.layers:
            why = "matched no parameter" if unnumbered is None else (
                f"captured {unnumbered[1]!r} in {unnumbered[0]!r}, no layer index (its group must capture the number "
                "alone, as h\\.(\\d+)\\. does)")
            rank_zero_warn(f"{type(self).__name__}: layer_pattern={self.layer_pattern.pattern!r} {why}; only totals "
                           "are logged")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.params, self.layer_of = [], []

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not self.params:
            return
        with torch.no_grad():
            with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            if not with_grad:
                return
            device = self.params[with_grad[0]].grad.device
            n = len(self.layers)
            groups = torch.tensor([self.layer_of[i] for i in with_grad], device=device)
            grads = group_squares([self.params[i].grad for i in with_grad], groups, n)
            weights = group_squares([p.detach() for p in self.params], torch.tensor(self.layer_of, device=device), n)
            squares = reduce_over_shards_(torch.cat([grads, weights]), "sum", trainer)  # FSDP: shards add up
            values = squares.sqrt().tolist()  # the one host sync
        grad_layers, grad_total = values[:n], values[n]
        weight_layers, weight_total = values[n + 1 : 2 * n + 1], values[2 * n + 1]
        metrics = {f"grad/norm/{tag}": v for tag, v in zip(self.layers, grad_layers, strict=True)}
        metrics.update({f"weight/norm/{tag}": v for tag, v in zip(self.layers, weight_layers, strict=True)})
        metrics["grad/norm/total"], metrics["weight/norm/total"] = grad_total, weight_total
        self.last = metrics
        self.log_step(trainer, metrics, step)
