"""Where q, k and the output logits come from, per model family, and the hooks that hand them to the shared tap.

Attention sites (one per self-attention layer; tag ``L07`` from the block index in the module's name):

* lnstab's ``CausalSelfAttention`` (and nanoGPT's): the outputs of ``attn.q_norm`` and ``attn.k_norm`` when it has
  them (q and k ``(B, n_head, T, hs)`` right before SDPA; ``nn.Identity()`` when QK-norm is off), else q and k split
  from ``c_attn``'s output ``(B, T, 3C)``; scale ``1/√hs``.
* Hugging Face ``GPT2Attention`` (self-attention only): q and k split from ``c_attn``'s output; scale
  ``module.scaling`` (it includes ``scale_attn_by_inverse_layer_idx``).
* Hugging Face ``LlamaAttention`` (and ``Gemma2Attention``; ``OlmoAttention``, clamped to its ``clip_qkv`` first;
  ``Olmo2Attention`` from ``q_norm``/``k_norm``, its QK-norm over all heads): ``q_proj``/``k_proj`` outputs ``(B, T,
  heads·head_dim)`` with the rotary embedding applied as the module applies it, from the ``position_embeddings`` (cos,
  sin) its forward receives (a pre-hook with kwargs); k heads shared by ``num_key_value_groups`` q heads (grouped-query
  attention); scale ``module.scaling``. A hook on the projections alone would see pre-rotary q and k: the wrong
  logits. Gemma 2's ``attn_logit_softcapping`` and ``sliding_window`` go to the view (entropy and collapse of the
  capped logits within the window; the largest logit uncapped).
* ``torch.nn.MultiheadAttention`` (``nn.TransformerEncoder``'s and ``nn.TransformerDecoder``'s self-attention)
  called as self-attention: q and k recomputed from its query input with ``in_proj_weight``/``in_proj_bias``,
  ``batch_first`` or not; causal when its call is (``is_causal``, or an
  ``attn_mask`` equal to the causal mask), over every key without a mask; scale ``1/√head_dim``. Other masks,
  ``add_bias_kv``, ``add_zero_attn`` and cross-attention (a decoder layer's ``multihead_attn``) are not measured.
* Any model, by name: ``q_pattern`` and ``k_pattern`` select projection modules whose outputs are
  ``(B, T, heads·head_size)`` and ``n_head`` gives the q heads (k heads follow from k's width: GQA). Such q and k are
  used as they leave the projections: a rotary embedding, a norm or anything else applied between the projection and
  the attention product is not seen, so this path is for models that have none.

Every path assumes causal self-attention over the whole sequence: padding masks, sliding windows, cross-attention
and KV caches (earlier keys) are not taken into account (Gemma 2's sliding windows are).

Output site: lnstab's GPT never forms logits while training (its loss is the chunked head of :mod:`lnstab.loss`), so
the logits come from the output of ``transformer.ln_f`` times ``lm_head.weight`` (an extra head product, on measuring
steps only, without the padded vocabulary rows); any other model from the output of its ``lm_head``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import sys
from typing import Any

import torch
from torch import nn

from lnstab import validation as require
from lnstab.errors import ConfigError

from ._sites import Capture, Emit, Site, block_tag, clean_name, first_tensor, named_modules, one_module
from ._views import AttentionView, LogitView

HEAD_PATTERN = r"(?:^|\.)lm_head$"


def _names(cls: type) -> set[str]:
    return {c.__name__ for c in cls.__mro__}


class FusedQKV(Capture):
    """q and k split from a fused projection's output ``(B, T, ≥ 2·width)`` (``[q | k | v]``), ``n_head`` heads."""

    def __init__(self, proj: nn.Module, n_head: int, width: int, scale: float, options: dict[str, Any]) -> None:
        self.proj, self.n_head, self.width, self.scale, self.options = proj, n_head, width, scale, options
        self.key = f"attn:fused:{options.get('min_keys')}:{options.get('collapse_weight')}"

    def attach(self, module: nn.Module, emit: Emit) -> list[Any]:
        return [self.proj.register_forward_hook(lambda m, args, out: emit(lambda: self.view(out)))]

    def view(self, out: Any) -> AttentionView:
        x = first_tensor(out).detach()  # (B, T, 3C)
        B, T, C, nh = x.shape[0], x.shape[1], self.width, self.n_head
        q = x[..., :C].reshape(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        k = x[..., C : 2 * C].reshape(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        return AttentionView(q, k, self.scale, **self.options)


class SplitQK(Capture):
    """q and k from two module outputs: ``(B, heads, T, hs)`` as they are (``flat=False``), ``(B, T, heads, hs)``
    transposed (``flat=False, tokens_first=True``) or ``(B, T, heads·hs)`` split into heads of ``head_dim``
    (``flat=True``); with ``clip``, clamped to ``±clip`` first; with ``rotary``, the ``position_embeddings`` that
    ``module``'s forward receives are applied by ``rotary(q, k, cos, sin)`` then. ``scale`` ``None``:
    ``1/√head_size``."""

    def __init__(self, q_src: nn.Module, k_src: nn.Module, scale: float | None, options: dict[str, Any], *,
                 flat: bool = False, head_dim: int | None = None, n_head: int | None = None,
                 rotary: Any = None, tokens_first: bool = False, clip: float | None = None) -> None:
        self.q_src, self.k_src, self.scale, self.options = q_src, k_src, scale, options
        self.clip = clip  # OLMo's clip_qkv: q and k clamped to ±clip as they leave the projections
        self.flat, self.head_dim, self.n_head, self.rotary = flat, head_dim, n_head, rotary
        self.tokens_first = tokens_first
        self.key = f"attn:split:{id(q_src)}:{id(k_src)}:{options.get('min_keys')}:{options.get('collapse_weight')}"
        self._parts: dict[str, Any] = {}

    def attach(self, module: nn.Module, emit: Emit) -> list[Any]:
        handles = [
            self.q_src.register_forward_hook(lambda m, args, out: emit(lambda: self._arrive("q", out))),
            self.k_src.register_forward_hook(lambda m, args, out: emit(lambda: self._arrive("k", out))),
        ]
        if self.rotary is not None:
            def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
                embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
                emit(lambda: self._arrive("rope", embeddings))

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        return handles

    def _arrive(self, part: str, value: Any) -> AttentionView | None:
        self._parts[part] = value if part == "rope" else first_tensor(value).detach()
        if "q" not in self._parts or "k" not in self._parts or (self.rotary is not None and "rope" not in self._parts):
            return None
        parts, self._parts = self._parts, {}
        q = self._heads(parts["q"], self.head_dim or (parts["q"].size(-1) // self.n_head if self.flat else None))
        k = self._heads(parts["k"], q.size(-1))
        if self.clip is not None:  # the hooks see the projections before the module clamps them in place
            q, k = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip)
        if self.rotary is not None:
            if parts["rope"] is None:
                raise ConfigError("position_embeddings=None is not allowed; the attention module must receive "
                                  "(cos, sin) for its rotary embedding to be applied to q and k")
            cos, sin = parts["rope"]
            q, k = self.rotary(q, k, cos, sin)  # (B, heads, T, hd) each
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.size(-1))
        return AttentionView(q, k, scale, **self.options)

    def _heads(self, x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
        if not self.flat:
            return x.transpose(1, 2) if self.tokens_first else x  # (B, heads, T, hs)
        B, T, width = x.shape
        return x.reshape(B, T, width // head_dim, head_dim).transpose(1, 2)  # (B, heads, T, hd)


class MultiheadQK(Capture):
    """q and k of a ``torch.nn.MultiheadAttention`` self-attention call, from its query input and the q and k rows
    of its input projection; causal or over every key as the call's mask says (module docstring)."""

    def __init__(self, module: nn.MultiheadAttention, options: dict[str, Any]) -> None:
        self.module, self.options = module, options
        self.key = f"attn:mha:{options.get('min_keys')}:{options.get('collapse_weight')}"

    def attach(self, module: nn.Module, emit: Emit) -> list[Any]:
        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            emit(lambda: self.view(args, kwargs))

        return [module.register_forward_pre_hook(pre, with_kwargs=True)]

    def view(self, args: tuple, kwargs: dict) -> AttentionView:
        m = self.module
        call = inspect.signature(nn.MultiheadAttention.forward).bind(m, *args, **kwargs).arguments
        x, name = call["query"].detach(), type(m).__name__
        if call["key"] is not call["query"] and not torch.equal(call["key"], call["query"]):
            raise ConfigError(f"{name} called with key other than query (cross-attention) is not allowed with the "
                              "attention instruments; they measure self-attention only")
        x = x if x.dim() == 3 else x.unsqueeze(0 if m.batch_first else 1)
        x = x if m.batch_first else x.transpose(0, 1)  # (B, T, E)
        E, nh = m.embed_dim, m.num_heads
        wq, wk, bias = m.in_proj_weight[:E], m.in_proj_weight[E : 2 * E], m.in_proj_bias
        B, T = x.shape[:2]
        q = nn.functional.linear(x, wq.detach(), None if bias is None else bias[:E].detach())  # (B, T, E)
        k = nn.functional.linear(x, wk.detach(), None if bias is None else bias[E : 2 * E].detach())  # (B, T, E)
        q = q.reshape(B, T, nh, E // nh).transpose(1, 2)  # (B, nh, T, hd)
        k = k.reshape(B, T, nh, E // nh).transpose(1, 2)  # (B, nh, T, hd)
        causal = self._causal(call.get("attn_mask"), bool(call.get("is_causal")), T, name)
        return AttentionView(q, k, 1.0 / math.sqrt(E // nh), causal=causal, **self.options)

    @staticmethod
    def _causal(mask: torch.Tensor | None, is_causal: bool, T: int, name: str) -> bool:
        if mask is None:
            return is_causal
        hidden = mask if mask.dtype == torch.bool else mask == -math.inf  # (T, T): True where a key is hidden
        upper = torch.ones(T, T, dtype=torch.bool, device=mask.device).triu(1)
        visible = mask if mask.dtype == torch.bool else mask.masked_fill(hidden, 0.0)
        if mask.shape == (T, T) and (mask.dtype == torch.bool or not visible.any()):
            if torch.equal(hidden, upper):
                return True
            if not hidden.any():
                return False
        raise ConfigError(f"{name}'s attn_mask of shape {tuple(mask.shape)} is not allowed with the attention "
                          "instruments; they measure causal attention or attention over every key")


# Hugging Face attention modules whose q and k leave two modules as (B, T, heads·head_dim), before the rotary
# embedding: the class, the modules (OLMo 2 normalises q and k over all heads after the projections), the library.
_ROTARY_FAMILIES = {
    "LlamaAttention": ("q_proj", "k_proj", "llama"),
    "MistralAttention": ("q_proj", "k_proj", "mistral"),  # its sliding window is its config's, on every layer
    "MixtralAttention": ("q_proj", "k_proj", "mixtral"),  # Mistral's attention (and window) with MoE MLPs
    "GemmaAttention": ("q_proj", "k_proj", "gemma"),  # Llama's, with a head_dim of its own
    "Qwen2Attention": ("q_proj", "k_proj", "qwen2"),  # q and k with biases; a sliding window on some layers
    "Gemma2Attention": ("q_proj", "k_proj", "gemma2"),  # with its soft-capping and sliding windows
    "Olmo2Attention": ("q_norm", "k_norm", "olmo2"),
    "OlmoAttention": ("q_proj", "k_proj", "olmo"),  # OLMo 1: q and k clamped to ±config.clip_qkv, then rotated
    "Gemma3Attention": ("q_norm", "k_norm", "gemma3"),  # normalised per head, (B, heads, T, hd), then rotated
    "Qwen3Attention": ("q_norm", "k_norm", "qwen3"),  # normalised per head, (B, T, heads, hd), then rotated
}
PER_HEAD = {"Gemma3Attention": False, "Qwen3Attention": True}  # split into heads already; tokens first?
# these pass config.sliding_window to their attention function, on every layer
WINDOW_FROM_CONFIG = {"MistralAttention", "MixtralAttention"}


def _window(module: nn.Module, family: str) -> int | None:
    """The sliding window the module hands its attention function (``None``: none)."""
    if family in WINDOW_FROM_CONFIG:
        return getattr(getattr(module, "config", None), "sliding_window", None)
    return getattr(module, "sliding_window", None)


def _auto_capture(module: nn.Module, options: dict[str, Any]) -> Capture | None:
    names = _names(type(module))
    if (isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None and module.bias_k is None
            and not module.add_zero_attn):  # self-attention's fused projection (kdim = vdim = embed_dim)
        return MultiheadQK(module, options)
    if "CausalSelfAttention" in names and hasattr(module, "c_attn") and hasattr(module, "n_head"):
        width = getattr(module, "n_embd", None) or module.c_attn.weight.shape[0] // 3
        scale = 1.0 / math.sqrt(width // module.n_head)
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module):
            return SplitQK(q_norm, k_norm, scale, options)
        return FusedQKV(module.c_attn, module.n_head, width, scale, options)
    if "GPT2Attention" in names and not getattr(module, "is_cross_attention", False):
        return FusedQKV(module.c_attn, module.num_heads, module.split_size, module.scaling, options)
    for family, (q_name, k_name, library) in _ROTARY_FAMILIES.items():
        if family in names:
            rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if rotary is None:  # a subclass defined elsewhere: the family's own
                modeling = importlib.import_module(f"transformers.models.{library}.modeling_{library}")
                rotary = modeling.apply_rotary_pos_emb
            # what these modules hand their attention function as softcap and sliding_window (None where absent)
            view_options = {**options, "softcap": getattr(module, "attn_logit_softcapping", None),
                            "window": _window(module, family)}
            flat = family not in PER_HEAD
            clip = getattr(getattr(module, "config", None), "clip_qkv", None) if family == "OlmoAttention" else None
            return SplitQK(getattr(module, q_name), getattr(module, k_name), module.scaling, view_options, flat=flat,
                           head_dim=module.head_dim if flat else None, rotary=rotary,
                           tokens_first=PER_HEAD.get(family, False), clip=clip)
    return None



def _by_tag(root: nn.Module, pattern: re.Pattern) -> dict[str, tuple[str, nn.Module]]:
    """Modules whose names ``pattern`` matches, by layer tag: its first group when that is a number, else the block
    index in the name, else the order."""
    out: dict[str, tuple[str, nn.Module]] = {}
    for name, module in root.named_modules():
        match = pattern.search(clean_name(name))
        if match:
            first = next((g for g in match.groups() if g is not None), None)
            tag = f"L{int(first):02d}" if first is not None and first.isdigit() else block_tag(name, len(out))
            if tag in out:
                raise ConfigError(f"pattern={pattern.pattern!r} is not allowed; it matches two modules of layer {tag} "
                                  f"({out[tag][0]}, {name})")
            out[tag] = (name, module)
    return out


def qk_arguments(q_pattern: Any, k_pattern: Any, n_head: Any, scale: Any
                 ) -> tuple[re.Pattern | None, re.Pattern | None, int | None, float | None]:
    """The checked ``q_pattern``, ``k_pattern``, ``n_head`` and ``scale`` of an instrument that reads attention logits
    (both patterns or neither; ``n_head`` with them), or a one-line :class:`ConfigError` naming the argument."""
    q, k = require.regex("q_pattern", q_pattern), require.regex("k_pattern", k_pattern)
    if (q is None) != (k is None):
        raise ConfigError(f"q_pattern={q_pattern!r} with k_pattern={k_pattern!r} is not allowed; give both or neither")
    heads = None if n_head is None else require.positive_int("n_head", n_head)
    if q is not None and heads is None:
        raise ConfigError("n_head=None is not allowed with q_pattern; give the number of q heads")
    return q, k, heads, require.optional_number("scale", scale, 0.0, low_open=True)


def attention_sites(root: nn.Module, options: dict[str, Any], q_pattern: re.Pattern | None = None,
                    k_pattern: re.Pattern | None = None, n_head: int | None = None,
                    scale: float | None = None, who: str = "AttentionLogitStatistics") -> list[Site]:
    """One site per self-attention layer of ``root`` in depth order (module docstring), or a one-line
    :class:`ConfigError` when q and k cannot be found. ``options`` go to every :class:`AttentionView`."""
    found: list[tuple[int, int, Site]] = []
    if q_pattern is not None:
        qs, ks = _by_tag(root, q_pattern), _by_tag(root, k_pattern)
        if set(qs) != set(ks) or not qs:
            raise ConfigError(f"q_pattern={q_pattern.pattern!r} and k_pattern={k_pattern.pattern!r} are not allowed; "
                              f"they match layers {sorted(qs)} and {sorted(ks)}, and each layer needs one of each")
        same = next((q_name for tag, (q_name, q_mod) in qs.items() if ks[tag][1] is q_mod), None)
        if same is not None:
            raise ConfigError(f"q_pattern={q_pattern.pattern!r} and k_pattern={k_pattern.pattern!r} are not allowed; "
                              f"both select {same!r}, and q and k must come from two projections (a fused qkv "
                              "projection or nn.MultiheadAttention cannot be named this way)")
        for i, (tag, (q_name, q_mod)) in enumerate(qs.items()):
            capture = SplitQK(q_mod, ks[tag][1], scale, options, flat=True, n_head=n_head)
            found.append((int(tag[1:]), i, Site(tag, q_name, q_mod, capture=capture)))
    else:
        cross = {id(m.multihead_attn) for m in root.modules() if isinstance(m, nn.TransformerDecoderLayer)}
        for i, (name, module) in enumerate(root.named_modules()):
            capture = _auto_capture(module, options) if id(module) not in cross else None
            if capture is not None:
                tag = block_tag(name, len(found))
                found.append((int(tag[1:]), i, Site(tag, name, module, capture=capture)))
    if not found:
        raise ConfigError(
            f"model={type(root).__name__} is not allowed with {who}; no attention module whose q and k can be found "
            "(lnstab's CausalSelfAttention; Hugging Face GPT2Attention, LlamaAttention, GemmaAttention, "
            "MistralAttention, MixtralAttention, Qwen2Attention, Qwen3Attention, Gemma2Attention, Gemma3Attention, "
            "OlmoAttention or Olmo2Attention; torch.nn.MultiheadAttention without add_bias_kv or add_zero_attn): name "
            "the projections with q_pattern, k_pattern and n_head (in "
            "Instruments, which has no such arguments: attention=False, or enabled=False and these callbacks listed "
            "with them)"
        )
    tags = [s.tag for _, _, s in found]
    if len(set(tags)) != len(tags):
        raise ConfigError(f"attention modules with duplicate tags {tags} are not allowed with {who}; "
                          "one attention module per block")
    return [s for _, _, s in sorted(found, key=lambda t: t[:2])]


class OutputLogits(Capture):
    """The logits: ``module``'s output times ``head``'s weight (``head`` given), or ``module``'s output itself."""

    def __init__(self, head: nn.Module | None, vocab_size: int | None, chunk_rows: int) -> None:
        self.head, self.vocab_size, self.chunk_rows = head, vocab_size, chunk_rows
        self.key = f"logits:{'hidden' if head is not None else 'head'}:{vocab_size}"

    def attach(self, module: nn.Module, emit: Emit) -> list[Any]:
        return [module.register_forward_hook(lambda m, args, out: emit(lambda: self.view(out)))]

    def view(self, out: Any) -> LogitView:
        x = first_tensor(out).detach()
        if self.head is None:
            return LogitView(x, vocab_size=self.vocab_size, chunk_rows=self.chunk_rows)
        weight = self.head.weight.detach()  # read at call time: under FSDP, the gathered parameter
        bias = self.head.bias.detach() if getattr(self.head, "bias", None) is not None else None
        return LogitView(x, weight, bias, self.vocab_size, self.chunk_rows)


def _lnstab_gpt(root: nn.Module) -> nn.Module | None:
    for module in root.modules():
        transformer = getattr(module, "transformer", None)
        if (hasattr(module, "loss_chunk_rows") and isinstance(getattr(module, "lm_head", None), nn.Module)
                and transformer is not None and "ln_f" in transformer):
            return module
    return None


def _vocab_within(vocab_size: int | None, head: nn.Module | None, who: str) -> int | None:
    """``vocab_size``, refused in one line when it exceeds the rows of ``head``'s weight (its logits), where that is
    a whole matrix (not a shard, not a head without a weight): the columns would have been taken as all there are."""
    weight = getattr(head, "weight", None)
    if vocab_size is not None and isinstance(weight, torch.Tensor) and weight.dim() == 2 and vocab_size > len(weight):
        raise ConfigError(f"vocab_size={vocab_size} is not allowed with {who}; the output head gives {len(weight)} "
                          f"logits per token, so it must be at most {len(weight)}")
    return vocab_size


def output_site(root: nn.Module, source: str, final_pattern: re.Pattern, head_pattern: re.Pattern,
                vocab_size: int | None, chunk_rows: int, who: str = "OutputLogitStatistics") -> Site:
    """The site whose calls give the output logits (module docstring), or a one-line :class:`ConfigError`."""
    modules = named_modules(root)
    gpt = _lnstab_gpt(root) if source == "auto" else None
    if gpt is not None:
        name = next(n for n, m in root.named_modules() if m is gpt.transformer.ln_f)
        vocab = _vocab_within(vocab_size, gpt.lm_head, who) or gpt.config.vocab_size
        return Site("output", name, gpt.transformer.ln_f, capture=OutputLogits(gpt.lm_head, vocab, chunk_rows))
    head = one_module(modules, head_pattern, "head_pattern")
    _vocab_within(vocab_size, head[1] if head else None, who)
    if source == "final_hidden":
        final = one_module(modules, final_pattern, "final_pattern")
        if final is None or head is None or not isinstance(getattr(head[1], "weight", None), torch.Tensor):
            raise ConfigError(f"source='final_hidden' is not allowed with {who} on {type(root).__name__}; no module "
                              f"matches final_pattern={final_pattern.pattern!r} or head_pattern="
                              f"{head_pattern.pattern!r} (with a weight)")
        return Site("output", final[0], final[1], capture=OutputLogits(head[1], vocab_size, chunk_rows))
    if head is None:
        raise ConfigError(f"model={type(root).__name__} is not allowed with {who}; no module matches head_pattern="
                          f"{head_pattern.pattern!r}, so the output logits cannot be found")
    return Site("output", head[0], head[1], capture=OutputLogits(None, vocab_size, chunk_rows))
