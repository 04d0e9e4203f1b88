"""The base classes of the instruments that read a :class:`~lnstab.callbacks._tap.SharedTap`: :class:`TapCallback`
(the tap open only for a training step's forwards, the optimizer-step boundary) and :class:`MeasuringTapCallback`
(measure every N optimizer steps and log what was read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from ._sites import LogsMetrics, Site
from ._strategy import distributed
from ._tap import TAP_ATTR, SharedTap, Subscription
from ._unroll import call_order, describe, example_of, repeated, unrolled


def captured_everywhere(sub: Subscription | None, trainer: Any) -> bool:
    """Whether ``sub`` captured every site on every rank: one decision for all ranks, so that all of them reduce or
    none does (a block skipped on one rank only, say by LayerDrop, would otherwise leave the others waiting in a
    collective that rank never joins). One extra collective when several ranks take part; none in one process."""
    complete = sub is not None and sub.complete
    if distributed(trainer):
        complete = trainer.strategy.reduce_boolean_decision(complete, all=True)
    return complete


class TapCallback(LogsMetrics, Callback):
    """A callback that reads the residual stream through its model's :class:`SharedTap` and knows the optimizer-step
    boundary: :meth:`step_begins` is true on the first micro-batch of an optimizer step, :meth:`step_ended` once its
    last micro-batch has run (the optimizer stepped). Subscribes in ``setup`` (:meth:`subscribe`), closes in
    ``teardown``.

    The tap sees only the forwards of ``training_step``: it opens when a micro-batch starts and shuts at its backward
    (or its end), so a validation run between two micro-batches of an accumulated step, or a forward another callback
    runs after the step (sampling text, say), is not counted; with manual optimisation, only the forwards before the
    first ``manual_backward`` of a step count. Subclasses call ``super()`` in the hooks they override.
    """

    subscription: Subscription | None = None
    _open_step: int | None = None
    _told_unmeasured: bool = False
    _told_repeats: bool = False
    _unrolled: bool = False
    unroll_repeats: bool = False  # instruments that can lay a looped block out per call take it as an argument
    # How an instrument that can tell the calls of a repeated module apart says so in the pooled-calls warning.
    unroll_hint: str = ""

    def fresh_state(self) -> dict[str, Any] | None:
        """The :meth:`load_state_dict` state of an instance that has measured nothing (``None``: it keeps none)."""
        return None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        fresh = self.fresh_state()
        if fresh is not None and not trainer.ckpt_path and trainer.global_step == 0:
            # a fit from step 0 that resumes nothing, e.g. a second trainer.fit with the same instance: its own
            # series, not the previous fit's (whose steps looked measured already, so nothing was)
            self.load_state_dict(fresh)
            if hasattr(self, "last"):
                self.last = {}

    def captured_everywhere(self, trainer: pl.Trainer) -> bool:
        """Whether every site was captured on every rank (:func:`captured_everywhere`)."""
        return captured_everywhere(self.subscription, trainer)

    def _shut(self, pl_module: pl.LightningModule, shut: bool) -> None:
        tap = pl_module.__dict__.get(TAP_ATTR)
        if tap is not None:
            tap.open = not shut

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.unroll_once(pl_module, batch)
        self._shut(pl_module, False)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._shut(pl_module, True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._shut(pl_module, True)

    def unmeasured(self, step: int) -> None:
        """Say once per callback that ``step`` was not measured because some site did not run in it."""
        if self._told_unmeasured or self.subscription is None or not self.subscription.sites:
            return  # no site at all was said in setup
        self._told_unmeasured = True
        sub = self.subscription
        missing = sub.missing()  # none here when the module was skipped on another rank only
        if sub.unexpected:
            what = ("a module measured call by call ran more often than when its calls were counted (a loop whose "
                    "number of iterations changes?)")
        else:
            what = (f"{missing[0]!r}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} did not run in it "
                    "(a block skipped in training, e.g. LayerDrop?)" if missing
                    else "a watched module did not run in it on another rank")
        rank_zero_warn(f"{type(self).__name__}: step {step} was not measured: {what}; only steps on which every "
                       "watched module runs are measured, and this is said once")

    def repeats_pooled(self) -> None:
        """Say once per callback that a watched module ran more than once in one micro-batch, its calls pooled."""
        sub = self.subscription
        if self._told_repeats or sub is None or not sub.repeats:
            return
        self._told_repeats = True
        names = {sub.sites[i].name: n for i, n in sub.repeats.items()}
        rank_zero_warn(f"{type(self).__name__}: {describe(names)} ran in one micro-batch (weights shared across "
                       "depth, or a training step that runs the model more than once); each of its sites pools all "
                       f"its calls{self.unroll_hint}; said once")

    def unroll_once(self, pl_module: nn.Module, batch: Any) -> None:
        """With ``unroll_repeats``, :meth:`unroll` once per fit (reset ``_unrolled`` in ``setup``), at the start of
        the first training batch, before its step is measured (``on_train_batch_start`` calls it)."""
        if self.unroll_repeats and not self._unrolled and self.subscription is not None:
            self._unrolled = True
            self.unroll(pl_module, batch)

    def unroll(self, pl_module: nn.Module, batch: Any) -> None:
        """Lay the sites out per call of a looped block (:meth:`unroll_sites`); instruments that can do so override
        it."""

    def unroll_sites(self, pl_module: nn.Module, batch: Any, sites: list[Site], count: Sequence[nn.Module] = ()
                     ) -> tuple[list[Site], dict[int, int]] | None:
        """``sites`` with one site per call of every layer module that one forward (a row of ``batch``, eval mode, no
        grad) runs more than once, and the calls of each module of ``count`` by ``id``; ``None`` (said in a warning
        where it matters) when no layer module repeats or the calls cannot be counted."""
        example = example_of(batch)
        if not sites or example is None:
            if sites:
                rank_zero_warn(f"{type(self).__name__}: unroll_repeats found no token ids in the batch; calls of a "
                               "repeated module stay pooled")
            return None
        try:
            order, counts = call_order(pl_module, sites, example.to(pl_module.device), count)
        except Exception as exc:  # noqa: BLE001  (a model that does not take the ids alone: pooled, and said)
            rank_zero_warn(f"{type(self).__name__}: unroll_repeats could not run the model on a row of the batch "
                           f"({type(exc).__name__}: {str(exc).strip()[:200]}); calls of a repeated module stay pooled")
            return None
        out = unrolled(sites, order)
        if out is None and repeated(sites, order):
            rank_zero_warn(f"{type(self).__name__}: unroll_repeats: some watched module did not run in the counting "
                           "forward; calls of a repeated module stay pooled")
        return None if out is None else (out, counts)

    def subscribe(self, pl_module: nn.Module, sites: list[Site], stats: Sequence[Sequence[str]]) -> Subscription:
        """Watch ``sites`` of ``pl_module`` for ``stats`` (one tuple of statistic names per site); inactive."""
        if self.subscription is not None:
            self.subscription.close()
        self.subscription = SharedTap.of(pl_module).subscribe(sites, stats)
        return self.subscription

    def step_begins(self, trainer: pl.Trainer) -> bool:
        """Call in ``on_train_batch_start``: whether this micro-batch is the first of an optimizer step."""
        step = trainer.global_step
        first = step != self._open_step
        self._open_step = step
        return first

    def step_ended(self, trainer: pl.Trainer) -> bool:
        """Call in ``on_train_batch_end``: whether the optimizer stepped since the step began (its last micro-batch
        ran)."""
        return self._open_step is not None and trainer.global_step != self._open_step

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.subscription is not None:
            self.subscription.close()
            self.subscription = None
        self._open_step = None


class MeasuringTapCallback(TapCallback):
    """A :class:`TapCallback` that measures on optimizer steps ``0, N, 2N, …`` (``every_n_steps``): its subscription
    is reset and activated on the first micro-batch of such a step (on every other step its hooks return at once,
    with no tensor work and no host read); once the step's last micro-batch has run, the statistics ``stats`` pooled
    over its micro-batches are reduced over ranks and read with one host sync, kept in :attr:`last` and logged as
    :meth:`metric_name` gives. A step on which some watched module did not run (on any rank) is not measured, and
    the first such step is said in a warning; with several ranks their agreement on that costs one more host sync
    per measured step. Subclasses subscribe in ``setup``."""

    every_n_steps: int
    stats: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.last: dict[str, float] = {}
        self._capture_step: int | None = None

    def metric_name(self, stat: str, tag: str) -> str:
        """The logged name of statistic ``stat`` at the site tagged ``tag``."""
        raise NotImplementedError

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.subscription is None or not self.step_begins(trainer):
            return  # later micro-batches of a step keep capturing (or not) as its first one decided
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step not in self.steps:
            self.subscription.reset()
            self.subscription.active = True
            self._capture_step = step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._capture_step is not None and self.step_ended(trainer):
            self._finalize(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._capture_step is not None:
            self._finalize(trainer)

    def _finalize(self, trainer: pl.Trainer) -> None:
        step, self._capture_step = self._capture_step, None
        sub = self.subscription
        sub.active = False
        self.repeats_pooled()
        if not self.captured_everywhere(trainer):
            self.unmeasured(step)
            sub.reset()
            return
        table = sub.reduce(trainer, self.stats)
        sub.reset()  # frees the per-site state until the next measuring step
        values = torch.stack([table[name] for name in self.stats]).tolist()  # the one host sync of this step
        self.steps.append(step)
        self.last = {
            self.metric_name(stat, site.tag): value
            for stat, row in zip(self.stats, values, strict=True)
            for site, value in zip(sub.sites, row, strict=True)
        }
        self.log_step(trainer, self.last, step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._capture_step = None

    @override
    def fresh_state(self) -> dict[str, Any]:
        return {"steps": [], "values": {}}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = list(state_dict.get("steps", []))
