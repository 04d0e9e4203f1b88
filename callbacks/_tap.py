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
The instruments' base classes, which open the tap only for a training step's forwards, are in
:mod:`lnstab.callbacks._tap_callback`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lnstab.errors import ConfigError

from . import _stats
from ._sites import Site, first_tensor
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
        self.repeats: dict[int, int] = {}  # site -> calls in one micro-batch, for pooled sites that ran more than once
        self.unexpected = False  # a module watched call by call ran more often than its sites say
        self.expected: dict[int, int] = {}  # id(module) -> its calls in one forward, for modules watched call by call
        for site in sites:
            if site.call is not None:
                self.expected[id(site.module)] = max(self.expected.get(id(site.module), 0), site.call + 1)

    def reset(self) -> None:
        """Forget everything pooled (the per-site state is allocated again by the next capture)."""
        self.pooled = [None] * len(self.sites)
        self.repeats, self.unexpected = {}, False

    @property
    def complete(self) -> bool:
        """Whether every site has been captured since :meth:`reset` (and no module watched call by call ran more
        often than its sites say)."""
        return bool(self.sites) and not self.unexpected and all(p is not None for p in self.pooled)

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
        self._open = False
        self.hooks: dict[tuple[int, bool], dict[str, Any]] = {}  # (id(module), use_input) -> handle, watchers

    @property
    def open(self) -> bool:
        """In a training step's forward: TapCallback opens the tap at a micro-batch and shuts it at its backward.
        Opening it starts the count of each watched module's calls afresh (a module that runs several times in one
        forward, its weights shared across depth, is told apart call by call)."""
        return self._open

    @open.setter
    def open(self, value: bool) -> None:
        if value and not self._open:
            for entry in self.hooks.values():
                entry["calls"] = 0
        self._open = bool(value)

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
                entry = {"watchers": [], "module": site.module, "calls": 0}
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
        """The hooks of one site: its capture's, or a hook on the module's first output (input) tensor.

        A call of the site is a call of its module. A capture may hand the tap several parts of one call (q and k
        leave two projections, a rotary embedding a third hook), so its calls are counted by a pre-hook on the
        module, run before the capture's own hooks; a plain site's one hook counts its own calls."""

        def emit(build: Callable[[], _stats.SiteView | None]) -> None:
            self._dispatch(entry, build)

        def emit_call(build: Callable[[], _stats.SiteView | None]) -> None:
            self._count(entry)
            self._dispatch(entry, build)

        if site.capture is not None:
            counter = site.module.register_forward_pre_hook(lambda module, args: self._count(entry), prepend=True)
            return [counter, *site.capture.attach(site.module, emit)]
        seq_first = _sequence_first(site.module)
        if site.use_input:
            return [site.module.register_forward_pre_hook(
                lambda module, args: emit_call(lambda: _tensor_view(args, seq_first)))]
        return [site.module.register_forward_hook(
            lambda module, args, output: emit_call(lambda: _tensor_view(output, seq_first)))]

    def _watchers(self, entry: dict[str, Any]) -> list[tuple[Subscription, int]]:
        """The active watchers of ``entry`` that a forward now serves: none when the tap is shut or paused, or the
        forward runs inside a backward pass."""
        watchers = [(s, i) for s, i in entry["watchers"] if s.active] if self._open else []
        if not watchers or self.root.__dict__.get(PAUSE_ATTR):
            return []
        if torch._C._current_graph_task_id() != -1:
            # A forward inside a backward pass is activation checkpointing recomputing a micro-batch the tap has
            # already seen (torch.utils.module_tracker tells backward from forward the same way): not a new capture.
            return []
        return watchers

    def _count(self, entry: dict[str, Any]) -> None:
        """One more call of the module of ``entry`` in this micro-batch (only the calls the tap serves count)."""
        if self._watchers(entry):
            entry["calls"] += 1

    def _dispatch(self, entry: dict[str, Any], build: Callable[[], _stats.SiteView | None]) -> None:
        """Hand the view ``build()`` makes to every active watcher of ``entry``; nothing is built (and nothing read)
        when none is active, the tap is shut or paused, or the forward runs inside a backward pass."""
        watchers = self._watchers(entry)
        if not watchers:
            return
        call = max(entry["calls"] - 1, 0)  # this call's index (a part ahead of its module's first call: call 0)
        taking = []
        for sub, i in watchers:
            wanted = sub.sites[i].call
            if wanted is None:  # every call, pooled
                taking.append((sub, i))
                if call:
                    sub.repeats[i] = call + 1
            elif wanted == call:
                taking.append((sub, i))
        for sub, _ in watchers:  # a call beyond those the module's sites were unrolled into
            if call >= sub.expected.get(id(entry["module"]), call + 1):
                sub.unexpected = True
        if not taking:
            return
        with torch.no_grad():  # statistics never enter the autograd graph
            view = build()
            if view is None:
                return
            for sub, i in taking:
                sub.add(i, view)

    @staticmethod
    def device_of(pooled: list[dict[str, Any] | None]) -> torch.device:
        for per_site in pooled:
            for value in (per_site or {}).values():
                tensor = value.mean if isinstance(value, _stats.Moments) else value
                tensor = tensor[0] if isinstance(tensor, list) else tensor
                return tensor.device
        return torch.device("cpu")


def _sequence_first(module: nn.Module) -> bool:
    """Whether ``module``'s tensors are ``(T, B, d)``, so that the statistics read them as ``(B, T, d)``: one of
    torch's Transformer layers with ``batch_first=False`` (its default), or any module that says so itself with a
    ``batch_first = False`` attribute (``nn.MultiheadAttention``, or a block of the user's own)."""
    own = getattr(module, "batch_first", None)
    if isinstance(own, bool):
        return not own
    layer_types = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    return isinstance(module, layer_types) and not getattr(module.self_attn, "batch_first", True)


def _tensor_view(obj: Any, seq_first: bool = False) -> _stats.SiteView | None:
    """The view of a plain site: the first tensor of a module's output (or of its positional inputs), detached, with
    the batch first."""
    x = first_tensor(obj)
    if x is None:
        return None
    x = x.detach()
    return _stats.SiteView(x.transpose(0, 1) if seq_first and x.dim() == 3 else x)
