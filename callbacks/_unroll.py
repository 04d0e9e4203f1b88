"""Modules that run several times in one forward (weights shared across depth: a looped or recurrent-depth block,
ALBERT's shared layer, Universal Transformers): their calls told apart as sites of their own, in call order.

A hook on a module sees every call of it, so an instrument watching a block that a forward runs four times would
pool four depths into one site. :func:`call_order` runs one forward to see which layer sites run more than once and
in what order, and :func:`unrolled` then gives each call its own :class:`~lnstab.callbacks._sites.Site` (``call``
set; the shared tap hands it only that call), tagged by depth in call order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._sites import Site, probe_input
from ._tap import paused_taps


def call_order(root: nn.Module, sites: list[Site], example: torch.Tensor, count: Sequence[nn.Module] = ()
               ) -> tuple[list[int], dict[int, int]]:
    """The indices into ``sites`` of the layer sites (tags ``L…``) in the order one forward of ``root`` on
    ``example`` calls them (an index appears once per call), and the calls of each module of ``count`` by ``id``;
    eval mode, no grad, the taps of ``root`` paused."""
    events: list[int] = []
    calls: dict[int, int] = {id(m): 0 for m in count}
    handles = [m.register_forward_hook(lambda mod, a, o: calls.__setitem__(id(mod), calls[id(mod)] + 1))
               for m in {id(m): m for m in count}.values()]
    seen: set[tuple[int, bool]] = set()
    for i, site in enumerate(sites):
        key = (id(site.module), site.use_input)
        if not site.tag.startswith("L") or key in seen:
            continue
        seen.add(key)
        if site.use_input:
            handles.append(site.module.register_forward_pre_hook(lambda m, a, i=i: events.append(i)))
        else:
            handles.append(site.module.register_forward_hook(lambda m, a, o, i=i: events.append(i)))
    was_training = root.training
    try:
        root.eval()
        with paused_taps(root), torch.no_grad():
            root(example)
    finally:
        for handle in handles:
            handle.remove()
        root.train(was_training)
    return events, calls


def repeated(sites: list[Site], order: list[int]) -> dict[str, int]:
    """Module name → calls in one forward, for the layer sites that ran more than once."""
    counts: dict[int, int] = {}
    for i in order:
        counts[i] = counts.get(i, 0) + 1
    return {sites[i].name: n for i, n in counts.items() if n > 1}


def unrolled(sites: list[Site], order: list[int]) -> list[Site] | None:
    """``sites`` with one layer site per call in ``order`` (``None`` when no layer site ran more than once, or some
    did not run at all). Embed and final sites stay as they are.

    Tags follow the calls: a new layer ``L<n>`` begins with each call of a module of another layer than the call
    before, or of a site already seen in the current layer; a site's suffix (``_attn``, ``_mlp``) is kept. So one
    block looped four times gives ``L00 … L03``, and a looped block watched at its two half-steps gives ``L00_attn,
    L00_mlp, L01_attn, …``.
    """
    layers = [i for i, s in enumerate(sites) if s.tag.startswith("L")]
    if not repeated(sites, order) or set(layers) - set(order):
        return None
    out: list[Site] = []
    calls: dict[int, int] = {}
    layer, last_prefix, in_layer = -1, None, set()
    for i in order:
        site = sites[i]
        prefix, _, suffix = site.tag.partition("_")
        if prefix != last_prefix or site.tag in in_layer:
            layer, in_layer = layer + 1, set()
        last_prefix = prefix
        in_layer.add(site.tag)
        call = calls.get(i, 0)
        calls[i] = call + 1
        tag = f"L{layer:02d}" + (f"_{suffix}" if suffix else "")
        out.append(Site(tag, site.name, site.module, site.use_input, site.capture, call=call))
    return ([s for s in sites if s.tag == "embed"] + out
            + [s for s in sites if s.tag != "embed" and not s.tag.startswith("L")])


def per_call(blocks: list[Site], calls: list[tuple[int, tuple, dict]]) -> list[tuple[Site, tuple, dict]]:
    """``(site, args, kwargs)`` to probe, from the calls ``(block index, args, kwargs)`` one forward made of
    ``blocks`` in order: each block at its first call, or, where a block ran more than once, every call as a layer
    of its own (tags as :func:`unrolled` gives them). A block that did not run raises ``KeyError``."""
    sites = unrolled(blocks, [i for i, _, _ in calls])
    if sites is None:
        first: dict[int, tuple[tuple, dict]] = {}
        for i, args, kwargs in calls:
            first.setdefault(i, (args, kwargs))
        return [(site, *first[i]) for i, site in enumerate(blocks)]
    return [(site, args, kwargs) for site, (_, args, kwargs) in zip(sites, calls, strict=True)]


def describe(names: dict[str, int]) -> str:
    """``'blocks.0' (4 calls)`` and ``N more``: the modules that ran more than once."""
    items = [f"{name!r} ({n} calls)" for name, n in names.items()]
    return items[0] + (f" and {len(items) - 1} more" if len(items) > 1 else "")


def example_of(batch: Any, size: int = 1) -> torch.Tensor | None:
    """The model input of a training batch, ``size`` rows, or ``None`` when it cannot be found."""
    try:
        return probe_input(batch, size)
    except Exception:  # noqa: BLE001  (an unknown batch: the instrument says it cannot unroll)
        return None
