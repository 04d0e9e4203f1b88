"""Spectral norms of each block's input–output Jacobian on a fixed probe batch (Propositions 7 and 8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from typing_extensions import override

from lnstab import validation as require
from lnstab.errors import ConfigError, first_line

from ._aside import aside
from ._sites import BLOCK_PATTERN, LogsMetrics, Site, find_sites, first_tensor, probe_input
from ._strategy import distributed, require_strategy, unsharded
from ._tap import paused_taps
from ._unroll import per_call


def power_iteration(jtj: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n_iter: int, seed: int = 0
                    ) -> torch.Tensor:
    """The largest singular value of a Jacobian ``J`` at ``x``, given ``jtj: v ↦ JᵀJv``: ``n_iter`` steps from a
    seeded random unit vector, the estimate the Rayleigh quotient ``√(vᵀJᵀJv)`` of the last unit vector ``v``."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    v = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    v = v / torch.linalg.vector_norm(v)
    estimate = torch.zeros((), device=x.device, dtype=x.dtype)
    for _ in range(n_iter):
        w = jtj(v)
        estimate = (v * w).sum().clamp_min(0).sqrt().detach()
        v = (w / torch.linalg.vector_norm(w).clamp_min(1e-30)).detach()
    return estimate


def spectral_norm(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n_iter: int, seed: int = 0
                  ) -> torch.Tensor:
    """Largest singular value of the Jacobian of ``fn`` at ``x`` (``fn`` maps a tensor to one of the same size):
    :func:`power_iteration` with ``torch.func.jvp`` (``Jv``) and ``torch.func.vjp`` (``Jᵀu``); a 0-dim device tensor
    (no host sync)."""
    _, vjp_fn = torch.func.vjp(fn, x)
    return power_iteration(lambda v: vjp_fn(torch.func.jvp(fn, (x,), (v,))[1])[0], x, n_iter, seed)


def block_call(block: nn.Module, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ block(x, *args[1:], **kwargs)``'s first tensor: the block as a map of its hidden-state input alone, its
    other arguments (attention masks, positions) held at what one forward pass gave it, without key/value caches.
    Used by :class:`JacobianSensitivity` and by ``lnstab check``'s probes."""
    kwargs = {k: v for k, v in kwargs.items() if "cache" not in k and "past" not in k}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False

    def fn(x: torch.Tensor) -> torch.Tensor:
        return first_tensor(block(x, *args[1:], **kwargs))

    return fn


def probe_blocks(root: nn.Module, blocks: list[Site], forward: Callable[[], Any],
                 norms: Callable[[nn.Module, tuple, dict, torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, float]:
    """``jacobian/<name>/<tag>`` of every call of ``blocks`` in ``forward()`` (``root`` in eval mode, no grad): each
    ``name`` that ``norms(block, args, kwargs, x)`` gives at the call's input ``x`` (math attention), then
    ``act_scale``, mean |x|; one host sync, nothing written to ``.grad``. A block that the forward runs several
    times is measured at every call, each a layer of its own in call order (:func:`per_call`). Used by
    :class:`JacobianSensitivity` and by ``lnstab check``'s probes."""
    calls: list[tuple[int, tuple, dict]] = []  # (block, args, kwargs) in call order
    handles = [s.module.register_forward_pre_hook(lambda m, args, kwargs, i=i: calls.append((i, args, kwargs)),
                                                  with_kwargs=True) for i, s in enumerate(blocks)]
    was_training = root.training
    root.eval()
    names, values = [], []
    try:
        with torch.no_grad():
            forward()
        for handle in handles:
            handle.remove()
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            for site, args, kwargs in per_call(blocks, calls):  # a looped block: every call, a layer of its own
                x = first_tensor(args).detach()
                for name, value in (*norms(site.module, args, kwargs, x).items(), ("act_scale", x.abs().mean())):
                    names.append(f"jacobian/{name}/{site.tag}")
                    values.append(value.detach())
    finally:
        for handle in handles:
            handle.remove()
        root.train(was_training)
    return dict(zip(names, torch.stack(values).tolist() if values else [], strict=True))


class JacobianSensitivity(LogsMetrics, Callback):
    """Spectral norms of every block's Jacobian on a small fixed probe batch, beside the block's activation scale.

    For a block ``B`` (the map of one layer, ``X ↦ X + Δt·f(X)`` for a residual block; the whole sequence
    ``(P, n, d)`` of the probe is one vector) at its input ``X`` during a forward pass on the probe:

    * ``jacobian/residual/<L>`` = ‖∇_X B‖₂ = ‖I + Δt∇_X f‖₂ (the layer's input–output Jacobian);
    * ``jacobian/sensitivity/<L>`` = ‖∇_X (B(X) − X)‖₂ = Δt‖∇_X f‖₂ (the residual branch alone);
    * ``jacobian/act_scale/<L>`` = mean |X| at the block's input (Proposition 7/8: sensitivity ∝ 1/scale).

    A block that the probe's forward runs several times (a looped block, its weights shared across depth) is measured
    at every call's input, each call a layer of its own in call order (``L00 … L03`` for one block looped four
    times). Both norms come from power iteration (:func:`spectral_norm`). The module is put in eval mode (no
    dropout) and restored afterwards; attention runs with the math SDPA kernel (forward-mode AD); nothing is written
    to ``.grad``. The probe is the first ``probe_size`` rows of the first training batch's input (``batch[0]``,
    ``batch["input_ids"]`` or the batch tensor) of rank 0, broadcast to every rank, or ``probe``; the forward is
    ``pl_module(probe)``. It is measured once per optimizer step, before the step's first micro-batch; under FSDP
    with the full parameters gathered (:func:`lnstab.callbacks.unsharded`), every rank taking part. While it runs
    the training progress bar's postfix says ``jacobian probe…`` (without a TQDM bar, a rank-zero line does), and
    :class:`Throughput` leaves its time out of the training rates.

    Args:
        every_n_steps: Measure on optimizer steps ``0, M, 2M, …``.
        probe_size: Sequences taken from the first batch.
        probe: A fixed input tensor instead (kept on the module's device).
        n_iter: Power iterations per norm.
        layer_pattern: Regex of the blocks, first capture group the layer index.
        seed: Seed of the power iteration's start vector.
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics**:
        ``jacobian/residual/L07``, ``jacobian/sensitivity/L07``, ``jacobian/act_scale/L07``.

    Raises:
        ConfigError: A bad argument, a LightningModule without ``forward``, or a strategy it cannot serve (one
            line naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[JacobianSensitivity(every_n_steps=1000, probe_size=2)])
    """

    def __init__(
        self,
        every_n_steps: int = 1000,
        probe_size: int = 2,
        probe: torch.Tensor | None = None,
        n_iter: int = 20,
        layer_pattern: str = BLOCK_PATTERN,
        seed: int = 0,
        metric_prefix: str | None = None,
    ) -> None:
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.probe_size = require.positive_int("probe_size", probe_size)
        if probe is not None and not isinstance(probe, torch.Tensor):
            raise ConfigError(f"probe={type(probe).__name__} is not allowed; give a tensor or None")
        self.probe = probe
        self.n_iter = require.positive_int("n_iter", n_iter)
        self.layer_pattern = require.regex("layer_pattern", layer_pattern, optional=False)
        self.seed = require.integer("seed", seed)
        self.blocks: list[Site] = []
        self.last: dict[str, float] = {}
        self._measured_step: int | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, layer_pattern=self.layer_pattern.pattern)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__, reads_parameters=True)
        if type(pl_module).forward is pl.LightningModule.forward:  # it runs pl_module(probe) outside the step
            raise ConfigError(f"model={type(pl_module).__name__} is not allowed with {type(self).__name__}; it has no "
                              "forward, and the probe runs pl_module(probe): define forward (e.g. return "
                              "self.model(idx))")
        self.blocks = find_sites(pl_module, self.layer_pattern)
        if not self.blocks:
            rank_zero_warn(f"{type(self).__name__}: layer_pattern matched no module; nothing will be logged")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.blocks = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.probe is None:
            probe = probe_input(batch, self.probe_size)
            self.probe = trainer.strategy.broadcast(probe.cpu(), src=0) if distributed(trainer) else probe
        step = trainer.global_step
        if self.blocks and step % self.every_n_steps == 0 and step != self._measured_step:
            self._measured_step = step  # once per optimizer step, whatever the accumulation
            with aside(trainer, "jacobian probe", pl_module.device):  # said on the bar, not counted as training
                self.last = self.measure(pl_module, trainer)
            self.log_step(trainer, self.last, step)

    def measure(self, pl_module: nn.Module, trainer: pl.Trainer | None = None) -> dict[str, float]:
        """All three metrics of every block on the probe (one host sync); other instruments' taps are paused.
        With a ``trainer`` whose strategy shards parameters, every rank must call this (the shards are gathered)."""
        with unsharded(trainer, pl_module) as module, paused_taps(pl_module):
            return self._measure(module)

    def _measure(self, pl_module: nn.Module) -> dict[str, float]:
        def norms(block: nn.Module, args: tuple, kwargs: dict, x: torch.Tensor) -> dict[str, torch.Tensor]:
            fn = block_call(block, args, kwargs)
            return {"residual": spectral_norm(fn, x, self.n_iter, self.seed),
                    "sensitivity": spectral_norm(lambda z: fn(z) - z, x, self.n_iter, self.seed)}

        return probe_blocks(pl_module, self.blocks, lambda: self._forward(pl_module), norms)

    def _forward(self, pl_module: nn.Module) -> None:
        try:
            pl_module(self.probe.to(pl_module.device))
        except (RuntimeError, IndexError, ValueError, TypeError) as exc:  # not an input the model takes
            raise ConfigError(
                f"{type(self).__name__}: the model's forward on its probe (shape {tuple(self.probe.shape)}, "
                f"{self.probe.dtype}; the first tensor of the first training batch unless probe= is given) "
                f"failed: {type(exc).__name__}: {first_line(exc)[:200]}; give probe= an input the model takes"
            ) from exc

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"probe": None if self.probe is None else self.probe.cpu()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("probe") is not None:
            self.probe = state_dict["probe"]
