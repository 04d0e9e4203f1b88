"""The statistics registry: what each residual-stream statistic accumulates, how it pools and how it is finished.

A :class:`Statistic` is one entry of :data:`REGISTRY`. It says what it takes from one micro-batch's tensor at one site
(``measure``, from the shared primitives of a :class:`SiteView`, each computed once however many statistics ask),
of which ``kind`` that is — which fixes how it pools over the micro-batches of an optimizer step and over ranks — and
how the pooled value becomes the logged number (``finish``)::

    kind       per micro-batch          pooled over micro-batches        over ranks
    sum        a vector of sums         added (float64)                  all-reduce SUM
    max        a 0-dim max              NaN-propagating maximum          all-reduce MAX (NaN kept)
    moments    (n, mean, Σ M2)          Chan's parallel merge            Σ n·mean, then Σ [M2 + n‖mean − μ‖²]
    sequence   one value per sequence   concatenated                     left to the instrument (it pairs sites)

``moments`` are per-entry moments across the samples of the batch: the mean of every entry (a float32 vector of the
entry count) and the *sum over entries* of the centred sums of squares (a scalar), which is all the data-wise variance
needs; both are merged with Chan et al.'s update, so nothing cancels catastrophically in float32. A minimum is a
``max`` of negated values whose ``finish`` negates it back (``attn_entropy_min``), so it pools and reduces exactly,
NaN included. Adding a statistic is one :func:`register` call (and a test).

Each statistic also names the ``view`` it reads: ``stream`` (a :class:`SiteView` of one residual-stream tensor,
what :class:`HiddenStateStatistics` logs), ``attention`` (an :class:`~lnstab.callbacks._views.AttentionView` of one
layer's q and k) or ``logits`` (a :class:`~lnstab.callbacks._views.LogitView` of the output logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from lnstab.errors import ConfigError
from lnstab.validation import choice

KINDS = ("sum", "max", "moments", "sequence")
VIEWS = ("stream", "attention", "logits")


class SiteView:
    """Primitives of one micro-batch's tensor ``x`` ``(B, ...)`` at one site, each computed on first use.

    ``x`` is flattened to ``(B, N)`` (``N`` entries per sequence); reductions run in float32.
    """

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.batch = x.shape[0]
        self.entries = x[0].numel() if x.dim() > 1 else 1

    @cached_property
    def flat(self) -> torch.Tensor:
        """``(B, N)`` float32 (a view when ``x`` already is float32)."""
        return self.x.reshape(self.batch, -1).float()

    @cached_property
    def seq_var_mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Population variance and mean over the entries of each sequence, ``(B,)`` each (two-pass: centred)."""
        mean = self.flat.mean(dim=1)
        return (self.flat - mean[:, None]).square_().mean(dim=1), mean

    @cached_property
    def seq_mean_abs(self) -> torch.Tensor:
        """Mean ``|x|`` of each sequence, ``(B,)``."""
        return self.flat.abs().sum(dim=1) / self.entries

    @cached_property
    def entry_mean_m2(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean of each entry across the ``B`` samples ``(N,)``, and Σ over entries of the centred sums of squares
        (a 0-dim float64): the per-entry moments the data-wise variance needs."""
        mean = self.flat.mean(dim=0)
        return mean, (self.flat - mean).square_().sum().double()

    @cached_property
    def max_abs(self) -> torch.Tensor:
        """``max |x|`` as a float32 0-dim tensor; NaN when any entry is NaN (one pass, no temporary)."""
        low, high = torch.aminmax(self.x)
        return torch.maximum(high, low.neg()).float()


@dataclass
class Moments:
    """Per-entry moments of ``n`` samples: ``mean`` ``(N,)`` float32 and ``m2`` = Σ over entries of Σ (x − mean)²."""

    n: float | torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def merge_(self, other: Moments) -> Moments:
        """Chan et al.'s parallel update, in place: the moments of both sample sets together."""
        n = self.n + other.n
        delta = other.mean - self.mean  # (N,)
        self.m2 = self.m2 + other.m2 + delta.square().sum(dtype=torch.float64) * (self.n * other.n / n)
        self.mean.add_(delta, alpha=other.n / n)
        self.n = n
        return self


@dataclass(frozen=True)
class Statistic:
    """One registered statistic of the residual stream at a site.

    Attributes:
        name: Key in :data:`REGISTRY`; logged as ``hidden/<name>/<tag>`` by :class:`HiddenStateStatistics`.
        kind: ``sum``, ``max``, ``moments`` or ``sequence`` (module docstring: how it pools and reduces).
        measure: ``SiteView -> value`` for one micro-batch: a 1-D tensor of sums (``sum``), a 0-dim tensor (``max``),
            :class:`Moments` (``moments``) or a ``(k, B)`` tensor (``sequence``).
        finish: Pooled (and rank-reduced) value -> the statistic, a 0-dim tensor (``sequence``: left as is).
        doc: What it is, for readers of the registry and of the tag guide.
        default: Logged by :class:`HiddenStateStatistics` unless its ``stats`` argument says otherwise.
        view: What ``measure`` reads: ``stream``, ``attention`` or ``logits`` (module docstring).
    """

    name: str
    kind: str
    measure: Callable[[SiteView], Any]
    finish: Callable[[Any], torch.Tensor] = lambda value: value
    doc: str = ""
    default: bool = False
    view: str = "stream"

    def __post_init__(self) -> None:
        choice("kind", self.kind, KINDS)
        choice("view", self.view, VIEWS)


REGISTRY: dict[str, Statistic] = {}


def register(stat: Statistic, replace: bool = False) -> Statistic:
    """Add ``stat`` to :data:`REGISTRY` (a name already taken needs ``replace=True``); returns it."""
    if stat.name in REGISTRY and not replace:
        raise ConfigError(f"statistic name={stat.name!r} is not allowed; it is already registered")
    REGISTRY[stat.name] = stat
    return stat


def unregister(name: str) -> None:
    """Remove a statistic (tests that register their own clean up with this)."""
    REGISTRY.pop(name, None)


def get(name: str) -> Statistic:
    """The registered statistic ``name``, or a one-line error listing the registered ones."""
    return REGISTRY[choice("stats", name, list(REGISTRY))]


def default_stats() -> tuple[str, ...]:
    """Names of the statistics :class:`HiddenStateStatistics` logs by default, in registration order."""
    return tuple(name for name, stat in REGISTRY.items() if stat.default and stat.view == "stream")


def names_of(view: str) -> tuple[str, ...]:
    """Names of the registered non-``sequence`` statistics that read ``view``, in registration order."""
    return tuple(name for name, stat in REGISTRY.items() if stat.view == view and stat.kind != "sequence")


def _count(view: SiteView) -> torch.Tensor:
    return torch.full((), float(view.batch), device=view.x.device)  # a fill, not a host-to-device copy


def _entry_moments(view: SiteView) -> Moments:
    mean, m2 = view.entry_mean_m2
    return Moments(float(view.batch), mean, m2)


register(Statistic(
    "mean_abs", "sum", lambda v: torch.stack([v.seq_mean_abs.sum(), _count(v)]), lambda s: s[0] / s[1],
    doc="mean of |x| over every entry of every sequence (MA of the paper, averaged over the batch)", default=True,
))
register(Statistic(
    "var_entry", "sum", lambda v: torch.stack([v.seq_var_mean[0].sum(), _count(v)]), lambda s: s[0] / s[1],
    doc="population variance over the entries of each sequence, averaged over the sequences", default=True,
))
register(Statistic(
    "var_data", "moments", _entry_moments, lambda m: m.m2 / (m.n * m.mean.numel()),
    doc="population variance of each entry across the sequences of the batch, averaged over the entries",
    default=True,
))
register(Statistic(
    "max_abs", "max", lambda v: v.max_abs, doc="max of |x| (NaN when any entry is NaN)", default=True,
))
register(Statistic(
    "seq_mean_abs", "sequence", lambda v: v.seq_mean_abs[None], doc="mean |x| of each sequence, (1, B)",
))
register(Statistic(
    "seq_rms_var", "sequence",
    lambda v: torch.stack([(v.seq_var_mean[0] + v.seq_var_mean[1].square()).sqrt(), v.seq_var_mean[0]]),
    doc="RMS and population variance over the entries of each sequence, (2, B)",
))


# One layer's attention (``AttentionView.attention``: one chunked pass gives all four).
register(Statistic(
    "attn_max_logit", "max", lambda v: v.attention.max_logit, view="attention",
    doc="largest |q·k|·scale over heads, batch and causal (query, key) pairs (NaN when any is NaN)",
))
register(Statistic(
    "attn_entropy_mean", "sum", lambda v: torch.stack([v.attention.entropy_sum, v.attention.rows_tensor]),
    lambda s: s[0] / s[1], view="attention",
    doc="mean entropy (nats) of the attention rows: each query's softmax over the keys it may see",
))
register(Statistic(
    "attn_entropy_min", "max", lambda v: v.attention.neg_entropy_max, lambda m: (-m).clamp(min=0.0), view="attention",
    doc="smallest attention-row entropy (nats), pooled as the max of negated entropies; a one-hot row's rounding "
        "(-1e-30) is 0",
))
register(Statistic(
    "attn_collapsed", "sum", lambda v: torch.stack([v.attention.collapsed, v.attention.rows_tensor]),
    lambda s: s[0] / s[1], view="attention",
    doc="fraction of attention rows whose largest weight exceeds the collapse weight (0.99)",
))
# The output logits (``LogitView.logits``: per-token log Z and the largest logit, in row chunks).
register(Statistic(
    "output_log_z_mean", "sum", lambda v: torch.stack([v.logits.log_z.double().sum(), v.logits.count]),
    lambda s: s[0] / s[1], view="logits", doc="mean over tokens of log Z = logsumexp of the logits",
))
register(Statistic(
    "output_log_z_std", "moments", lambda v: v.logits.log_z_moments, lambda m: (m.m2 / m.n).sqrt(), view="logits",
    doc="population standard deviation over tokens of log Z",
))
register(Statistic(
    "output_max_logit", "max", lambda v: v.logits.max_logit, view="logits",
    doc="largest logit over tokens and vocabulary (NaN when any is NaN)",
))


def measure(stat: Statistic, view: SiteView) -> Any:
    """``stat``'s contribution of one micro-batch, in the form its kind accumulates."""
    value = stat.measure(view)
    if stat.kind == "sum":
        return value.to(torch.float64)
    if stat.kind == "moments":
        return Moments(float(value.n), value.mean.float(), value.m2.to(torch.float64))  # mean is merged in place
    if stat.kind == "sequence":
        return [value]
    return value


def merge(stat: Statistic, pooled: Any, new: Any) -> Any:
    """Pool a micro-batch's contribution ``new`` into ``pooled`` (in place where possible)."""
    if stat.kind == "sum":
        return pooled.add_(new)
    if stat.kind == "max":
        return torch.maximum(pooled, new)  # NaN-propagating
    if stat.kind == "moments":
        return pooled.merge_(new)
    pooled.extend(new)
    return pooled
