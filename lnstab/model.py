"""The GPT-2 family under every LayerNorm placement, in plain PyTorch (no Lightning import).

One ``Block`` serves every variant; the config only decides which optional pieces are real modules and which are
``nn.Identity()``, so every variant has the same module names, hence the same hook names::

    a  = gate_attn(ln_1_out(attn(ln_1(x))))     h  = ln_1_post(resid_attn(x, a))    resid_attn(x, a) = α·x + Δt·a
    m  = gate_mlp(ln_2_out(mlp(ln_2(h))))       x' = ln_2_post(resid_mlp(h, m))     resid_mlp(h, m)  = α·h + Δt·m

Which of the four norms exist is one row of :data:`PLACEMENTS` (``input`` = ``ln_1``/``ln_2``, ``output`` =
``ln_*_out``, ``post`` = ``ln_*_post``, ``final`` = ``ln_f``), as are the stream weight α (1 but for DeepNorm) and
DeepNorm's initialisation; ``Block``, ``GPT``, the Hugging Face export (:mod:`lnstab.hf`) and the growth bound
(through :meth:`GPT.output_norms`) all read that table::

    placement  input  output  post  final   update of one half-step
    pre        ✓      ·       ·     ✓       x + Δt·f(LN(x))
    peri       ✓      ✓       ·     ✓       x + Δt·LN_out(f(LN_in(x)))   (Gemma 2, Kan et al. §4)
    post       ·      ·       ✓     ·       LN(x + Δt·f(x))              (original Transformer)
    output     ·      ✓       ·     ✓       x + Δt·LN(f(x))              (OLMo 2 reordered norm)
    none       ·      ·       ·     ·       x + Δt·f(x)
    deepnorm   ·      ·       ✓     ·       LN(α·x + Δt·f(x))            (DeepNet, α = (2N)^¼, N layers)

Adding a placement is one :class:`Placement` row plus its tests. The other options are :class:`GPTConfig` fields,
all off by default (the default is GPT-2 and loads its weights): ``norm_type`` (LayerNorm, RMSNorm or DyT for every
norm), ``qk_norm`` (``attn.q_norm``/``attn.k_norm``), ``residual_gate`` (``gate_attn``/``gate_mlp``: ReZero,
LayerScale), ``z_loss`` (in the loss, :mod:`lnstab.loss`), ``tie_embeddings`` (``False``: ``lm_head`` has its own
weight) and ``init`` (``xavier``: Xavier-uniform linear weights without GPT-2's residual scaling). The pieces
themselves live in :mod:`lnstab.layers`.
:class:`GPTConfig` and the named shapes live in :mod:`lnstab.gptconfig` (re-exported here).
``resid_attn`` and ``resid_mlp`` are parameter-free :class:`~lnstab.layers.Residual` modules: a forward hook on them
sees the residual stream after every half-step (for ``post``/``deepnorm`` that is the sum *before* its norm), which
is where lnstab's instruments attach. State-dict keys follow GPT-2 (``transformer.h.{i}.attn.c_attn`` …) with
``nn.Linear`` weights, so a nanoGPT checkpoint loads as is; see :mod:`lnstab.hf` for Hugging Face interop.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lnstab.errors import ConfigError
from lnstab.gptconfig import PRESETS, GPTConfig
from lnstab.layers import NORM_MODULES, NORM_TYPES, Gate, Residual, make_gate
from lnstab.layers import make_norm as _make_norm
from lnstab.loss import DEFAULT_CHUNK_ROWS, HeadLoss, lm_head_losses
from lnstab.placements import NORM_PLACEMENTS, PLACEMENTS, Placement

__all__ = ["GPT", "NORM_PLACEMENTS", "NORM_TYPES", "PLACEMENTS", "PRESETS", "Block", "GPTConfig", "Placement"]


def make_norm(config: GPTConfig, enabled: bool = True, width: int | None = None) -> nn.Module:
    """A norm of ``config.norm_type`` and width ``n_embd`` (or ``width``), or ``nn.Identity()`` where there is none."""
    return _make_norm(config.norm_type, width or config.n_embd, enabled=enabled, eps=config.norm_eps,
                      bias=config.bias, alpha_init=config.dyt_alpha_init)


def make_residual(config: GPTConfig) -> Residual:
    """The residual update ``α·x + Δt·fx`` of one half-step: Δt from the config, α from the placement's row."""
    alpha = PLACEMENTS[config.norm_placement].stream_scale
    return Residual(config.residual_scale, alpha(config.n_layer) if alpha else 1.0)


KVCache = tuple[torch.Tensor, torch.Tensor]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    ``q_norm`` and ``k_norm`` (``nn.Identity()`` unless ``qk_norm``) take q and k shaped ``(B, n_head, T, head_size)``
    right before the attention product, so a forward hook on them sees the queries and keys the attention uses (with
    a KV cache, ``k_norm`` sees the new positions' keys; the cache holds normalised keys).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, config.qk_norm, width=config.n_embd // config.n_head)
        self.k_norm = make_norm(config, config.qk_norm, width=config.n_embd // config.n_head)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        q, k = self.q_norm(q), self.k_norm(k)  # (B, nh, T, hs), normalised over hs when qk_norm
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
    """Two residual half-steps (attention, then MLP) with the norms and gates the config asks for (module docstring)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        p = PLACEMENTS[config.norm_placement]
        gate, width, init = config.residual_gate, config.n_embd, config.layerscale
        self.ln_1 = make_norm(config, p.input)
        self.attn = CausalSelfAttention(config)
        self.ln_1_out = make_norm(config, p.output)
        self.gate_attn = make_gate(gate, width, init)
        self.resid_attn = make_residual(config)
        self.ln_1_post = make_norm(config, p.post)
        self.ln_2 = make_norm(config, p.input)
        self.mlp = MLP(config)
        self.ln_2_out = make_norm(config, p.output)
        self.gate_mlp = make_gate(gate, width, init)
        self.resid_mlp = make_residual(config)
        self.ln_2_post = make_norm(config, p.post)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache | None]:
        a, cache = self.attn(self.ln_1(x), cache)
        x = self.ln_1_post(self.resid_attn(x, self.gate_attn(self.ln_1_out(a))))  # (B, T, C)
        x = self.ln_2_post(self.resid_mlp(x, self.gate_mlp(self.ln_2_out(self.mlp(self.ln_2(x))))))  # (B, T, C)
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
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections N(0, 0.02/√(2·n_layer)), unit norms,
        gates at their init; an untied ``lm_head`` is N(0, 0.02) too. With ``init='xavier'`` every linear weight
        (the blocks' and an untied ``lm_head``) is Xavier-uniform with gain 1 instead, q, k and v each with its own
        fans, and no residual scaling (:class:`GPTConfig`). A placement with an ``init_gain`` β (DeepNorm) then
        redraws the block matrices as DeepNet does: Xavier normal with gain 1 for the query and key projections,
        gain β for the value, attention output and both MLP projections (each of q, k, v with its own fans, as
        three ``C × C`` matrices)."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        c = self.config
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                xavier = c.init == "xavier" and not (name == "lm_head" and c.tie_embeddings)  # tied: wte's N(0, .02)
                if xavier and name.endswith("c_attn"):
                    for w in module.weight.split(c.n_embd):  # q, k, v: 3 × (C, C) views
                        nn.init.xavier_uniform_(w)
                elif xavier:
                    nn.init.xavier_uniform_(module.weight)
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=resid_std if name.endswith("c_proj") else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, NORM_MODULES + (Gate,)):
                module.reset_parameters()
        gain = self.placement.init_gain
        if gain is not None:
            beta = gain(self.config.n_layer)
            for block in self.transformer.h:
                q, k, v = block.attn.c_attn.weight.split(self.config.n_embd)  # 3 × (C, C) views
                for weight, g in ((q, 1.0), (k, 1.0), (v, beta), (block.attn.c_proj.weight, beta),
                                  (block.mlp.c_fc.weight, beta), (block.mlp.c_proj.weight, beta)):
                    nn.init.xavier_normal_(weight, gain=g)

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

    def residual_gates(self) -> list[nn.Module]:
        """The gate of every residual update in update order (``gate_attn``, ``gate_mlp`` of block 0, …), aligned
        with :meth:`output_norms`; ``nn.Identity()`` where ``residual_gate`` is ``none``."""
        return [gate for block in self.transformer.h for gate in (block.gate_attn, block.gate_mlp)]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied head counted once); optionally without the position embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if exclude_embeddings else n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        start_pos: int = 0,
        loss_parts: bool = False,
    ) -> torch.Tensor | HeadLoss:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` ``(B, T)``; with ``targets`` ``(B, T)``, the loss.

        ::

            idx ─ wte + wpe ─ drop ─ h[0] … h[L-1] ─ ln_f ─┬─ lm_head ──────────────────────── logits (targets=None)
                                                           └─ lm_head_losses(·, lm_head.weight) ─ loss (targets given)

        With ``targets`` the result is the training objective (fp32 scalar): the mean next-token cross-entropy plus,
        when ``config.z_loss > 0``, the z-loss term ``z_loss·mean (log Z)²``, computed by
        :func:`lnstab.loss.lm_head_losses` in row chunks without the whole batch's logits; the cross-entropy equals
        ``F.cross_entropy(model(idx).flatten(0, 1).float(), targets.flatten())`` within fp32 rounding. With
        ``loss_parts`` the result is the :class:`~lnstab.loss.HeadLoss` (objective, cross-entropy, z-loss term).
        Either way the final hidden state passes through ``transformer.ln_f``, so hooks there see it.

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
            parts = lm_head_losses(x, self.lm_head.weight, targets, self.config.vocab_size, self.loss_chunk_rows,
                                   z_loss=self.config.z_loss)
            return parts if loss_parts else parts.loss  # () each
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
