"""The attention-collapse and logit-drift checks of :class:`~lnstab.callbacks.DivergenceMonitor`, on the shared tap.

They watch the sites :class:`~lnstab.callbacks.AttentionLogitStatistics` and
:class:`~lnstab.callbacks.OutputLogitStatistics` watch, with the same view options, so on a step both measure the
hooks and the per-micro-batch views are shared and nothing is computed twice.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from ._captures import HEAD_PATTERN, attention_sites, output_site
from ._sites import FINAL_PATTERN, Site
from ._tap import SharedTap, Subscription
from ._tap_callback import captured_everywhere
from ._views import COLLAPSE_WEIGHT, DEFAULT_CHUNK_ELEMENTS, DEFAULT_CHUNK_ROWS

ATTENTION_STATS = ("attn_max_logit", "attn_collapsed")
LOGIT_STATS = ("output_log_z_mean",)


class StatChecks:
    """Per layer the largest attention logit and the collapsed fraction, and the mean log Z, on chosen steps.

    Args:
        collapse_fraction: Collapsed rows a layer may have (``None``: no such test).
        attention_logit_threshold: Largest attention logit allowed (``None``: no such test).
        log_z_threshold: Largest |mean log Z| allowed (``None``: no such test).
        head_pattern: The output head's module names (default: Hugging Face's ``lm_head``).
        qk: ``q_pattern``, ``k_pattern``, ``n_head``, ``scale`` for :func:`attention_sites` (``None``: automatic).
    """

    def __init__(self, collapse_fraction: float | None, attention_logit_threshold: float | None,
                 log_z_threshold: float | None, head_pattern: re.Pattern | None = None,
                 qk: tuple[Any, Any, Any, Any] = (None, None, None, None)) -> None:
        self.collapse_fraction = collapse_fraction
        self.head_pattern = head_pattern or re.compile(HEAD_PATTERN)
        self.qk = qk  # q_pattern, k_pattern, n_head, scale
        self.attention_logit_threshold = attention_logit_threshold
        self.log_z_threshold = log_z_threshold
        self.attention_sites: list[Site] = []
        self.attention: Subscription | None = None
        self.logits: Subscription | None = None

    def __getstate__(self) -> dict[str, Any]:  # spawned ranks subscribe again in setup
        return {**self.__dict__, "attention_sites": [], "attention": None, "logits": None}

    @property
    def subscriptions(self) -> list[Subscription]:
        return [s for s in (self.attention, self.logits) if s is not None]

    def setup(self, root: nn.Module, who: str) -> None:
        """Find the sites and subscribe (inactive); a one-line ``ConfigError`` when q/k or the head are missing."""
        self.close()
        tap = SharedTap.of(root)
        if self.collapse_fraction is not None or self.attention_logit_threshold is not None:
            options = {"chunk_elements": DEFAULT_CHUNK_ELEMENTS, "min_keys": 2, "collapse_weight": COLLAPSE_WEIGHT}
            self.attention_sites = attention_sites(root, options, *self.qk, who=who)
            self.attention = tap.subscribe(self.attention_sites, [ATTENTION_STATS] * len(self.attention_sites))
        if self.log_z_threshold is not None:
            site = output_site(root, "auto", re.compile(FINAL_PATTERN), self.head_pattern, None,
                               DEFAULT_CHUNK_ROWS, who=who)
            self.logits = tap.subscribe([site], [LOGIT_STATS])

    def start(self) -> None:
        """Capture the micro-batches of this step."""
        for sub in self.subscriptions:
            sub.reset()
            sub.active = True

    def stop(self) -> None:
        for sub in self.subscriptions:
            sub.active = False

    def values(self, trainer: Any, device: torch.device) -> torch.Tensor:
        """The maxima and collapsed fractions per layer, then the mean log Z, reduced over ranks, as one float64
        device vector (NaN where a site was not captured; no host sync); the pooled state is freed."""
        parts = []
        for sub, names in ((self.attention, ATTENTION_STATS), (self.logits, LOGIT_STATS)):
            if sub is None:
                continue
            if captured_everywhere(sub, trainer):
                table = sub.reduce(trainer, names)
                parts += [table[name].to(device) for name in names]
            else:
                parts += [torch.full((len(sub.sites),), math.nan, dtype=torch.float64, device=device)] * len(names)
            sub.reset()
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)

    def events(self, values: list[float]) -> list[tuple[str, float, str, str]]:
        """``(kind, value, layer, stat)``: ``attention_collapse`` at the first layer in depth order past a threshold
        (its collapsed fraction, else its largest logit), ``logit_drift`` when |mean log Z| is past its own."""
        out = []
        n = len(self.attention_sites)
        if self.attention is not None:
            max_logit, collapsed = values[:n], values[n : 2 * n]
            for i, site in enumerate(self.attention_sites):
                if self.collapse_fraction is not None and collapsed[i] > self.collapse_fraction:
                    out.append(("attention_collapse", collapsed[i], site.tag, "collapsed"))
                elif self.attention_logit_threshold is not None and max_logit[i] > self.attention_logit_threshold:
                    out.append(("attention_collapse", max_logit[i], site.tag, "max_logit"))
                if out:
                    break
            values = values[2 * n :]
        if self.logits is not None and math.isfinite(values[0]) and abs(values[0]) > self.log_z_threshold:
            out.append(("logit_drift", values[0], "output", "log_z_mean"))
        return out

    def close(self) -> None:
        for sub in self.subscriptions:
            sub.close()
        self.attention = self.logits = None
        self.attention_sites = []
