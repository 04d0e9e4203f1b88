"""The small pieces of a Block that vary with the config: norms (LayerNorm, RMSNorm, DyT), the residual update and its
gate (ReZero, LayerScale). Each is ``nn.Identity()`` where the config switches it off, so every variant of the model
has the same module names (hence hook names); see :mod:`lnstab.model` for where they sit.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

NORM_TYPES = ("layernorm", "rmsnorm", "dyt")
RESIDUAL_GATES = ("none", "rezero", "layerscale")


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025, "Transformers without Normalization"): ``γ ⊙ tanh(α·x) + β`` per token.

    A drop-in for a norm without statistics: ``α`` is one learnable scalar, ``γ`` (``weight``) and ``β`` (``bias``)
    are per channel, initialised to ``alpha_init``, 1 and 0 (the paper's default ``α₀ = 0.5``). Every entry of the
    output satisfies ``|γ·tanh(αx) + β| ≤ |γ| + |β|``, which is what Theorem 4's growth bound needs of an output norm
    (see :class:`lnstab.callbacks.GrowthBoundMonitor`). The parameters are named like a LayerNorm's so code that reads
    ``weight``/``bias`` of a norm reads them here too.

    Args:
        width: Channels of the last dimension.
        alpha_init: Initial ``α``.
        bias: Whether ``β`` exists (``False``: ``γ ⊙ tanh(α·x)``, as a LayerNorm without bias).
    """

    def __init__(self, width: int, alpha_init: float = 0.5, bias: bool = True) -> None:
        super().__init__()
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.empty(1))
        self.weight = nn.Parameter(torch.empty(width))
        self.bias = nn.Parameter(torch.empty(width)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``α = alpha_init``, ``γ = 1``, ``β = 0``."""
        nn.init.constant_(self.alpha, self.alpha_init)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight * torch.tanh(self.alpha * x)  # (..., C)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, alpha_init={self.alpha_init}, bias={self.bias is not None}"


NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, DyT)  # what a norm of lnstab's GPT can be (when it is not nn.Identity)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` without torch's warning, in every bf16-mixed fit on a CPU, that autocast's bf16 input and the
    fp32 weight cannot use the fused kernel (the unfused one computes the same norm; nothing else changes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or x.dtype == self.weight.dtype or torch.compiler.is_compiling():
            return super().forward(x)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            return super().forward(x)


def make_norm(
    norm_type: str, width: int, *, enabled: bool = True, eps: float = 1e-5, bias: bool = True, alpha_init: float = 0.5
) -> nn.Module:
    """A norm of ``width`` channels (``layernorm``, ``rmsnorm`` or ``dyt``), or ``nn.Identity()`` when not enabled.

    ``eps`` serves LayerNorm and RMSNorm, ``alpha_init`` DyT; ``bias`` gives LayerNorm and DyT a ``β`` (RMSNorm has
    none).
    """
    if not enabled:
        return nn.Identity()
    if norm_type == "rmsnorm":
        return RMSNorm(width, eps=eps)
    if norm_type == "dyt":
        return DyT(width, alpha_init=alpha_init, bias=bias)
    return nn.LayerNorm(width, eps=eps, bias=bias)


class Residual(nn.Module):
    """Parameter-free residual update ``stream·x + scale·fx``: hooks on it see every update of the residual stream.

    ``scale`` is Δt; ``stream`` is 1 except under DeepNorm, whose up-weighting ``α`` of the stream it is.
    """

    def __init__(self, scale: float, stream: float = 1.0) -> None:
        super().__init__()
        self.scale = float(scale)
        self.stream = float(stream)

    def forward(self, x: torch.Tensor, fx: torch.Tensor) -> torch.Tensor:
        if self.stream != 1.0:
            x = x * self.stream  # (B, T, C)
        if self.scale == 1.0:
            return x + fx
        return torch.add(x, fx, alpha=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}" + (f", stream={self.stream}" if self.stream != 1.0 else "")


class Gate(nn.Module):
    """A learnable gain on a sublayer's update, ``fx ⊙ weight``, applied before Δt: ``x + Δt·(weight ⊙ f(x))``.

    ReZero (Bachlechner et al. 2020, "ReZero is all you need") is one scalar initialised to 0, so every residual
    half-step is the identity at initialisation; LayerScale (Touvron et al. 2021, "Going deeper with Image
    Transformers", CaiT) is one gain per channel, ``diag(λ)``, initialised to a small ``ε``. ``weight`` is 1-D, so
    :meth:`lnstab.module.GPTModule.parameter_groups` keeps it out of weight decay, as both papers do.

    Args:
        width: 1 (a scalar gate, ReZero) or the model's width (per channel, LayerScale).
        init: The gain at initialisation.
    """

    def __init__(self, width: int, init: float) -> None:
        super().__init__()
        self.init = float(init)
        self.weight = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.init)

    def forward(self, fx: torch.Tensor) -> torch.Tensor:
        return fx * self.weight  # (B, T, C) ⊙ (C,) or (1,)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, init={self.init}"


def cait_layerscale_init(n_layer: int) -> float:
    """CaiT's LayerScale ``ε`` by depth (Touvron et al. 2021, §2 "LayerScale"): 0.1 up to 18 layers, 1e-5 at 24 and
    1e-6 beyond; the paper states no value between 18 and 24, where this takes 1e-5."""
    if n_layer <= 18:
        return 0.1
    return 1e-5 if n_layer <= 24 else 1e-6


def make_gate(residual_gate: str, width: int, layerscale_init: float) -> nn.Module:
    """``nn.Identity()`` for ``none``, a scalar :class:`Gate` at 0 for ``rezero``, a per-channel one at
    ``layerscale_init`` for ``layerscale``."""
    if residual_gate == "rezero":
        return Gate(1, 0.0)
    if residual_gate == "layerscale":
        return Gate(width, layerscale_init)
    return nn.Identity()
