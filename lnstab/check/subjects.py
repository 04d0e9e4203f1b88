"""The models a check trains: the checked model (lnstab's family, a Hugging Face causal LM or a factory) and its
Pre-LN and Peri-LN references of the same width, depth and context.

A :class:`Subject` builds a fresh ``nn.Module`` mapping token ids ``(B, T)`` to logits ``(B, T, V)`` (seeded by the
caller) and says where lnstab's instruments find its residual stream, blocks, parameters and output norms
(:class:`~lnstab.check.training.Sites`). Every user mistake is an :class:`~lnstab.errors.LNStabError` in one line.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lnstab.check.training import Sites
from lnstab.errors import LNStabError
from lnstab.model import GPT, GPTConfig
from lnstab.module import MODEL_ARGS, GPTModule, gpt_config

# Where the instruments look in lnstab's GPT (and, with defaults, in Hugging Face GPT-2): half-step residual modules.
LNSTAB_SITES = Sites(
    hidden_pattern=r"(?:^|\.)h\.(\d+)\.resid_(attn|mlp)$",
    embed_pattern=r"(?:^|\.)transformer\.drop$",
    final_pattern=r"(?:^|\.)transformer\.ln_f$",
    block_pattern=r"(?:^|\.)h\.(\d+)$",
    param_pattern=r"(?:^|\.)h\.(\d+)\.",
    norm_pattern=r"(?:^|\.)h\.(\d+)\.ln_([12])_out$",
)
# Hugging Face decoders: numbered blocks (GPT-2 ``transformer.h.3``, Llama-style ``model.layers.3``).
HF_BLOCKS = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)$"
HF_SITES = Sites(
    hidden_pattern=HF_BLOCKS,
    embed_pattern=r"(?:^|\.)transformer\.drop$",
    final_pattern=r"(?:^|\.)(?:transformer\.ln_f|model\.norm|model\.final_layernorm)$",
    block_pattern=HF_BLOCKS,
    param_pattern=r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)\.",
)
REFERENCES = {"pre-ln": "pre", "peri-ln": "peri"}
# GPTModule arguments that are optimisation settings of the stress runs rather than architecture.
OPTIMISATION_ARGS = ("weight_decay", "betas", "eps", "warmup_steps")
UNUSED_ARGS = ("min_lr", "lr_decay_steps", "compile")


@dataclass(frozen=True)
class Shape:
    """What the references copy from the checked model (``None``: unknown)."""

    n_layer: int
    n_embd: int
    block_size: int | None
    vocab_size: int
    n_head: int | None = None


@dataclass
class Subject:
    """One model of the check.

    Attributes:
        key: ``checked``, ``pre-ln`` or ``peri-ln`` (directory and JSON key).
        label: How the report names it.
        build: Returns a fresh model (the caller seeds torch first).
        sites: Where the instruments look.
        shape: Width, depth, context and vocabulary.
        config: The lnstab :class:`GPTConfig` when the model is lnstab's (references, dedup of identical models).
        same_as: Key of an identical subject whose runs this one reuses.
        name: A short name for the run directory.
    """

    key: str
    label: str
    build: Callable[[], nn.Module]
    sites: Sites
    shape: Shape
    config: GPTConfig | None = None
    same_as: str | None = None
    name: str = "model"


def parse_value(text: str) -> Any:
    """A ``--model.KEY`` value as YAML (``4``, ``0.5``, ``true``, ``null``, ``[0.9, 0.95]``, strings), within
    :mod:`lnstab.safeload`'s bounds (a value that is not YAML stays a string)."""
    import yaml

    from lnstab.safeload import check_yaml_text

    check_yaml_text(text, "a --model.* value")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def lnstab_subject(args: dict[str, Any]) -> tuple[Subject, dict[str, Any]]:
    """The checked model from ``--model.KEY VALUE`` arguments (any ``GPTModule`` argument).

    Returns the subject and the optimisation overrides among the arguments (``weight_decay``, ``betas``, ``eps``,
    ``warmup_steps``; ``learning_rate`` is handed back too, as a one-rung ladder).
    """
    allowed = [p for p in inspect.signature(GPTModule.__init__).parameters if p != "self"]
    for key in args:
        if key not in allowed:
            raise LNStabError(f"--model.{key} is not allowed; GPTModule takes: {', '.join(allowed)}")
        if key == "compile":
            raise LNStabError("--model.compile is not used by lnstab check; its short runs are eager")
        if key in UNUSED_ARGS:
            raise LNStabError(
                f"--model.{key} is not used by lnstab check; its runs warm up for --warmup-steps and decay by cosine "
                "to --min-lr-ratio of each learning rate at --steps"
            )
    arch = {k: v for k, v in args.items() if k in ("preset", *MODEL_ARGS)}
    config = gpt_config(arch)
    name = f"{arch.get('preset', 'gpt2')}-{config.norm_placement}-{config.norm_type}-dt{config.residual_scale:g}"
    subject = Subject(
        key="checked",
        label=f"checked ({config.norm_placement}, {config.norm_type}, Δt={config.residual_scale:g})",
        build=lambda: GPT(config),
        sites=LNSTAB_SITES,
        shape=Shape(config.n_layer, config.n_embd, config.block_size, config.vocab_size, config.n_head),
        config=config,
        name=name,
    )
    extra = {k: v for k, v in args.items() if k in (*OPTIMISATION_ARGS, "learning_rate")}
    return subject, extra


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as token ids ``(B, T)`` → logits ``(B, T, V)`` (no cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits


def hf_subject(name: str, init: bool) -> Subject:
    """A Hugging Face causal LM: a local directory or a hub name, trained weights or (``init``) its config's init.

    ``trust_remote_code`` is never set: architectures that need remote code are refused by ``transformers``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    def fail(what: str, exc: BaseException) -> LNStabError:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        where = "" if os.path.isdir(name) else " (not a local directory; without network only local directories work)"
        return LNStabError(f"--hf {name!r} {what}{where}: {first}")

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=False)
    except Exception as exc:  # OSError offline / missing, ValueError for remote code or unknown types
        raise fail("cannot be loaded", exc) from None

    def build() -> nn.Module:
        if init:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=False)
        return HFCausalLM(model.float())

    try:
        probe = build()
    except Exception as exc:
        raise fail("is not a causal language model lnstab check can load", exc) from None
    del probe
    get = lambda *keys: next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)  # noqa: E731
    shape = Shape(
        n_layer=int(get("num_hidden_layers", "n_layer")),
        n_embd=int(get("hidden_size", "n_embd")),
        block_size=get("max_position_embeddings", "n_positions"),
        vocab_size=int(get("vocab_size")),
        n_head=get("num_attention_heads", "n_head"),
    )
    base = os.path.basename(os.path.normpath(name)) or "model"
    label = f"checked ({config.model_type}{', init' if init else ''})"
    return Subject("checked", label, build, HF_SITES, shape, name=f"hf-{base}{'-init' if init else ''}")


def import_factory(spec: str) -> Callable[[], Any]:
    """The function named by ``package.module:function`` (the working directory is importable, as with python -m)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LNStabError(f"--factory {spec!r} is not allowed; give package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise LNStabError(f"--factory {spec!r}: module {module_name!r} cannot be imported ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise LNStabError(f"--factory {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise LNStabError(f"--factory {spec!r}: {attr!r} is not callable")
    return fn


def resolve_types(option: str, value: str | None) -> tuple[type, ...]:
    """Comma-separated dotted class paths as classes."""
    if not value:
        return ()
    types = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        module_name, _, attr = item.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError):
            raise LNStabError(f"{option} {item!r} cannot be imported; give dotted class paths") from None
        if not isinstance(cls, type):
            raise LNStabError(f"{option} {item!r} is not a class")
        types.append(cls)
    return tuple(types)


def compile_regex(option: str, value: str | None) -> re.Pattern | None:
    """``value`` compiled, or a one-line error naming the option."""
    if value is None:
        return None
    try:
        return re.compile(value)
    except re.error as err:
        raise LNStabError(f"{option} {value!r} is not a valid regular expression ({err})") from None


def block_names(model: nn.Module, pattern: re.Pattern | None, types: tuple[type, ...]) -> list[str]:
    """Names of the modules that ``pattern`` (searched) or ``types`` select, in module order."""
    return [
        name for name, module in model.named_modules()
        if name and ((pattern is not None and pattern.search(name)) or (types and isinstance(module, types)))
    ]


def exact_pattern(names: list[str]) -> str:
    """A regex matching exactly these module names (as suffixes after a dot), numbered in order by the instruments."""
    return r"(?:^|\.)(?:" + "|".join(re.escape(n) for n in names) + r")$"


def param_pattern(names: list[str]) -> str | None:
    """A parameter regex whose group is the layer index, when every block name ends in ``.<index>``."""
    parts = [re.fullmatch(r"(.*)\.(\d+)", n) for n in names]
    if not names or any(p is None for p in parts):
        return None
    prefixes = sorted({p.group(1) for p in parts})
    return r"(?:^|\.)(?:" + "|".join(re.escape(p) for p in prefixes) + r")\.(\d+)\."


def factory_subject(
    spec: str,
    layer_pattern: str | None,
    module_types: str | None,
    seq_len: int,
    embed_pattern: str | None = None,
    final_pattern: str | None = None,
    norm_pattern: str | None = None,
) -> Subject:
    """A model built by ``package.module:function``; its blocks are found by ``layer_pattern`` / ``module_types``."""
    fn = import_factory(spec)
    pattern = compile_regex("--layer-pattern", layer_pattern)
    types = resolve_types("--module-types", module_types)
    for option, value in (("--embed-pattern", embed_pattern), ("--final-pattern", final_pattern),
                          ("--norm-pattern", norm_pattern)):
        compile_regex(option, value)

    def build() -> nn.Module:
        try:
            model = fn()
        except Exception as exc:
            raise LNStabError(f"--factory {spec!r} raised {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise LNStabError(f"--factory {spec!r} returned {type(model).__name__}; it must return a torch.nn.Module")
        return model

    model = build()
    if pattern is None and not types:
        pattern = re.compile(HF_BLOCKS)
        if not block_names(model, pattern, ()):
            raise LNStabError(f"--factory {spec!r}: no numbered blocks (h.N, layers.N, blocks.N) found; "
                              "give --layer-pattern REGEX or --module-types package.Class")
    names = block_names(model, pattern, types)
    if not names:
        some = ", ".join(n for n, _ in list(model.named_modules())[1:7])
        what = f"--layer-pattern {layer_pattern!r}" if layer_pattern else f"--module-types {module_types!r}"
        raise LNStabError(f"{what} matched no module of the model from --factory {spec!r} (its modules: {some}, …)")
    vocab, width = probe_factory(model, spec, names, seq_len)
    exact = exact_pattern(names)
    sites = Sites(
        hidden_pattern=exact,
        embed_pattern=embed_pattern,
        final_pattern=final_pattern,
        block_pattern=exact,
        param_pattern=param_pattern(names),
        norm_pattern=norm_pattern,
    )
    name = "factory-" + spec.rpartition(":")[2].replace(".", "-")
    return Subject("checked", f"checked ({spec})", build, sites, Shape(len(names), width, None, vocab), name=name)


def probe_factory(model: nn.Module, spec: str, names: list[str], seq_len: int) -> tuple[int, int]:
    """Run ``model`` on token ids ``(2, T)``; check that logits are ``(2, T, V)`` and that every selected block
    ran; return ``V`` and the block width."""
    widths: list[int] = []
    called: set[str] = set()
    modules = dict(model.named_modules())

    def keep(module: nn.Module, args: Any, out: Any) -> None:
        out = out[0] if isinstance(out, list | tuple) else out
        if isinstance(out, torch.Tensor) and out.dim() >= 1:
            widths.append(out.shape[-1])

    def seen(name: str) -> Any:
        return lambda module, args, out: called.add(name)

    handles = [modules[names[0]].register_forward_hook(keep)]
    handles += [modules[n].register_forward_hook(seen(n)) for n in names]
    ids = torch.zeros(2, seq_len, dtype=torch.long)
    try:
        with torch.no_grad():
            out = model.eval()(ids)
    except Exception as exc:
        raise LNStabError(f"--factory {spec!r}: the model failed on token ids of shape (2, {seq_len}) "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        for handle in handles:
            handle.remove()
    idle = [n for n in names if n not in called]
    if idle:
        raise LNStabError(f"--factory {spec!r}: block {idle[0]!r} (one of {len(names)} the layer pattern or types "
                          f"select) is never called by the model's forward; select only the blocks it runs")
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != (2, seq_len):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise LNStabError(f"--factory {spec!r} returned {got} for token ids (2, {seq_len}); "
                          "it must map token ids (B, T) to logits (B, T, V)")
    if out.shape[-1] < 2 or not out.is_floating_point():
        raise LNStabError(f"--factory {spec!r} returned logits of shape {tuple(out.shape)} and dtype {out.dtype}; "
                          "it must return floating-point logits over at least 2 tokens")
    if not widths:
        raise LNStabError(f"--factory {spec!r}: block {names[0]!r} did not return a tensor")
    return int(out.shape[-1]), int(widths[0])


def reference_config(shape: Shape, placement: str, seq_len: int) -> GPTConfig:
    """lnstab's GPT-2 block (LayerNorm, biases, Δt = 1) under ``placement`` with the checked model's shape."""
    heads = shape.n_head if shape.n_head and shape.n_embd % shape.n_head == 0 else None
    if heads is None:  # unknown: heads of 64 channels where the width allows, else one head
        heads = next(h for h in range(max(1, shape.n_embd // 64), 0, -1) if shape.n_embd % h == 0)
    return GPTConfig(
        block_size=shape.block_size or seq_len,
        vocab_size=shape.vocab_size,
        n_layer=shape.n_layer,
        n_head=heads,
        n_embd=shape.n_embd,
        norm_placement=placement,
    )


def references(checked: Subject, seq_len: int) -> list[Subject]:
    """The Pre-LN and Peri-LN references of ``checked``; one identical to it reuses its runs (``same_as``)."""
    out = []
    for key, placement in REFERENCES.items():
        config = reference_config(checked.shape, placement, seq_len)
        if checked.config is not None:
            config = dataclasses.replace(checked.config, norm_placement=placement, norm_type="layernorm",
                                         residual_scale=1.0, dropout=0.0)
        same = "checked" if checked.config is not None and checked.config == config else None
        label = f"{placement.capitalize()}-LN reference"
        out.append(Subject(key, label, lambda c=config: GPT(c), LNSTAB_SITES,
                           Shape(config.n_layer, config.n_embd, config.block_size, config.vocab_size, config.n_head),
                           config, same_as=same))
    return out


def context_length(checked: Subject, seq_len: int) -> int:
    """The sequence length of the stress runs: ``seq_len``, at most the model's context."""
    limit = checked.shape.block_size
    return min(seq_len, int(limit)) if limit and math.isfinite(limit) else seq_len
