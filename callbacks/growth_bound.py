"""Theorem 4's growth bound for Peri-LN, checked live, and the growth law of the mean |x| over depth."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from ._sites import (
    EMBED_PATTERN,
    FINAL_PATTERN,
    Site,
    TapCallback,
    all_reduce_,
    check_positive_int,
    check_regex,
    log_metrics,
)
from .hidden_stats import auto_sites, resolve_types

OUTPUT_NORMS = r"(?:^|\.)h\.(\d+)\.ln_([12])_out$"
_SIBLING = {"ln_1_out": "resid_attn", "ln_2_out": "resid_mlp"}


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``y`` on ``x`` and its R² (``nan`` when undefined)."""
    n = len(x)
    if n < 2 or any(not math.isfinite(v) for v in y):
        return math.nan, math.nan
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    syy = sum((b - my) ** 2 for b in y)
    slope = sxy / sxx
    r2 = 1.0 - (syy - slope * sxy) / syy if syy > 0 else 1.0
    return slope, r2


class GrowthBoundMonitor(TapCallback):
    """Checks Theorem 4's bound on the final mean |x| of Peri-LN models; fits the growth law of MA over depth.

    **Bound.** When every residual update is ``x ← x + Δt·N(y)`` with an output norm ``N`` (LayerNorm or RMSNorm,
    weight γ, bias β) the normalised vector of each token has RMS ≤ 1, so each update adds at most
    ``Δt·(γmax + βmax)·√d`` to a token's Euclidean norm (γmax = max |γ|, βmax = max |β|, 0 without bias). With
    ``S = Σ_updates Δt·(γmax + βmax)`` over the 2D output norms and, per sequence of n tokens of width d,
    ``RMS(X) = ‖X‖_F/√(nd)`` and ``MA(X) = mean |x|``:

    * MA bound (Theorem 4): ``MA(X_D) ≤ RMS(X_D) ≤ RMS(X_0) + S``;
    * variance bound: ``Var_entry(X_D) ≤ mean(X_D²) = RMS(X_D)² ≤ (RMS(X_0) + S)²``.

    Both are evaluated for every sequence of the batch from the live γ, β of the step (Δt read from each norm's
    sibling ``resid_attn``/``resid_mlp`` ``.scale`` unless ``residual_scale`` is given); a sequence above a bound
    by more than a relative 1e-5 adds one to the cumulative ``bound/violations`` (must stay 0). X_D is the
    final-norm input. Models without the 2D output norms get no bound metrics, only the growth law.

    **Growth law.** ``y_k`` = MA after the k-th site (X_0 at depth 0, half-step k at depth k/2 layers) averaged
    over the batch; least-squares fits ``y = a + b·depth`` and ``log y = a + r·depth`` give the per-layer slope
    ``b``, the per-layer log-growth rate ``r`` (factor ``e^r`` per layer) and their R².

    Args:
        every_n_steps: Evaluate on optimizer steps ``0, N, 2N, …`` (hooks are no-ops on other steps).
        residual_scale: Δt for every update; ``None`` reads each ``Residual.scale`` (1.0 when absent).
        norm_pattern: Regex of the output norms, one per residual update.
        layer_pattern, module_types, embed_pattern, final_pattern: Sites, as in :class:`HiddenStateStatistics`.
        tolerance: Relative slack allowed before a violation is counted (float rounding).

    **Logged metrics**:
        ``bound/ma_bound``, ``bound/ma_final``, ``bound/slack`` (min over sequences of bound − MA),
        ``bound/var_bound``, ``bound/var_final``, ``bound/var_slack``, ``bound/violations``;
        ``growth/linear_slope``, ``growth/linear_r2``, ``growth/exp_rate``, ``growth/exp_r2``.

    Raises:
        ValueError: A bad argument (the message names it).

    Example::

        trainer = Trainer(callbacks=[GrowthBoundMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        residual_scale: float | None = None,
        norm_pattern: str = OUTPUT_NORMS,
        layer_pattern: str | None = None,
        module_types: Any = None,
        embed_pattern: str = EMBED_PATTERN,
        final_pattern: str | None = FINAL_PATTERN,
        tolerance: float = 1e-5,
    ) -> None:
        self.every_n_steps = check_positive_int("every_n_steps", every_n_steps)
        if residual_scale is not None and not (isinstance(residual_scale, int | float) and residual_scale > 0):
            raise ValueError(f"residual_scale={residual_scale!r} is not allowed; it must be a number > 0 or None")
        self.residual_scale = residual_scale
        self.norm_pattern = check_regex("norm_pattern", norm_pattern, optional=False)
        self.layer_pattern = check_regex("layer_pattern", layer_pattern)
        self.module_types = resolve_types("module_types", module_types)
        self.embed_pattern = check_regex("embed_pattern", embed_pattern, optional=False)
        self.final_pattern = check_regex("final_pattern", final_pattern)
        if not (isinstance(tolerance, int | float) and 0 <= tolerance < 1):
            raise ValueError(f"tolerance={tolerance!r} is not allowed; it must be a number in [0, 1)")
        self.tolerance = float(tolerance)
        self.violations = 0
        self.last: dict[str, float] = {}
        self.sites: list[Site] = []
        self.norms: list[tuple[nn.Module, float]] = []
        self.depths: list[float] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._step: int | None = None
        self._gsum: torch.Tensor | float | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, norm_pattern=self.norm_pattern.pattern)

    def _scale_of(self, root: nn.Module, name: str) -> float:
        if self.residual_scale is not None:
            return float(self.residual_scale)
        parent, _, leaf = name.rpartition(".")
        sibling = f"{parent}.{_SIBLING[leaf]}" if leaf in _SIBLING and parent else None
        modules = dict(root.named_modules())
        return float(getattr(modules.get(sibling), "scale", 1.0)) if sibling else 1.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.sites = auto_sites(
            pl_module, self.layer_pattern, self.module_types, self.embed_pattern, self.final_pattern
        )
        layers = [s for s in self.sites if s.tag.startswith("L")]
        if not layers:
            rank_zero_warn(f"{type(self).__name__}: no layers found; nothing will be logged")
            self.sites = []
        elif self.sites[0].tag != "embed":  # X_0 = the input of the first layer
            self.sites.insert(0, Site("embed", layers[0].name, layers[0].module, use_input=True))
        n_layers = len({s.tag.split("_")[0] for s in layers}) or 1
        per_layer = len(layers) / n_layers
        self.depths = [0.0] + [(k + 1) / per_layer for k in range(len(layers))]
        self.norms = [
            (m, self._scale_of(pl_module, name))
            for name, m in pl_module.named_modules()
            if self.norm_pattern.search(name) and isinstance(m, nn.LayerNorm | nn.RMSNorm)
        ]
        if self.norms and len(self.norms) != len(layers):
            rank_zero_warn(f"{len(self.norms)} output norms for {len(layers)} residual updates; bound not checked")
            self.norms = []
        self.attach_tap(self.sites, pl_module)

    def _capture(self, i: int, x: torch.Tensor) -> None:
        flat = x.reshape(x.shape[0], -1).float()  # (B, N)
        stats = [flat.abs().mean(1)]  # MA per sequence
        if self.sites[i].tag in ("embed", "final") or i == len(self.sites) - 1:
            stats += [flat.square().mean(1).sqrt(), flat.var(1, correction=0)]  # RMS, entry variance per sequence
        self._captured[i] = torch.stack(stats)  # (k, B)

    def growth_sum(self) -> float | torch.Tensor:
        """``S = Σ Δt·(γmax + βmax)`` over the output norms, from the live parameters (a device tensor)."""
        total: float | torch.Tensor = 0.0
        for norm, dt in self.norms:
            gmax = norm.weight.detach().abs().max() if getattr(norm, "weight", None) is not None else 1.0
            bias = getattr(norm, "bias", None)
            bmax = bias.detach().abs().max() if bias is not None else 0.0
            total = total + dt * (gmax + bmax)
        return total

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tap is not None and self.sites and trainer.global_step % self.every_n_steps == 0:
            self._captured, self._step = {}, trainer.global_step
            self._gsum = self.growth_sum() if self.norms else None  # the γ, β of this forward, before the update
            self.tap.active = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tap is None or not self.tap.active:
            return
        self.tap.active = False
        captured, self._captured = self._captured, {}
        if len(captured) != len(self.sites):
            return
        self._evaluate(trainer, captured, self._step)

    def _evaluate(self, trainer: pl.Trainer, captured: dict[int, torch.Tensor], step: int) -> None:
        x0, xd = captured[0], captured[len(self.sites) - 1]
        layer_ids = [i for i, s in enumerate(self.sites) if s.tag != "final"]
        ma_depth = torch.stack([captured[i][0].sum() for i in layer_ids])  # (sites,) sums over the batch
        b = torch.tensor(float(x0.shape[1]), device=x0.device)
        if self.norms:
            gsum = self._gsum if self._gsum is not None else self.growth_sum()
            bound = x0[1] + gsum  # (B,) RMS(X_0) + S
            tol = self.tolerance
            violations = (xd[0] > bound * (1 + tol)).sum() + (xd[2] > bound.square() * (1 + tol)).sum()
            sums = torch.cat([ma_depth, torch.stack([b, bound.sum(), xd[0].sum(), bound.square().sum(), xd[2].sum()])])
            sums = torch.cat([sums, violations.to(sums.dtype)[None]])
            neg_slack = torch.stack([(xd[0] - bound).max(), (xd[2] - bound.square()).max()])
        else:
            sums, neg_slack = torch.cat([ma_depth, b[None]]), torch.zeros(2, device=x0.device)
        all_reduce_(sums, "sum", trainer)
        all_reduce_(neg_slack, "max", trainer)
        values = torch.cat([sums, neg_slack]).tolist()  # one host sync
        n_depth = len(layer_ids)
        count = values[n_depth]
        ma = [v / count for v in values[:n_depth]]
        metrics: dict[str, float] = {}
        if self.norms:
            ma_bound, ma_final, var_bound, var_final, viol = values[n_depth + 1 : n_depth + 6]
            self.violations += int(viol)
            metrics.update(
                {
                    "bound/ma_bound": ma_bound / count,
                    "bound/ma_final": ma_final / count,
                    "bound/slack": -values[-2],
                    "bound/var_bound": var_bound / count,
                    "bound/var_final": var_final / count,
                    "bound/var_slack": -values[-1],
                    "bound/violations": float(self.violations),
                }
            )
        depth = [self.depths[k] for k in range(n_depth)]
        slope, r2 = fit_line(depth, ma)
        rate, r2_exp = fit_line(depth, [math.log(v) if v > 0 else math.nan for v in ma])
        metrics.update(
            {"growth/linear_slope": slope, "growth/linear_r2": r2, "growth/exp_rate": rate, "growth/exp_r2": r2_exp}
        )
        self.last = metrics
        log_metrics(trainer, metrics, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"violations": self.violations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.violations = int(state_dict["violations"])
