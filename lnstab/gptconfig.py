"""``GPTConfig``: the shape and variant of one GPT of the family, checked on construction, and the named shapes
(:data:`PRESETS`); :mod:`lnstab.model` builds the network from it and re-exports both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lnstab import validation as require
from lnstab.errors import ConfigError
from lnstab.layers import NORM_TYPES, RESIDUAL_GATES, cait_layerscale_init
from lnstab.loss import z_loss_coefficient
from lnstab.placements import PLACEMENTS

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

# Initialisations of the weights (GPTConfig.init): GPT-2's, and Xavier's without residual scaling.
INITS = ("gpt2", "xavier")


@dataclass
class GPTConfig:
    """Shape and variant of a GPT. Defaults are GPT-2 124M (``bias=True``, Pre-LN, Δt = 1, no option on).

    Attributes:
        block_size: Longest sequence the position embedding covers.
        vocab_size: Tokens the model predicts (GPT-2 BPE: 50257).
        pad_vocab_multiple: Round the embedding table up to a multiple of this (64 gives nanoGPT's 50304);
            logits are still returned for ``vocab_size`` tokens only.
        n_layer, n_head, n_embd: Depth, heads, width.
        dropout: Dropout on embeddings, attention weights and sublayer outputs.
        bias: Biases in linear layers and LayerNorms.
        norm_placement: A key of :data:`PLACEMENTS`: ``pre``, ``peri``, ``post``, ``output``, ``none``,
            ``deepnorm``.
        norm_type: ``layernorm``, ``rmsnorm`` or ``dyt`` (:class:`~lnstab.layers.DyT`), for every norm of the model
            (those of the placement and, with ``qk_norm``, the query and key norms).
        residual_scale: Δt > 0, the residual step size applied to both sublayers.
        norm_eps: Epsilon of every LayerNorm or RMSNorm.
        qk_norm: Normalise queries and keys per head, over the head dimension (a norm of width ``n_embd/n_head``
            shared by the heads, of ``norm_type``), right before the attention product: ``attn.q_norm`` and
            ``attn.k_norm`` (Dehghani et al. 2023, ViT-22B; OLMo 2 normalises the whole ``n_embd``-wide projection
            instead).
        z_loss: Coefficient ``c ≥ 0`` of the auxiliary loss ``c·mean_tokens (log Z)²``, ``log Z`` the log-sum-exp
            of a token's logits (PaLM, Chowdhery et al. 2022, uses 1e-4); computed in the chunked head loss
            (:func:`lnstab.loss.lm_head_losses`). It changes training only, not the model's function.
        dyt_alpha_init: Initial α of every DyT (Zhu et al. 2025's default 0.5); used with ``norm_type='dyt'`` only.
        residual_gate: ``none``, ``rezero`` (one scalar per sublayer, 0 at init: ``x + Δt·α·f(x)``, Bachlechner et al.
            2020) or ``layerscale`` (one gain per channel: ``x + Δt·diag(λ)·f(x)``, Touvron et al. 2021); the gate
            multiplies the sublayer's output (after its output norm, if any) before Δt. Bachlechner et al.'s ReZero
            has no norms: ``norm_placement='none'`` with ``residual_gate='rezero'``.
        layerscale_init: LayerScale's λ at initialisation; ``None``: CaiT's depth rule
            (:func:`~lnstab.layers.cait_layerscale_init`: 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 beyond). Used
            with ``residual_gate='layerscale'`` only.
        tie_embeddings: The output head shares the token embedding's weight (GPT-2); ``False``: ``lm_head`` is its
            own matrix (the untied embeddings of Wortsman et al. 2023's small-scale proxies).
        init: :data:`INITS`. ``gpt2``: N(0, 0.02) for every linear weight and embedding, residual projections
            (``c_proj``) N(0, 0.02/√(2·n_layer)). ``xavier``: Xavier-uniform (Glorot & Bengio 2010, gain 1,
            U(±√(6/(fan_in+fan_out)))) for every linear weight of the blocks and for an untied ``lm_head``, the
            query, key and value projections each as its own ``n_embd × n_embd`` matrix, and no residual scaling:
            the initialisation of the Post-LN Transformers that fail to train without warm-up (Xiong et al. 2020);
            embeddings stay N(0, 0.02) and biases 0. A placement's own initialisation (DeepNorm) still applies after.
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
    qk_norm: bool = False
    z_loss: float = 0.0
    dyt_alpha_init: float = 0.5
    residual_gate: str = "none"
    layerscale_init: float | None = None
    tie_embeddings: bool = True
    init: str = "gpt2"

    def __post_init__(self) -> None:
        require.choice("norm_placement", self.norm_placement, list(PLACEMENTS))
        require.choice("norm_type", self.norm_type, NORM_TYPES)
        require.choice("residual_gate", self.residual_gate, RESIDUAL_GATES)
        require.choice("init", self.init, INITS)
        for name in ("block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_embd"):
            require.positive_int(name, getattr(self, name))
        for name in ("residual_scale", "norm_eps", "dyt_alpha_init"):
            require.number(name, getattr(self, name), 0.0, low_open=True)
        require.number("dropout", self.dropout, 0.0, 1.0, high_open=True)
        z_loss_coefficient(self.z_loss)
        require.optional_number("layerscale_init", self.layerscale_init, 0.0, low_open=True)
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed; it must be true or false")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not allowed with n_head={self.n_head}; n_embd must be divisible by n_head"
            )

    @property
    def layerscale(self) -> float:
        """LayerScale's λ at initialisation: ``layerscale_init``, or CaiT's rule for ``n_layer`` when it is ``None``."""
        return cait_layerscale_init(self.n_layer) if self.layerscale_init is None else self.layerscale_init

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table: ``vocab_size`` rounded up to ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named shape (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``tiny``, ``mini``, ``small``,
        ``deep-narrow``) with any field overridden; ``None`` overrides are ignored."""
        require.choice("preset", name, list(PRESETS))
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in fields:
                raise ConfigError(f"{key!r} is not a GPTConfig field; allowed: {', '.join(sorted(fields))}")
        values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**values)
