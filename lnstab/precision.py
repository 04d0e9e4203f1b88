"""Precision that fits the hardware: ``auto`` resolves to ``bf16-mixed`` where bf16 is native, else ``32-true``."""

from __future__ import annotations

import torch


def bf16_native(accelerator: str = "auto") -> bool:
    """Whether the device ``accelerator`` resolves to runs bf16 matrix products natively."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(requested: str | int | None, accelerator: str = "auto") -> tuple[str | int | None, str]:
    """``(value, reason)``: ``auto`` → ``bf16-mixed`` where bf16 is native, else ``32-true``; others as given."""
    if requested != "auto":
        return requested, ""
    if bf16_native(str(accelerator)):
        return "bf16-mixed", "bf16 is native on this device"
    return "32-true", "bf16 is not native on this device (it would run many times slower than fp32)"
