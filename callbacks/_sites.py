"""Finding the modules lnstab's instruments watch, and small helpers they share (logging, batches).

A *site* is a module whose forward output (or, for ``final``, forward input) is a residual-stream tensor. Sites are
found by name with ``re.search`` (so a LightningModule's attribute prefix such as ``model.`` does not matter, nor do
the wrapper segments FSDP, activation checkpointing or ``torch.compile`` insert) or by module type. Tags sort in depth
order: ``embed``, ``L00_attn``, ``L00_mlp``, ``L01_attn`` …, ``final``.
"""

from __future__ import annotations

import importlib
import math
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lnstab.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

# lnstab's GPT: the parameter-free Residual modules after every attention / MLP half-step.
LNSTAB_RESIDUALS = r"(?:^|\.)h\.(\d+)\.resid_(attn|mlp)$"
# Output norms by name, for models that do not expose ``output_norms()`` (lnstab's GPT does): GrowthBoundMonitor's.
OUTPUT_NORMS = r"(?:^|\.)h\.(\d+)\.ln_([12])_out$"
# X_0 (output of the embedding dropout) and the final-norm input, in lnstab's GPT and Hugging Face GPT-2 alike.
EMBED_PATTERN = r"(?:^|\.)transformer\.drop$"
FINAL_PATTERN = r"(?:^|\.)transformer\.ln_f$"
# Blocks of lnstab / Hugging Face GPT-2 (``transformer.h.3``) and torch.nn.TransformerEncoder (``layers.3``).
BLOCK_PATTERN = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)$"
# Parameters of one block, the capture group is the layer index.
PARAM_LAYER_PATTERN = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)\."
# Name segments that wrappers insert (FSDP1, activation checkpointing, torch.compile): ignored when matching.
WRAPPER_SEGMENTS = re.compile(r"(?:^|\.)(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def clean_name(name: str) -> str:
    """``name`` without wrapper segments: ``h.0._fsdp_wrapped_module.resid_attn`` → ``h.0.resid_attn``."""
    return WRAPPER_SEGMENTS.sub("", name).lstrip(".")


# What a capture's hooks hand the tap: a function that builds the micro-batch's view (``None``: nothing to measure
# yet), called only when some instrument is measuring this step.
Emit = Callable[[Callable[[], Any]], None]


class Capture:
    """How the calls of one site become a :class:`~lnstab.callbacks._stats.SiteView`, for sites that are not one
    tensor (an attention layer's q and k come from two module outputs, or from a projection and the rotary embedding
    its parent receives). Subclasses set ``key`` (equal keys on one module share one set of hooks, so two instruments
    share one view and its primitives) and ``attach``."""

    key: str = ""

    def attach(self, module: nn.Module, emit: Emit) -> list[Any]:
        """Register the hooks (on ``module`` or its sub-modules) that call ``emit(build)``; returns their handles."""
        raise NotImplementedError


@dataclass(frozen=True)
class Site:
    """One watched module: ``tag`` for metric names, ``name`` in ``named_modules``, ``use_input`` for pre-hooks,
    ``capture`` for sites that are not the module's first output (or input) tensor, ``call`` for one call of a module
    that runs several times in one forward (weights shared across depth; ``None``: every call, pooled)."""

    tag: str
    name: str
    module: nn.Module
    use_input: bool = False
    capture: Capture | None = None
    call: int | None = None


def _layer_tag(match: re.Match, fallback: int) -> str:
    """``L07`` from a first group ``7``, ``L07_attn`` with a second group ``resid_attn``; a first group that is no
    layer index (``h.7``) is appended as a second one is, to the layer's number in depth order (``L07_h.7``): every
    layer tag starts ``L<n>``, which is how the instruments, ``layer_depths`` and the reports tell layers from
    ``embed`` and ``final``."""
    groups = [g for g in match.groups() if g is not None]
    if not groups:
        return f"L{fallback:02d}"
    if groups[0].isdigit():
        tag, extras = f"L{int(groups[0]):02d}", groups[1:]
    else:
        tag, extras = f"L{fallback:02d}", groups
    for extra in extras:
        tag += "_" + extra.removeprefix("resid_")
    return tag


def named_modules(root: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """``root``'s modules by :func:`clean_name`: ``{name: (raw name, module)}``; of a wrapper and what it wraps (one
    clean name), the wrapped module."""
    modules: dict[str, tuple[str, nn.Module]] = {}
    for raw_name, module in root.named_modules():
        modules[clean_name(raw_name)] = (raw_name, module)  # a wrapper and what it wraps: the wrapped module wins
    return modules


def one_module(modules: dict[str, tuple[str, nn.Module]], pattern: re.Pattern | None, arg: str
               ) -> tuple[str, nn.Module] | None:
    """The one module of ``modules`` (:func:`named_modules`) whose name ``pattern`` searches to, as ``(raw name,
    module)``; ``None`` when none does (or no pattern). A pattern that names one module (an end site, the output head)
    but matches several is refused in one line naming two of them: taking the first, say layer 0's norm for
    ``final_pattern=r'norm$'`` on Llama, measured another site without a word."""
    if pattern is None:
        return None
    found = [(name, hit) for name, hit in modules.items() if pattern.search(name)]
    if len(found) > 1:
        shown = ", ".join(repr(name) for name, _ in found[:2]) + (", …" if len(found) > 2 else "")
        raise ConfigError(f"{arg}={pattern.pattern!r} is not allowed; it matches {len(found)} modules of the model "
                          f"({shown}) and must name one: anchor it to that module's name")
    return found[0][1] if found else None


def find_sites(
    root: nn.Module,
    layer_pattern: re.Pattern | None,
    module_types: tuple[type, ...] = (),
    embed_pattern: re.Pattern | None = None,
    final_pattern: re.Pattern | None = None,
) -> list[Site]:
    """Sites of ``root`` in depth order: embed (output), layers (output), final (input).

    A layer's tag comes from the capture groups of ``layer_pattern`` (``(\\d+)`` → ``L07``, a second group is
    appended: ``L07_attn``); modules chosen by ``module_types`` or a pattern without groups are numbered in order, and
    so are those whose first group is not a number (``(h\\.\\d+)`` → ``L07_h.7``).
    """
    modules = named_modules(root)
    embed_at = one_module(modules, embed_pattern, "embed_pattern")
    final_at = one_module(modules, final_pattern, "final_pattern")
    embed, layers, final = [], [], []
    for name, (raw_name, module) in modules.items():
        if embed_at is not None and raw_name == embed_at[0]:
            embed.append(Site("embed", raw_name, module))
        elif final_at is not None and raw_name == final_at[0]:
            final.append(Site("final", raw_name, module, use_input=True))
        elif layer_pattern is not None and (match := layer_pattern.search(name)):
            first = next((g for g in match.groups() if g is not None), None)
            key = int(first) if first is not None and first.isdigit() else len(layers)
            layers.append((key, len(layers), Site(_layer_tag(match, len(layers)), raw_name, module)))
        elif module_types and isinstance(module, module_types):
            layers.append((len(layers), len(layers), Site(f"L{len(layers):02d}", raw_name, module)))
    tags = [s.tag for _, _, s in layers]
    if len(set(tags)) != len(tags):
        twice = next(t for t in tags if tags.count(t) > 1)
        names = [clean_name(s.name) for _, _, s in layers if s.tag == twice][:2]
        raise ConfigError(
            f"layer_pattern={layer_pattern.pattern if layer_pattern else None!r} is not allowed; it gives tag {twice} "
            f"to {names[0]!r} and {names[1]!r}: anchor it where a layer's name ends ($, as in 'layers\\.(\\d+)$') "
            "or add a capture group that tells them apart"
        )
    return embed + [s for _, _, s in sorted(layers, key=lambda t: t[:2])] + final


def block_tag(name: str, fallback: int) -> str:
    """``L07`` for a module inside block 7 (``…h.7.attn``, ``…layers.7.self_attn``), else ``L<fallback>``."""
    match = re.search(PARAM_LAYER_PATTERN, clean_name(name) + ".")
    return f"L{int(match.group(1)) if match else fallback:02d}"


def resolve_types(name: str, value: Any) -> tuple[type, ...]:
    """Module types given as classes or dotted paths (``torch.nn.TransformerEncoderLayer``), as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    types = []
    for given in items:
        item = given
        if isinstance(item, str) and "." in item:
            module, _, attr = item.rpartition(".")
            try:
                item = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                raise ConfigError(f"{name}={value!r} is not allowed; {item!r} cannot be imported") from None
        if not isinstance(item, type):
            shown = f"an instance of {type(item).__name__}" if isinstance(item, nn.Module) else repr(item)
            raise ConfigError(f"{name}={shown} is not allowed; give module classes or dotted class paths")
        if not issubclass(item, nn.Module):  # no module is an instance of it: every site would be missed
            shown = repr(given) if isinstance(given, str) else item.__name__
            raise ConfigError(f"{name}={value!r} is not allowed; {shown} is not a torch.nn.Module class; give module "
                              "classes or dotted class paths")
        types.append(item)
    return tuple(types)


def no_sites(who: str, layer_pattern: re.Pattern | None, module_types: tuple[type, ...] | None,
             consequence: str = "nothing will be logged") -> str:
    """The one-line warning of an instrument that found no layer: what it looked for and how to say where
    (``module_types=None``: the instrument has no such argument)."""
    if layer_pattern is not None or module_types:
        given = ", ".join(([f"layer_pattern={layer_pattern.pattern!r}"] if layer_pattern is not None else []) +
                          ([f"module_types={[t.__name__ for t in module_types]}"] if module_types else []))
        return f"{who}: {given} matched no module of the model; {consequence}"
    return (f"{who}: no blocks found where it looks by default (lnstab's residual modules, or modules named h.N, "
            "layers.N, layer.N or blocks.N); give layer_pattern (a regex on module names, first group the layer "
            f"index){' or module_types' if module_types is not None else ''}; {consequence}")


def _is_norm(module: nn.Module, norm_modules: tuple[type, ...]) -> bool:
    """Whether ``module`` looks like a normalisation layer, for a hint: torch's and lnstab's, or a class named like
    one (Hugging Face's ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm`` …, a user's ``RMSNorm``)."""
    return isinstance(module, norm_modules) or type(module).__name__.endswith("Norm")


def no_end_sites(who: str, root: nn.Module, sites: list[Site], embed_pattern: re.Pattern | None,
                 final_pattern: re.Pattern | None) -> str | None:
    """The one-line warning of an instrument whose ``embed_pattern`` or ``final_pattern`` (not ``None``) matched no
    module of ``root``: which site is not measured and how to name it (a final norm outside the blocks is offered
    by name); ``None`` when each found its module."""
    from lnstab.layers import NORM_MODULES

    tags = {s.tag for s in sites}
    ends = (("embed", "embed_pattern", embed_pattern), ("final", "final_pattern", final_pattern))
    missing = [(arg, p) for tag, arg, p in ends if p is not None and tag not in tags]
    if not missing:
        return None
    given = " and ".join(f"{arg}={p.pattern!r}" for arg, p in missing)
    what = " and ".join("embedding (X_0)" if arg == "embed_pattern" else "final (the final norm's input)"
                        for arg, _ in missing)
    hints = []
    for arg, _ in missing:
        if arg == "embed_pattern":
            hints.append("embed_pattern a regex of the module whose output is X_0 (the embeddings' dropout, say)")
            continue
        blocks = [clean_name(s.name) + "." for s in sites if s.tag.startswith("L")]
        norms = [n for raw, m in root.named_modules() if _is_norm(m, NORM_MODULES)
                 and not (n := clean_name(raw)).startswith(tuple(blocks))]
        found = f", e.g. final_pattern=r'{re.escape('.'.join(norms[-1].split('.')[-2:]))}$'" if norms else ""
        hints.append(f"final_pattern a regex of the final norm's name{found}")
    return (f"{who}: {given} matched no module of the model; the {what} site{'s are' if len(missing) > 1 else ' is'} "
            f"not measured: give {' and '.join(hints)}, or None not to look for it")


def auto_sites(
    root: nn.Module,
    layer_pattern: re.Pattern | None,
    module_types: tuple[type, ...],
    embed_pattern: re.Pattern | None,
    final_pattern: re.Pattern | None,
) -> list[Site]:
    """Sites with the user's selection, or lnstab's residual modules, or else every block (``h.3``, ``layers.3``)."""
    if layer_pattern is not None or module_types:
        return find_sites(root, layer_pattern, module_types, embed_pattern, final_pattern)
    sites = find_sites(root, re.compile(LNSTAB_RESIDUALS), (), embed_pattern, final_pattern)
    if not any(s.tag.startswith("L") for s in sites):
        sites = find_sites(root, re.compile(BLOCK_PATTERN), (), embed_pattern, final_pattern)
    return sites


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The tensor itself, or the first tensor of a tuple/list/mapping (Hugging Face blocks return tuples, its
    ``ModelOutput`` is a dict and its ``BatchEncoding`` a ``UserDict``)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        for item in obj:
            if isinstance(item, torch.Tensor):
                return item
    return None


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int, owner: LogsMetrics | None = None) -> None:
    """Send ``metrics`` to every logger at ``step`` (loggers write on rank zero only); an ``owner``'s names carry its
    ``metric_prefix``, and a name that another owner logged at the same step with another value is warned of, once
    per pair of owners (:class:`LogsMetrics`)."""
    if not metrics:
        return
    if owner is not None:
        metrics = {owner.prefixed(name): value for name, value in metrics.items()}
        _claim(trainer, owner, metrics, step)
    for logger in getattr(trainer, "loggers", []):
        logger.log_metrics(metrics, step=step)
    if owner is not None:
        offer_to_callbacks(trainer, metrics)


def offer_to_callbacks(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Put ``metrics`` in ``trainer.callback_metrics`` through ``LightningModule.log`` (``logger=False``: the loggers
    got them at their step already), so that ``EarlyStopping`` and ``ModelCheckpoint(monitor=...)`` can use them; each
    stays there, the latest measured value, until it is measured again. The values are CPU tensors of numbers already
    read: no device transfer, no host sync. Lightning refuses ``log`` in some hooks (``on_train_end``, where a step
    still measuring is finished): those values reach the loggers only."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import LightningModule

    module = getattr(trainer, "lightning_module", None)
    if not isinstance(module, LightningModule) or getattr(trainer, "barebones", False):
        return
    try:
        for name, value in metrics.items():
            module.log(name, torch.tensor(float(value)), on_step=True, on_epoch=False, logger=False, prog_bar=False,
                       batch_size=1)
    except MisconfigurationException:
        return  # a hook Lightning does not log from


class LogsMetrics:
    """What lnstab's logging instruments share: ``metric_prefix`` (``None``: the names as each documents them;
    ``"mlp"``: ``mlp/hidden/mean_abs/L00`` …), kept in the state key only when set, so a default instance keeps the
    key its checkpoints were saved under; and :meth:`log_step`. Two instances of one instrument on other sites may
    tag them alike (blocks matched by one ``layer_pattern``, their attention modules by another: ``L00`` … both):
    their metrics would then share names, and a logger would keep both values under one; the first step on which
    that happens is said in a warning naming both and ``metric_prefix``. Overlapping names with equal values (the
    same site watched by both) are not warned of. Every metric logged this way is also put in
    ``trainer.callback_metrics`` (:func:`offer_to_callbacks`), so ``EarlyStopping(monitor=...)`` and
    ``ModelCheckpoint(monitor=...)`` can watch it."""

    metric_prefix: str | None = None

    def prefixed(self, name: str) -> str:
        """``name`` as this instance logs it."""
        return f"{self.metric_prefix}/{name}" if self.metric_prefix else name

    def log_step(self, trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        """:func:`log_metrics` with this instance as the owner."""
        log_metrics(trainer, metrics, step, owner=self)

    def _generate_state_key(self, **kwargs: Any) -> str:
        if self.metric_prefix is not None:
            kwargs["metric_prefix"] = self.metric_prefix
        return super()._generate_state_key(**kwargs)  # type: ignore[misc]  # Lightning's Callback's


# Per trainer: the last owner, step and value of every metric name an instrument logged, and the pairs told of. The
# owner is held weakly too: a callback may reach its trainer (through its module), and a value that reaches its own
# weak key keeps both alive for good.
_LOGGED: weakref.WeakKeyDictionary[Any, dict[str, tuple[weakref.ref, int, float]]] = weakref.WeakKeyDictionary()
_TOLD: weakref.WeakKeyDictionary[Any, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int):
        return math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


def _claim(trainer: pl.Trainer, owner: LogsMetrics, metrics: dict[str, float], step: int) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    try:
        seen = _LOGGED.setdefault(trainer, {})
        told = _TOLD.setdefault(trainer, set())
    except TypeError:  # a stand-in trainer that cannot be weakly referenced or hashed: nothing to compare with
        return
    mine = weakref.ref(owner)
    for name, value in metrics.items():
        before = seen.get(name)
        other = before[0]() if before is not None else None
        if other is not None and other is not owner and before[1] == step and not _same(before[2], value):
            pair = (id(other), id(owner))
            if pair not in told:
                told.add(pair)
                rank_zero_warn(
                    f"{other.state_key} and {owner.state_key} both log {name!r} at step {step}, with other values "
                    f"({_num(before[2])} and {_num(value)}): a logger keeps both under one name. Give one of them "
                    f"its own metric_prefix (e.g. metric_prefix='{_suggest(owner)}') so that each logs apart")
        seen[name] = (mine, step, value)


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float | int) else str(value)


def _suggest(owner: LogsMetrics) -> str:
    pattern = getattr(getattr(owner, "layer_pattern", None), "pattern", None) or ""
    words = re.findall(r"[A-Za-z_]{2,}", pattern.split(")")[-1] if ")" in pattern else pattern)
    return words[-1] if words else "other"


def tensorboard_writer(trainer: pl.Trainer) -> Any | None:
    """The ``SummaryWriter`` of the first TensorBoardLogger, or ``None``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def probe_input(batch: Any, size: int) -> torch.Tensor:
    """The model input of a training batch: ``batch[0]``, ``batch["input_ids"]`` (any mapping: a dict, Hugging Face's
    ``BatchEncoding``) or the tensor itself; ``size`` rows."""
    if isinstance(batch, Mapping):
        x = batch.get("input_ids", batch.get("x", first_tensor(batch)))
    else:
        x = first_tensor(batch)
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"batch of type {type(batch).__name__} is not allowed; pass probe= a tensor explicitly")
    return x[:size].detach().clone()
