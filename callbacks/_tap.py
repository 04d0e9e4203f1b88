"""One activation tap per model, shared by every instrument, and the base class of the instruments that read it.

:class:`SharedTap` keeps one forward hook (a pre-hook for input sites) per watched module of one model, whichever and
however many instruments watch it. Each instrument holds a :class:`Subscription`: its sites and, per site, the
registered statistics (:mod:`._stats`) it wants. On a forward, a site's hook builds one :class:`SiteView` of the
tensor and hands it to every *active* subscription watching that site, so a primitive two instruments share (say
``max |x|``) is computed once; with no active subscription the hook returns at once. A subscription pools its
statistics over the micro-batches of an optimizer step, holding per-site state only between :meth:`~Subscription.reset`
and the read, and reduces them over ranks (:meth:`~Subscription.reduce`) as each statistic's kind prescribes.

A site whose view is not one tensor carries a :class:`~lnstab.callbacks._sites.Capture`: its hooks (an attention
layer's q and k outputs, say) hand the tap a function that builds the view, which the tap calls — under ``no_grad``
— only when some subscription is active, so on other steps those hooks too return at once.
:class:`MeasuringTapCallback` is the base of instruments that measure every N optimizer steps and log what they read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lnstab.errors import ConfigError

from . import _stats
from ._sites import Site, first_tensor, log_metrics
from ._strategy import all_reduce_, distributed

TAP_ATTR = "_lnstab_shared_tap"
PAUSE_ATTR = "_lnstab_taps_paused"


@contextmanager
def paused_taps(root: nn.Module) -> Iterator[None]:
    """The tap of ``root`` ignores forwards inside this block (e.g. the Jacobian probe's extra passes). The flag
    lives on ``root`` itself, so taps on other models are unaffected."""
    count = root.__dict__.get(PAUSE_ATTR, 0)
    object.__setattr__(root, PAUSE_ATTR, count + 1)
    try:
        yield
    finally:
        object.__setattr__(root, PAUSE_ATTR, count)


class Subscription:
    """One instrument's view of a :class:`SharedTap`: its sites, the statistics it wants at each, what it pooled.

    Attributes:
        sites: The watched sites, in the instrument's order.
        stats: Per site, the names of the registered statistics pooled there.
        active: Captures happen only while this is set (the instrument sets it on the steps it measures).
        dtypes: Per site, the dtype of the last tensor seen (``None`` before the first capture).
    """

    def __init__(self, tap: SharedTap, sites: list[Site], stats: Sequence[Sequence[str]]) -> None:
        self.tap, self.sites, self.active = tap, sites, False
        self.stats = [tuple(_stats.get(name).name for name in names) for names in stats]
        self.dtypes: list[torch.dtype | None] = [None] * len(sites)
        self.pooled: list[dict[str, Any] | None] = [None] * len(sites)

    def reset(self) -> None:
        """Forget everything pooled (the per-site state is allocated again by the next capture)."""
        self.pooled = [None] * len(self.sites)

    @property
    def complete(self) -> bool:
        """Whether every site has been captured since :meth:`reset`."""
        return bool(self.sites) and all(p is not None for p in self.pooled)

    def missing(self) -> list[str]:
        """The module names of the sites not captured since :meth:`reset`."""
        return [site.name for site, pooled in zip(self.sites, self.pooled, strict=True) if pooled is None]

    def add(self, i: int, view: _stats.SiteView) -> None:
        """Pool one micro-batch's statistics at site ``i``."""
        self.dtypes[i] = view.x.dtype
        pooled = self.pooled[i]
        new = {name: _stats.measure(_stats.REGISTRY[name], view) for name in self.stats[i]}
        if pooled is None:
            self.pooled[i] = new
        else:
            for name, value in new.items():
                pooled[name] = _stats.merge(_stats.REGISTRY[name], pooled[name], value)

    def local(self, name: str, sites: Sequence[int] | None = None) -> list[Any]:
        """The pooled values of ``name`` on this rank, per site (``sequence``: the ``(k, B_step)`` tensor)."""
        stat = _stats.REGISTRY[name]
        out = []
        for i in range(len(self.sites)) if sites is None else sites:
            value = self.pooled[i][name]
            out.append(torch.cat(value, dim=1) if stat.kind == "sequence" else value)
        return out

    def reduce(self, trainer: Any, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The finished statistics ``names`` (default: every non-``sequence`` one asked for) over every rank, as
        ``{name: (sites,) float64 tensor}`` (NaN at sites that do not compute it); no host sync, and one collective
        per kind (plus one per site with ``moments``) when several ranks take part."""
        if not self.complete:
            raise RuntimeError("Subscription.reduce() before every site was captured")
        names = names or [n for n in dict.fromkeys(s for per in self.stats for s in per)
                          if _stats.REGISTRY[n].kind != "sequence"]
        cells = [(i, n) for n in names for i in range(len(self.sites)) if n in self.stats[i]]
        device = self.tap.device_of(self.pooled)
        multi = distributed(trainer)
        moments = {c: self.pooled[c[0]][c[1]] for c in cells if _stats.REGISTRY[c[1]].kind == "moments"}
        sums = [self.pooled[i][n] for i, n in cells if _stats.REGISTRY[n].kind == "sum"]
        maxes = [self.pooled[i][n].reshape(()) for i, n in cells if _stats.REGISTRY[n].kind == "max"]
        if multi and moments:
            moments = {c: _reduce_moments(m, trainer) for c, m in moments.items()}
        if multi and (sums or maxes):
            packed_max = torch.stack(maxes) if maxes else torch.zeros(0, device=device)
            nan = packed_max.isnan()  # MAX over ranks need not propagate NaN: count NaNs in the SUM instead
            packed = torch.cat([t.to(device) for t in sums] + [nan.double()])
            packed_max = packed_max.masked_fill(nan, float("inf"))
            all_reduce_(packed, "sum", trainer)
            all_reduce_(packed_max, "max", trainer)
            packed_max = packed_max.masked_fill(packed[packed.numel() - len(maxes):] > 0, float("nan"))
            sums = list(packed[: packed.numel() - len(maxes)].split([t.numel() for t in sums]))
            maxes = list(packed_max.unbind())
        finished: dict[tuple[int, str], torch.Tensor] = {}
        it_sum, it_max = iter(sums), iter(maxes)
        for i, n in cells:
            stat = _stats.REGISTRY[n]
            raw = next(it_sum) if stat.kind == "sum" else next(it_max) if stat.kind == "max" else moments[(i, n)]
            finished[(i, n)] = stat.finish(raw).to(torch.float64).reshape(())
        missing = torch.full((), float("nan"), dtype=torch.float64, device=device)
        return {n: torch.stack([finished.get((i, n), missing) for i in range(len(self.sites))]) for n in names}

    def close(self) -> None:
        """Stop watching; hooks no subscription needs any more are removed."""
        self.active = False
        self.tap.release(self)


def _reduce_moments(m: _stats.Moments, trainer: Any) -> _stats.Moments:
    """Moments over every rank: μ = Σ n·mean / Σ n (one all-reduce of ``N + 1`` values), then
    Σ M2 = Σ_r [M2_r + n_r·‖mean_r − μ‖²] (one scalar all-reduce); deviations from μ, so nothing cancels."""
    packed = torch.cat([m.mean * m.n, m.mean.new_full((1,), m.n)])
    all_reduce_(packed, "sum", trainer)
    n = packed[-1]
    mean = packed[:-1] / n
    m2 = (m.m2 + (m.mean - mean).square().sum(dtype=torch.float64) * m.n).reshape(1)
    all_reduce_(m2, "sum", trainer)
    return _stats.Moments(n.double(), mean, m2[0])  # n stays on the device: no host sync


class SharedTap:
    """The one set of hooks on one model's watched modules (module docstring). Get it with :meth:`of`."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.open = False  # in a training step's forward: TapCallback opens it at a micro-batch, shuts it at backward
        self.hooks: dict[tuple[int, bool], dict[str, Any]] = {}  # (id(module), use_input) -> handle, watchers

    @classmethod
    def of(cls, root: nn.Module) -> SharedTap:
        """The tap of ``root``, created on first use (kept on ``root`` outside its state dict)."""
        tap = root.__dict__.get(TAP_ATTR)
        if tap is None:
            tap = cls(root)
            object.__setattr__(root, TAP_ATTR, tap)
        return tap

    def subscribe(self, sites: list[Site], stats: Sequence[Sequence[str]]) -> Subscription:
        """A new subscription to ``sites`` with ``stats[i]`` at site ``i``; hooks are added where none exist."""
        if len(stats) != len(sites):
            raise ConfigError(
                f"stats with {len(stats)} entries is not allowed for {len(sites)} sites; give one tuple per site"
            )
        sub = Subscription(self, sites, stats)
        for i, site in enumerate(sites):
            key = (id(site.module), site.use_input, site.capture.key if site.capture is not None else None)
            entry = self.hooks.get(key)
            if entry is None:
                entry = {"watchers": [], "module": site.module}
                entry["handles"] = self._attach(site, entry)
                self.hooks[key] = entry
            entry["watchers"].append((sub, i))
        return sub

    def release(self, sub: Subscription) -> None:
        for key, entry in list(self.hooks.items()):
            entry["watchers"] = [(s, i) for s, i in entry["watchers"] if s is not sub]
            if not entry["watchers"]:
                for handle in entry["handles"]:
                    handle.remove()
                del self.hooks[key]
        if not self.hooks and self.root.__dict__.get(TAP_ATTR) is self:
            del self.root.__dict__[TAP_ATTR]

    def _attach(self, site: Site, entry: dict[str, Any]) -> list[Any]:
        """The hooks of one site: its capture's, or a hook on the module's first output (input) tensor."""

        def emit(build: Callable[[], _stats.SiteView | None]) -> None:
            self._dispatch(entry, build)

        if site.capture is not None:
            return site.capture.attach(site.module, emit)
        if site.use_input:
            return [site.module.register_forward_pre_hook(lambda module, args: emit(lambda: _tensor_view(args)))]
        return [site.module.register_forward_hook(lambda module, args, output: emit(lambda: _tensor_view(output)))]

    def _dispatch(self, entry: dict[str, Any], build: Callable[[], _stats.SiteView | None]) -> None:
        """Hand the view ``build()`` makes to every active watcher of ``entry``; nothing is built (and nothing read)
        when none is active, the tap is shut or paused, or the forward runs inside a backward pass."""
        watchers = [(s, i) for s, i in entry["watchers"] if s.active]
        if not watchers or not self.open or self.root.__dict__.get(PAUSE_ATTR):
            return
        if torch._C._current_graph_task_id() != -1:
            # A forward inside a backward pass is activation checkpointing recomputing a micro-batch the tap has
            # already seen (torch.utils.module_tracker tells backward from forward the same way): not a new capture.
            return
        with torch.no_grad():  # statistics never enter the autograd graph
            view = build()
            if view is None:
                return
            for sub, i in watchers:
                sub.add(i, view)

    @staticmethod
    def device_of(pooled: list[dict[str, Any] | None]) -> torch.device:
        for per_site in pooled:
            for value in (per_site or {}).values():
                tensor = value.mean if isinstance(value, _stats.Moments) else value
                tensor = tensor[0] if isinstance(tensor, list) else tensor
                return tensor.device
        return torch.device("cpu")


def _tensor_view(obj: Any) -> _stats.SiteView | None:
    """The view of a plain site: the first tensor of a module's output (or of its positional inputs), detached."""
    x = first_tensor(obj)
    return None if x is None else _stats.SiteView(x.detach())


def captured_everywhere(sub: Subscription | None, trainer: Any) -> bool:
    """Whether ``sub`` captured every site on every rank: one decision for all ranks, so that all of them reduce or
    none does (a block skipped on one rank only, say by LayerDrop, would otherwise leave the others waiting in a
    collective that rank never joins). One extra collective when several ranks take part; none in one process."""
    complete = sub is not None and sub.complete
    if distributed(trainer):
        complete = trainer.strategy.reduce_boolean_decision(complete, all=True)
    return complete


class TapCallback(Callback):
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
        missing = self.subscription.missing()  # none here when the module was skipped on another rank only
        what = (f"{missing[0]!r}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} did not run in it"
                if missing else "a watched module did not run in it on another rank")
        rank_zero_warn(f"{type(self).__name__}: step {step} was not measured: {what} (a block skipped in training, "
                       "e.g. LayerDrop?); only steps on which every watched module runs are measured, and this is "
                       "said once")

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
        log_metrics(trainer, self.last, step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._capture_step = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = list(state_dict.get("steps", []))
