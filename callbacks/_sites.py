"""Shared plumbing of lnstab's instruments: finding the modules to watch, cheap forward hooks, logging, reductions.

A *site* is a module whose forward output (or, for ``final``, forward input) is a residual-stream tensor. Sites are
found by name with ``re.search`` (so a LightningModule's attribute prefix such as ``model.`` does not matter) or by
module type. Tags sort in depth order: ``embed``, ``L00_attn``, ``L00_mlp``, ``L01_attn`` …, ``final``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

# lnstab's GPT: the parameter-free Residual modules after every attention / MLP half-step.
LNSTAB_RESIDUALS = r"(?:^|\.)h\.(\d+)\.resid_(attn|mlp)$"
# X_0 (output of the embedding dropout) and the final-norm input, in lnstab's GPT and Hugging Face GPT-2 alike.
EMBED_PATTERN = r"(?:^|\.)transformer\.drop$"
FINAL_PATTERN = r"(?:^|\.)transformer\.ln_f$"
# Blocks of lnstab / Hugging Face GPT-2 (``transformer.h.3``) and torch.nn.TransformerEncoder (``layers.3``).
BLOCK_PATTERN = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)$"
# Parameters of one block, the capture group is the layer index.
PARAM_LAYER_PATTERN = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)\."


@dataclass(frozen=True)
class Site:
    """One watched module: ``tag`` for metric names, ``name`` in ``named_modules``, ``use_input`` for pre-hooks."""

    tag: str
    name: str
    module: nn.Module
    use_input: bool = False


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, else a one-line ValueError naming the argument."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
    return value


def check_regex(name: str, value: Any, optional: bool = True) -> re.Pattern | None:
    """``value`` compiled, ``None`` passed through when ``optional``, else a one-line ValueError."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} is not allowed; it must be a regular expression string")
    try:
        return re.compile(value)
    except re.error as err:
        raise ValueError(f"{name}={value!r} is not allowed; it is not a valid regular expression ({err})") from None


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value`` if it is one of ``allowed``, else a one-line ValueError."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    return value


def _layer_tag(match: re.Match, fallback: int) -> str:
    groups = [g for g in match.groups() if g is not None]
    if not groups:
        return f"L{fallback:02d}"
    tag = f"L{int(groups[0]):02d}" if groups[0].isdigit() else groups[0]
    for extra in groups[1:]:
        tag += "_" + extra.removeprefix("resid_")
    return tag


def find_sites(
    root: nn.Module,
    layer_pattern: re.Pattern | None,
    module_types: tuple[type, ...] = (),
    embed_pattern: re.Pattern | None = None,
    final_pattern: re.Pattern | None = None,
) -> list[Site]:
    """Sites of ``root`` in depth order: embed (output), layers (output), final (input).

    A layer's tag comes from the capture groups of ``layer_pattern`` (``(\\d+)`` → ``L07``, a second group is
    appended: ``L07_attn``); modules chosen by ``module_types`` or a pattern without groups are numbered in order.
    """
    embed, layers, final = [], [], []
    for name, module in root.named_modules():
        if embed_pattern is not None and embed_pattern.search(name) and not embed:
            embed.append(Site("embed", name, module))
        elif final_pattern is not None and final_pattern.search(name) and not final:
            final.append(Site("final", name, module, use_input=True))
        elif layer_pattern is not None and (match := layer_pattern.search(name)):
            first = next((g for g in match.groups() if g is not None), None)
            key = int(first) if first is not None and first.isdigit() else len(layers)
            layers.append((key, len(layers), Site(_layer_tag(match, len(layers)), name, module)))
        elif module_types and isinstance(module, module_types):
            layers.append((len(layers), len(layers), Site(f"L{len(layers):02d}", name, module)))
    tags = [s.tag for _, _, s in layers]
    if len(set(tags)) != len(tags):
        raise ValueError(f"layer_pattern matched modules with duplicate tags {tags}; add a capture group per layer")
    return embed + [s for _, _, s in sorted(layers, key=lambda t: t[:2])] + final


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The tensor itself, or the first tensor of a tuple/list/ModelOutput (Hugging Face blocks return tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        for item in obj:
            if isinstance(item, torch.Tensor):
                return item
    return None


PAUSE_ATTR = "_lnstab_taps_paused"


@contextmanager
def paused_taps(root: nn.Module) -> Iterator[None]:
    """Every :class:`Tap` attached under ``root`` ignores forwards inside this block (e.g. the Jacobian probe's
    extra passes). The flag lives on ``root`` itself, so taps on other models are unaffected."""
    count = root.__dict__.get(PAUSE_ATTR, 0)
    object.__setattr__(root, PAUSE_ATTR, count + 1)
    try:
        yield
    finally:
        object.__setattr__(root, PAUSE_ATTR, count)


class Tap:
    """Forward hooks on ``sites`` (modules inside ``root``) that call ``fn(index, tensor)`` only while
    :attr:`active` and not :func:`paused_taps`; no-ops otherwise."""

    def __init__(self, sites: list[Site], fn: Callable[[int, torch.Tensor], None], root: nn.Module) -> None:
        self.sites, self.fn, self.root, self.active = sites, fn, root, False
        self.handles: list[Any] = []

    def attach(self) -> None:
        for i, site in enumerate(self.sites):
            if site.use_input:
                self.handles.append(site.module.register_forward_pre_hook(self._pre_hook(i)))
            else:
                self.handles.append(site.module.register_forward_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.active and not self.root.__dict__.get(PAUSE_ATTR) and (x := first_tensor(output)) is not None:
                self.fn(i, x.detach())

        return hook

    def _pre_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if self.active and not self.root.__dict__.get(PAUSE_ATTR) and (x := first_tensor(args)) is not None:
                self.fn(i, x.detach())

        return hook

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.active = False


def distributed(trainer: pl.Trainer) -> bool:
    """Whether a process group spans several ranks."""
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: str, trainer: pl.Trainer) -> torch.Tensor:
    """In-place ``all_reduce`` (``sum`` or ``max``) across ranks; a no-op in one process."""
    if distributed(trainer):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Send ``metrics`` to every logger at ``step`` (loggers write on rank zero only)."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def tensorboard_writer(trainer: pl.Trainer) -> Any | None:
    """The ``SummaryWriter`` of the first TensorBoardLogger, or ``None``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def probe_input(batch: Any, size: int) -> torch.Tensor:
    """The model input of a training batch: ``batch[0]``, ``batch["input_ids"]`` or the tensor itself; ``size`` rows."""
    if isinstance(batch, dict):
        x = batch.get("input_ids", batch.get("x", first_tensor(batch)))
    else:
        x = first_tensor(batch)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"batch of type {type(batch).__name__} is not allowed; pass probe= a tensor explicitly")
    return x[:size].detach().clone()


class TapCallback(Callback):
    """A callback that reads activations through one :class:`Tap`: attached in ``setup``, removed in ``teardown``.

    Subclasses implement ``_capture(index, tensor)`` and call :meth:`attach_tap` from their ``setup``.
    """

    tap: Tap | None = None

    def attach_tap(self, sites: list[Site], pl_module: nn.Module) -> None:
        """Hook ``_capture`` onto ``sites`` (inactive until a subclass sets ``tap.active``)."""
        self.tap = Tap(sites, self._capture, pl_module)
        self.tap.attach()

    def _capture(self, i: int, x: torch.Tensor) -> None:
        raise NotImplementedError

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.tap is not None:
            self.tap.detach()
            self.tap = None
