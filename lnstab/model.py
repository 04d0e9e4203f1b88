"""The GPT-2 family under every LayerNorm placement, in plain PyTorch (no Lightning import).

One ``Block`` serves every variant; the choice of placement only decides which norms are real modules and which are
``nn.Identity()``, so every variant has the same state-dict keys and the same hook names::

    a  = ln_1_out(attn(ln_1(x)))         h  = ln_1_post(resid_attn(x, a))     resid_attn(x, a) = x + Δt·a
    m  = ln_2_out(mlp(ln_2(h)))          x' = ln_2_post(resid_mlp(h, m))      resid_mlp(h, m)  = h + Δt·m

Which of the four norms exist is one row of :data:`PLACEMENTS` (``input`` = ``ln_1``/``ln_2``, ``output`` =
``ln_*_out``, ``post`` = ``ln_*_post``, ``final`` = ``ln_f``); ``Block``, ``GPT``, the Hugging Face export
(:mod:`lnstab.hf`) and the growth bound (through :meth:`GPT.output_norms`) all read that table::

    placement  input  output  post  final   update of one half-step
    pre        ✓      ·       ·     ✓       x + Δt·f(LN(x))
    peri       ✓      ✓       ·     ✓       x + Δt·LN_out(f(LN_in(x)))   (Gemma 2, Kan et al. §4)
    post       ·      ·       ✓     ·       LN(x + Δt·f(x))              (original Transformer)
    output     ·      ✓       ·     ✓       x + Δt·LN(f(x))              (OLMo 2 reordered norm)
    none       ·      ·       ·     ·       x + Δt·f(x)

Adding a placement is one :class:`Placement` row plus its tests.
``resid_attn`` and ``resid_mlp`` are parameter-free :class:`Residual` modules: a forward hook on them sees the residual
stream after every half-step (for ``post`` that is the sum *before* its norm), which is where lnstab's instruments
attach. State-dict keys follow GPT-2 (``transformer.h.{i}.attn.c_attn`` …) with ``nn.Linear`` weights, so a nanoGPT
checkpoint loads as is; see :mod:`lnstab.hf` for Hugging Face interop.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lnstab.errors import ConfigError
from lnstab.loss import DEFAULT_CHUNK_ROWS, lm_head_loss


@dataclass(frozen=True)
class Placement:
    """One LayerNorm placement: which of a block's norms are real modules (the others are ``nn.Identity()``).

    Attributes:
        name: The ``norm_placement`` value that selects it.
        input: ``ln_1``/``ln_2`` normalise each sublayer's input.
        output: ``ln_1_out``/``ln_2_out`` normalise each sublayer's output before it is added to the stream.
        post: ``ln_1_post``/``ln_2_post`` normalise the stream after each residual add.
        final: ``ln_f`` normalises the stream before the head.
        doc: What the placement is and where it comes from (its docstring).
    """

    name: str
    input: bool
    output: bool
    post: bool
    final: bool
    doc: str

    @property
    def norms(self) -> frozenset[str]:
        """The norms that exist, by field name (``{"input", "final"}`` for ``pre``)."""
        return frozenset(k for k in ("input", "output", "post", "final") if getattr(self, k))

    @property
    def normalised_updates(self) -> bool:
        """Whether every residual update is ``x + Δt·N(y)`` with an output norm ``N`` that nothing renormalises
        afterwards: the form Theorem 4's growth bound needs."""
        return self.output and not self.post


PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement("pre", input=True, output=False, post=False, final=True,
                  doc="Pre-LN (GPT-2): x + Δt·f(LN(x)); the stream itself is never normalised until ln_f."),
        Placement("peri", input=True, output=True, post=False, final=True,
                  doc="Peri-LN (Gemma 2, Kan et al. §4): x + Δt·LN_out(f(LN_in(x))); every update is normalised."),
        Placement("post", input=False, output=False, post=True, final=False,
                  doc="Post-LN (the original Transformer): LN(x + Δt·f(x)); renormalises the stream each half-step."),
        Placement("output", input=False, output=True, post=False, final=True,
                  doc="Output-LN (OLMo 2's reordered norm): x + Δt·LN(f(x)); the sublayer sees the raw stream."),
        Placement("none", input=False, output=False, post=False, final=False,
                  doc="No normalisation at all: x + Δt·f(x) (the unstable baseline)."),
    )
}
NORM_PLACEMENTS = tuple(PLACEMENTS)
NORM_TYPES = ("layernorm", "rmsnorm")

# GPT-2's published shapes (Radford et al. 2019) plus small presets that train on a CPU in minutes.
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "deep-narrow": dict(n_layer=24, n_head=2, n_embd=64, block_size=128),
}


def _check_choice(field: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


@dataclass
class GPTConfig:
    """Shape and variant of a GPT. Defaults are GPT-2 124M (``bias=True``, Pre-LN, Δt = 1).

    Attributes:
        block_size: Longest sequence the position embedding covers.
        vocab_size: Tokens the model predicts (GPT-2 BPE: 50257).
        pad_vocab_multiple: Round the embedding table up to a multiple of this (64 gives nanoGPT's 50304);
            logits are still returned for ``vocab_size`` tokens only.
        n_layer, n_head, n_embd: Depth, heads, width.
        dropout: Dropout on embeddings, attention weights and sublayer outputs.
        bias: Biases in linear layers and LayerNorms.
        norm_placement: A key of :data:`PLACEMENTS`: ``pre``, ``peri``, ``post``, ``output``, ``none``.
        norm_type: ``layernorm`` or ``rmsnorm``, for every norm of the model.
        residual_scale: Δt > 0, the residual step size applied to both sublayers.
        norm_eps: Epsilon of every norm.
    """

    block_size: int = 1024
    vocab_size: int = 50257
    pad_vocab_multiple: int = 1
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    norm_placement: str = "pre"
    norm_type: str = "layernorm"
    residual_scale: float = 1.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_choice("norm_placement", self.norm_placement, list(PLACEMENTS))
        _check_choice("norm_type", self.norm_type, NORM_TYPES)
        for name in ("block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} is not allowed; it must be a positive integer")
        if not (isinstance(self.residual_scale, int | float) and math.isfinite(self.residual_scale)) or (
            self.residual_scale <= 0
        ):
            raise ConfigError(f"residual_scale={self.residual_scale!r} is not allowed; it must be a finite number > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout!r} is not allowed; it must be in [0, 1)")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not allowed with n_head={self.n_head}; n_embd must be divisible by n_head"
            )
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r} is not allowed; it must be > 0")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table: ``vocab_size`` rounded up to ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named shape (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``tiny``, ``mini``, ``small``,
        ``deep-narrow``) with any field overridden; ``None`` overrides are ignored."""
        _check_choice("preset", name, list(PRESETS))
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in fields:
                raise ConfigError(f"{key!r} is not a GPTConfig field; allowed: {', '.join(sorted(fields))}")
        values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**values)


def make_norm(config: GPTConfig, enabled: bool = True) -> nn.Module:
    """A LayerNorm or RMSNorm of width ``n_embd``, or ``nn.Identity()`` where this placement has no norm."""
    if not enabled:
        return nn.Identity()
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Residual(nn.Module):
    """Parameter-free residual update ``x + scale * fx``: hooks on it see every update of the residual stream."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def forward(self, x: torch.Tensor, fx: torch.Tensor) -> torch.Tensor:
        if self.scale == 1.0:
            return x + fx
        return torch.add(x, fx, alpha=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


KVCache = tuple[torch.Tensor, torch.Tensor]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        mask, causal = None, True
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)  # (B, nh, P+T, hs)
            v = torch.cat([cache[1], v], dim=2)
            past = k.size(2) - T
            if past > 0:  # queries sit at positions past..past+T-1 and may see every key up to their own position
                causal = False
                if T > 1:
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            cache = (k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y)), cache


class MLP(nn.Module):
    """GPT-2's position-wise feed-forward: ``c_proj(GELU(c_fc(x)))`` with the tanh GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Two residual half-steps (attention, then MLP) with the norms the placement asks for (module docstring)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        p = PLACEMENTS[config.norm_placement]
        self.ln_1 = make_norm(config, p.input)
        self.attn = CausalSelfAttention(config)
        self.ln_1_out = make_norm(config, p.output)
        self.resid_attn = Residual(config.residual_scale)
        self.ln_1_post = make_norm(config, p.post)
        self.ln_2 = make_norm(config, p.input)
        self.mlp = MLP(config)
        self.ln_2_out = make_norm(config, p.output)
        self.resid_mlp = Residual(config.residual_scale)
        self.ln_2_post = make_norm(config, p.post)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        a, cache = self.attn(self.ln_1(x), cache)
        x = self.ln_1_post(self.resid_attn(x, self.ln_1_out(a)))  # (B, T, C)
        x = self.ln_2_post(self.resid_mlp(x, self.ln_2_out(self.mlp(self.ln_2(x)))))  # (B, T, C)
        return x, cache


class GPT(nn.Module):
    """GPT-2 language model; ``GPT(config)(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""

    loss_chunk_rows: int = DEFAULT_CHUNK_ROWS  # rows per chunk of the head + loss in ``forward(idx, targets)``

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),  # its output is X_0, the embedding the instruments measure
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config, PLACEMENTS[config.norm_placement].final),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections N(0, 0.02/√(2·n_layer)), unit norms."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()

    @property
    def placement(self) -> Placement:
        """The row of :data:`PLACEMENTS` this model was built from."""
        return PLACEMENTS[self.config.norm_placement]

    def output_norms(self) -> list[tuple[nn.Module, float]]:
        """``(norm, Δt)`` for every residual update ``x ← x + Δt·norm(y)``, in update order (``ln_1_out``,
        ``ln_2_out`` of block 0, then block 1, …); empty when the placement's updates are not of that form
        (:attr:`Placement.normalised_updates`). This is what the growth bound of Theorem 4 sums over."""
        if not self.placement.normalised_updates:
            return []
        return [
            (norm, resid.scale)
            for block in self.transformer.h
            for norm, resid in ((block.ln_1_out, block.resid_attn), (block.ln_2_out, block.resid_mlp))
        ]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (the tied head counted once); optionally without the position embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if exclude_embeddings else n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` ``(B, T)``; with ``targets`` ``(B, T)``, the loss.

        ::

            idx ─ wte + wpe ─ drop ─ h[0] … h[L-1] ─ ln_f ─┬─ lm_head ────────────────────── logits  (targets=None)
                                                           └─ lm_head_loss(·, lm_head.weight) ─ loss (targets given)

        With ``targets`` the result is the mean next-token cross-entropy (fp32 scalar), computed by
        :func:`lnstab.loss.lm_head_loss` in row chunks without the whole batch's logits; it equals
        ``F.cross_entropy(model(idx).flatten(0, 1).float(), targets.flatten())`` within fp32 rounding. Either way the
        final hidden state passes through ``transformer.ln_f``, so hooks there see it.

        ``caches`` (a list with one entry per layer, filled in place) and ``start_pos`` serve :meth:`generate`.
        """
        B, T = idx.shape
        if start_pos + T > self.config.block_size:
            raise ConfigError(
                f"sequence length {start_pos + T} is not allowed; it must be <= block_size={self.config.block_size}"
            )
        pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            if caches is None:
                x, _ = block(x)
            else:
                x, caches[i] = block(x, caches[i])
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is not None:
            return lm_head_loss(x, self.lm_head.weight, targets, self.config.vocab_size, self.loss_chunk_rows)  # ()
        logits = self.lm_head(x)  # (B, T, V_padded)
        if self.config.padded_vocab_size != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # (B, T, V)
        return logits

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``idx`` ``(B, T)`` by ``max_new_tokens`` tokens with a KV cache; returns ``(B, T + new)``."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ConfigError(
                f"prompt length {idx.size(1)} + max_new_tokens {max_new_tokens} is not allowed; "
                f"it must be <= block_size={self.config.block_size}"
            )
        if not greedy and temperature <= 0:
            raise ConfigError(f"temperature={temperature!r} is not allowed; it must be > 0 (or use greedy=True)")
        B, C = idx.size(0), self.config.n_embd
        hs = C // self.config.n_head
        empty = idx.new_zeros((B, self.config.n_head, 0, hs), dtype=self.transformer.wte.weight.dtype)
        caches: list[KVCache] = [(empty, empty) for _ in range(self.config.n_layer)]
        out, step, pos = idx, idx, 0
        for _ in range(max_new_tokens):
            logits = self(step, caches=caches, start_pos=pos)[:, -1, :]  # (B, V)
            pos += step.size(1)
            if greedy:
                nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
                probs = F.softmax(logits.float(), dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            step = nxt
        return out
