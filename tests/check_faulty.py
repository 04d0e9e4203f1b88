"""Faulty models for ``lnstab check --factory`` (no tests here; imported as ``check_faulty``).

Each passes the check's up-front probe (token ids ``(2, T)`` under ``no_grad`` give logits ``(2, T, V)``) and then
breaks during the stress runs, as a model under development does.
"""

from __future__ import annotations

import os
import sys

import torch
from check_factories import VOCAB, WIDTH, EncoderLM
from torch import nn


class FailsWithGrad(EncoderLM):
    """Fails whenever autograd is recording: the probe passes, every training step raises."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("this model cannot train")
        return super().forward(idx)


class ExitsInTraining(EncoderLM):
    """Ends the process in its first training forward (with ``always``, in its first forward, the check's probe):
    ``sys.exit(0)`` (``how='sys'``) or ``os._exit(0)``."""

    def __init__(self, how: str, always: bool = False) -> None:
        super().__init__()
        self.how, self.always = how, always

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.always or torch.is_grad_enabled():
            if self.how == "sys":
                sys.exit(0)
            os._exit(0)
        return super().forward(idx)


class NaNLogits(EncoderLM):
    """Logits that are NaN: always (``when='always'``), or only in training forwards (``'training'``)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        if self.when == "always" or torch.is_grad_enabled():
            return logits * float("nan")  # still attached to the parameters: a loss, NaN, and its backward
        return logits


class Passthrough(nn.Module):
    """A block of the user's own with no parameter (torch's nn.Identity selected as blocks is refused before training,
    as torch's layers without submodules are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NoParameters(nn.Module):
    """Blocks and logits with no parameter at all (fixed one-hot logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Passthrough() for _ in range(2)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = nn.functional.one_hot(idx, VOCAB).float()  # (B, T, V)
        for layer in self.layers:
            x = layer(x)
        return x


class InterruptsInTraining(EncoderLM):
    """Raises ``KeyboardInterrupt`` in its first training forward (a forward with grad)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise KeyboardInterrupt
        return super().forward(idx)


def interrupts_in_training() -> nn.Module:
    """A model whose training forward raises ``KeyboardInterrupt``."""
    return InterruptsInTraining()


class DetachedLogits(EncoderLM):
    """Logits cut off from the parameters: the loss has no gradient."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).detach()


class SkipsABlock(EncoderLM):
    """Has a block (``extra.0``) the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ModuleList([nn.Linear(WIDTH, WIDTH)])


class DiscardsItsBlocks(EncoderLM):
    """Calls each block and drops what it returns (``block(x)`` for ``x = block(x)``): a bigram model."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        for layer in self.encoder.layers:
            layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def fails_with_grad() -> nn.Module:
    """A model whose forward fails only in training."""
    return FailsWithGrad()


def sys_exits() -> nn.Module:
    """A model whose training forward calls ``sys.exit(0)``."""
    return ExitsInTraining("sys")


def os_exits() -> nn.Module:
    """A model whose training forward calls ``os._exit(0)``."""
    return ExitsInTraining("os")


def sys_exits_when_probed() -> nn.Module:
    """A model whose every forward calls ``sys.exit(0)``."""
    return ExitsInTraining("sys", always=True)


def os_exits_when_probed() -> nn.Module:
    """A model whose every forward calls ``os._exit(0)``."""
    return ExitsInTraining("os", always=True)


def nan_logits() -> nn.Module:
    """A model whose logits are NaN from initialisation on."""
    return NaNLogits("always")


def nan_in_training() -> nn.Module:
    """A model whose logits are finite when probed (no grad) and NaN in every training forward."""
    return NaNLogits("training")


def no_parameters() -> nn.Module:
    """A model without parameters."""
    return NoParameters()


def detached_logits() -> nn.Module:
    """A model whose logits do not depend on its parameters through autograd."""
    return DetachedLogits()


def skips_a_block() -> nn.Module:
    """A model with a matched block that is never called."""
    return SkipsABlock()


def discards_its_blocks() -> nn.Module:
    """A model whose logits depend on none of its blocks."""
    return DiscardsItsBlocks()
