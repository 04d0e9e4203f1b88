"""Detects divergence on the step it happens (non-finite values, loss spikes, exploding gradients, overflow risk)."""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.optim import Optimizer
from typing_extensions import override

from lnstab.rundir import EVENTS_FILE, atomic_write_text, run_dir, update_summary

from ._sites import Site, TapCallback, check_choice, check_positive_int, check_regex, log_metrics
from .hidden_stats import auto_sites

POLICIES = ("stop", "skip", "continue")
KINDS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "nonfinite_activation",
    "grad_explosion",
    "loss_spike",
    "activation_overflow",
    "remote",
)
FATAL = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_activation", "grad_explosion", "remote")


class NonFiniteCheckpointError(RuntimeError):
    """Raised instead of saving a checkpoint whose weights are not finite."""


class DivergenceMonitor(TapCallback):
    """Records divergence events on the step they happen and stops, skips the update, or continues.

    Each step (every ``every_n_steps``) the monitor keeps on the device the loss (``on_before_backward``), the
    max |x| of every watched site (forward hooks, one reduction each) and, in ``on_before_optimizer_step``, the
    total gradient norm; these are read with one host sync, *before* the optimizer step, so a bad update can be
    dropped. After the step a second sync checks the weights. Events (``step``, ``kind``, ``value``, ``layer``):

    * ``nonfinite_loss`` / ``nonfinite_grad`` / ``nonfinite_activation`` (``layer`` = the first site in depth order
      whose output was not finite) / ``nonfinite_param`` (weights after the step);
    * ``grad_explosion``: total gradient norm > ``grad_norm_threshold``;
    * ``loss_spike``: loss > mean + ``spike_k``·std of the last ``window`` finite losses (≥ 10 of them);
    * ``activation_overflow``: some |x| > ``overflow_fraction``·finfo(dtype).max;
    * ``remote``: another rank decided to act while this one saw nothing.

    On a fatal event (``fatal_kinds``; every rank agrees through ``trainer.strategy.reduce_boolean_decision``)
    the policy acts: ``stop`` drops that update (gradients set to ``None``, so the optimizer leaves the weights
    alone) and sets ``trainer.should_stop``; ``skip`` drops the update and goes on; ``continue`` only records.
    Because ``stop``/``skip`` never apply a non-finite update, the weights stay finite and a ``last`` checkpoint
    is a finite one. Should the weights become non-finite anyway (``continue``), the run stops whatever the policy
    (no later update can repair them); :class:`RunCheckpoint` then writes no further checkpoint, and a plain
    ``ModelCheckpoint`` is refused by ``on_save_checkpoint`` (:class:`NonFiniteCheckpointError`). Events go to
    ``divergence_events.jsonl`` in the run directory as they happen; the run's ``summary.json`` gets
    ``diverged_step`` (the first step the ``stop`` policy acted on or the weights became non-finite) and
    ``divergence_events``; :class:`RunStatus` turns that into ``status: diverged``.

    Args:
        policy: ``stop``, ``skip`` or ``continue``.
        every_n_steps: Check every N optimizer steps (1: every step).
        window: Losses kept for spike detection.
        spike_k: Standard deviations above the window mean that make a spike.
        grad_norm_threshold: Total gradient norm that counts as an explosion (``None``: off).
        overflow_fraction: Fraction of the dtype's maximum that counts as an overflow risk.
        fatal_kinds: Event kinds the policy acts on.
        layer_pattern: Sites whose outputs are watched, as in :class:`HiddenStateStatistics` (``None``: lnstab's
            residual modules, else every block).
        track_activations: Watch activations (one max-reduction per site per step).

    **Logged metrics**:
        ``divergence/events`` (cumulative count, at each step with an event).

    Raises:
        ValueError: A bad argument (the message names it).
        NonFiniteCheckpointError: On saving a checkpoint with non-finite weights.

    Example::

        trainer = Trainer(callbacks=[DivergenceMonitor(policy="stop", grad_norm_threshold=1e3)])
    """

    def __init__(
        self,
        policy: str = "stop",
        every_n_steps: int = 1,
        window: int = 50,
        spike_k: float = 6.0,
        grad_norm_threshold: float | None = None,
        overflow_fraction: float = 0.5,
        fatal_kinds: list[str] | tuple[str, ...] = FATAL,
        layer_pattern: str | None = None,
        track_activations: bool = True,
    ) -> None:
        self.policy = check_choice("policy", policy, POLICIES)
        self.every_n_steps = check_positive_int("every_n_steps", every_n_steps)
        self.window = check_positive_int("window", window)
        if not (isinstance(spike_k, int | float) and spike_k > 0):
            raise ValueError(f"spike_k={spike_k!r} is not allowed; it must be a number > 0")
        if grad_norm_threshold is not None and not (
            isinstance(grad_norm_threshold, int | float) and grad_norm_threshold > 0
        ):
            raise ValueError(f"grad_norm_threshold={grad_norm_threshold!r} is not allowed; it must be > 0 or None")
        if not (isinstance(overflow_fraction, int | float) and 0 < overflow_fraction <= 1):
            raise ValueError(f"overflow_fraction={overflow_fraction!r} is not allowed; it must be in (0, 1]")
        if isinstance(fatal_kinds, str):
            fatal_kinds = [fatal_kinds]
        for kind in fatal_kinds:
            check_choice("fatal_kinds", kind, KINDS)
        self.spike_k, self.grad_norm_threshold = float(spike_k), grad_norm_threshold
        self.overflow_fraction, self.fatal_kinds = float(overflow_fraction), tuple(fatal_kinds)
        self.layer_pattern = check_regex("layer_pattern", layer_pattern)
        self.track_activations = bool(track_activations)
        self.events: list[dict[str, Any]] = []
        self.losses: deque[float] = deque(maxlen=window)
        self.diverged_step: int | None = None
        self.sites: list[Site] = []
        self._maxes: list[torch.Tensor | None] = []
        self._dtype_max = math.inf
        self._loss: torch.Tensor | None = None
        self._acted = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.track_activations:
            self.sites = [s for s in auto_sites(pl_module, self.layer_pattern, (), None, None)]
            self.attach_tap(self.sites, pl_module)

    def _capture(self, i: int, x: torch.Tensor) -> None:
        value = torch.linalg.vector_norm(x, ord=math.inf).float()  # NaN/inf propagate
        old = self._maxes[i]
        self._maxes[i] = value if old is None else torch.maximum(old, value)
        if x.is_floating_point():
            self._dtype_max = min(self._dtype_max, torch.finfo(x.dtype).max)

    def _checking(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step % self.every_n_steps == 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._checking(trainer) and self.tap is not None:
            if not self.tap.active:
                self._maxes = [None] * len(self.sites)
            self.tap.active = True

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._checking(trainer):
            return
        if self.tap is not None:
            self.tap.active = False
        step = trainer.global_step
        device = pl_module.device
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        grad_norm = (
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
            if grads
            else torch.zeros((), device=device)
        )
        loss = self._loss.float().reshape(()) if self._loss is not None else torch.full((), math.nan, device=device)
        maxes = [m.to(device) if m is not None else torch.zeros((), device=device) for m in self._maxes]
        values = torch.stack([loss, grad_norm, *maxes]).tolist()  # one host sync
        loss_v, grad_v, site_v = values[0], values[1], values[2:]
        new: list[dict[str, Any]] = []
        if not math.isfinite(loss_v):
            new.append(self._event(step, "nonfinite_loss", loss_v))
        bad_site = next((i for i, v in enumerate(site_v) if not math.isfinite(v)), None)
        if bad_site is not None:
            new.append(self._event(step, "nonfinite_activation", site_v[bad_site], self.sites[bad_site].tag))
        if not math.isfinite(grad_v):
            new.append(self._event(step, "nonfinite_grad", grad_v))
        elif self.grad_norm_threshold is not None and grad_v > self.grad_norm_threshold:
            new.append(self._event(step, "grad_explosion", grad_v))
        limit = self.overflow_fraction * self._dtype_max
        hot = next((i for i, v in enumerate(site_v) if math.isfinite(v) and v > limit), None)
        if hot is not None:
            new.append(self._event(step, "activation_overflow", site_v[hot], self.sites[hot].tag))
        if math.isfinite(loss_v):
            if len(self.losses) >= 10:
                mean, std = statistics.fmean(self.losses), statistics.pstdev(self.losses)
                if loss_v > mean + self.spike_k * std:
                    new.append(self._event(step, "loss_spike", loss_v))
            self.losses.append(loss_v)
        local_fatal = any(e["kind"] in self.fatal_kinds for e in new)
        act = trainer.strategy.reduce_boolean_decision(local_fatal, all=False)
        if act and not local_fatal:
            new.append(self._event(step, "remote", math.nan))
        self._record(trainer, new, step)
        self._acted = act and self.policy != "continue"
        if act and self.policy == "stop" and self.diverged_step is None:
            self.diverged_step = step
        if self._acted:  # drop the update: the optimizer skips parameters without gradients
            optimizer.zero_grad(set_to_none=True)
            if self.policy == "stop":
                trainer.should_stop = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tap is not None:
            self.tap.active = False
        if not self._checking_previous(trainer):
            return
        step = trainer.global_step - 1  # the update that just happened
        finite = self.params_finite(pl_module)
        decision = trainer.strategy.reduce_boolean_decision(not finite, all=False)  # every rank takes part
        if not finite:
            self._record(trainer, [self._event(step, "nonfinite_param", math.nan)], step)
        if decision:  # no update can bring non-finite weights back: the run ends whatever the policy
            if self.diverged_step is None:
                self.diverged_step = step
            trainer.should_stop = True

    def _checking_previous(self, trainer: pl.Trainer) -> bool:
        return (trainer.global_step - 1) % self.every_n_steps == 0

    @staticmethod
    def params_finite(pl_module: pl.LightningModule) -> bool:
        """Whether every parameter is finite (one fused norm and one host sync)."""
        params = [p.detach() for p in pl_module.parameters()]
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(params)).sum()).item()) if params else True

    def _event(self, step: int, kind: str, value: float, layer: str | None = None) -> dict[str, Any]:
        return {"step": step, "kind": kind, "value": value if math.isfinite(value) else str(value), "layer": layer}

    def _record(self, trainer: pl.Trainer, new: list[dict[str, Any]], step: int) -> None:
        if not new:
            return
        self.events.extend(new)
        log_metrics(trainer, {"divergence/events": float(len(self.events))}, step)
        self._write_events(trainer)

    @rank_zero_only
    def _write_events(self, trainer: pl.Trainer) -> None:
        lines = "".join(json.dumps(e) + "\n" for e in self.events)
        atomic_write_text(run_dir(trainer) / EVENTS_FILE, lines)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        update_summary(trainer, diverged_step=self.diverged_step, divergence_events=len(self.events))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        update_summary(trainer, diverged_step=self.diverged_step, divergence_events=len(self.events))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if not self.params_finite(pl_module):
            raise NonFiniteCheckpointError(
                f"refusing to save a checkpoint at step {trainer.global_step}: the weights are not finite"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events), "losses": list(self.losses), "diverged_step": self.diverged_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict["events"])
        self.losses = deque(state_dict["losses"], maxlen=self.window)
        self.diverged_step = state_dict["diverged_step"]
