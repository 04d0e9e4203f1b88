"""The check's Jacobian probe: each block's residual-branch sensitivity Δt‖∂f/∂X‖₂ beside its input scale, at the
steps the criteria read (the branch only, by double backward: see benchmarks/README.md). Metric names are those of
:class:`~lnstab.callbacks.JacobianSensitivity`: ``jacobian/sensitivity/Lxx`` and ``jacobian/act_scale/Lxx``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lnstab import validation as require
from lnstab.callbacks import spectral_norm
from lnstab.callbacks.jacobian import block_call, power_iteration, probe_blocks
from lnstab.callbacks.sites import find_sites, log_metrics, paused_taps, probe_input


def branch_norm(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n_iter: int, seed: int = 0
                ) -> torch.Tensor:
    """Largest singular value of the Jacobian of ``fn`` at ``x`` by :func:`lnstab.callbacks.jacobian.power_iteration`,
    as :func:`lnstab.callbacks.spectral_norm` but by double backward (``Jv`` is the vector–Jacobian product of the
    linear map ``u ↦ Jᵀu``); a 0-dim tensor."""
    xr = x.detach().requires_grad_(True)
    y = fn(xr)
    u = torch.zeros_like(y, requires_grad=True)
    (jt_u,) = torch.autograd.grad(y, xr, u, create_graph=True)  # Jᵀu, linear in u

    def jtj(v: torch.Tensor) -> torch.Tensor:
        (jv,) = torch.autograd.grad(jt_u, u, v, retain_graph=True)  # J v
        return torch.autograd.grad(y, xr, jv, retain_graph=True)[0]  # Jᵀ J v

    return power_iteration(jtj, x, n_iter, seed)


def _branch_call(block: nn.Module, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block's residual branch ``x ↦ block(x) − x``, called as the captured call (caches off)."""
    call = block_call(block, args, kwargs)
    return lambda x: call(x) - x


def measure_branches(root: nn.Module, blocks: list[Any], probe: torch.Tensor, n_iter: int, seed: int = 0
                     ) -> dict[str, float]:
    """``jacobian/sensitivity/<tag>`` and ``jacobian/act_scale/<tag>`` of every block site on ``probe``
    (:func:`lnstab.callbacks.jacobian.probe_blocks`), other instruments' taps paused."""

    def norms(block: nn.Module, args: tuple, kwargs: dict, x: torch.Tensor) -> dict[str, torch.Tensor]:
        fn = _branch_call(block, args, kwargs)
        try:
            return {"sensitivity": branch_norm(fn, x, n_iter, seed)}
        except RuntimeError:  # an operation without double backward
            return {"sensitivity": spectral_norm(fn, x, n_iter, seed)}

    with paused_taps(root):
        return probe_blocks(root, blocks, lambda: root(probe), norms)


class BranchProbe(Callback):
    """Measures :func:`measure_branches` on the first ``probe_size`` rows of the first batch, at the start of the
    given optimizer steps (step 0: the initial weights), for single-device stress runs.

    Args:
        layer_pattern: Regex of the blocks, first group the layer index.
        steps: Optimizer steps to measure at.
        probe_size: Sequences of the probe.
        n_iter: Power iterations per norm.

    **Logged metrics**: ``jacobian/sensitivity/Lxx``, ``jacobian/act_scale/Lxx``.

    Example::

        trainer = Trainer(callbacks=[BranchProbe(r"h\\.(\\d+)$", steps=(0, 30))])
    """

    def __init__(self, layer_pattern: str, steps: tuple[int, ...], probe_size: int = 2, n_iter: int = 8) -> None:
        self.layer_pattern = require.regex("layer_pattern", layer_pattern, optional=False)
        self.steps = frozenset(require.integer("steps", s, 0) for s in steps)
        self.probe_size = require.positive_int("probe_size", probe_size)
        self.n_iter = require.positive_int("n_iter", n_iter)
        self.blocks: list[Any] = []
        self.probe: torch.Tensor | None = None
        self.last: dict[str, float] = {}
        self._done: set[int] = set()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.blocks = find_sites(pl_module, self.layer_pattern)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if self.probe is None:
            self.probe = probe_input(batch, self.probe_size)
        step = trainer.global_step
        if self.blocks and step in self.steps and step not in self._done:
            self._done.add(step)
            self.last = measure_branches(pl_module, self.blocks, self.probe.to(pl_module.device), self.n_iter)
            log_metrics(trainer, self.last, step)
