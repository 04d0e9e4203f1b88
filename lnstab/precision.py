"""Choose the training precision the hardware runs fast: ``bf16-mixed`` where bf16 is native, ``32-true`` elsewhere.

On a CPU without native bf16 (no AVX-512 BF16 / AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False),
bf16 matrix products are emulated and run ~50× slower than fp32 (0.3 vs 15 GFLOP/s measured side by side on a 2-core
AVX2 EPYC), so a config that asks for ``bf16-mixed`` there spends minutes per step. :func:`resolve_precision` turns the
value ``auto`` into the fast choice with one line saying why, and :func:`precision_warning` gives the line to print when
``bf16-mixed`` is asked for explicitly where it is slow.
"""

from __future__ import annotations

import torch

AUTO = "auto"
GPU_ACCELERATORS = ("gpu", "cuda")


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matrix products natively on this CPU (AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def cuda_has_native_bf16() -> bool:
    """Whether a CUDA device is present and supports bf16 natively (Ampere or newer, not emulated)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def _device_kind(accelerator: str) -> str:
    if accelerator in GPU_ACCELERATORS:
        return "cuda"
    if accelerator == "cpu":
        return "cpu"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"  # what Lightning's accelerator="auto" picks here
    return "other"  # mps, tpu, ...: not checked


def resolve_precision(requested: str | int | None, accelerator: str = "auto") -> tuple[str | int | None, str]:
    """The Lightning precision to train with, and why (one line; empty unless ``requested`` is ``"auto"``).

    ``"auto"`` resolves to ``"bf16-mixed"`` where bf16 is native on the device the accelerator selects (a CUDA device
    with native bf16, Ampere or newer; a CPU where ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, i.e. AVX-512
    BF16 or AMX) and to ``"32-true"`` elsewhere, including accelerators other than CPU and CUDA. Any other value,
    ``None`` included, is returned unchanged with an empty reason; :func:`precision_warning` says when an explicit
    value is slow on this hardware.

    Callers print ``f"precision auto -> {value} ({reason})"`` and record ``value`` (never ``auto``) in the run's saved
    config and hyperparameters, so a run states the precision it trained in.

    Args:
        requested: ``"auto"`` or a Lightning precision value (``"bf16-mixed"``, ``"32-true"``, ``32``, ``None`` ...).
        accelerator: The Trainer's accelerator: ``"auto"`` (CUDA when a CUDA device is visible, else the CPU),
            ``"cpu"``, ``"gpu"`` or ``"cuda"``; others resolve ``auto`` to ``32-true``.

    Returns:
        ``(value, reason)``, e.g. ``("32-true", "this CPU has no native bf16 instructions, AVX-512 BF16 or AMX; ...")``.
    """
    if requested != AUTO:
        return requested, ""
    kind = _device_kind(str(accelerator))
    if kind == "cuda":
        if cuda_has_native_bf16():
            return "bf16-mixed", f"{torch.cuda.get_device_name(0)} runs bf16 natively"
        return "32-true", "no CUDA device with native bf16 (Ampere or newer) is visible"
    if kind == "cpu":
        if cpu_has_native_bf16():
            return "bf16-mixed", "this CPU runs bf16 natively (AVX-512 BF16 / AMX)"
        return "32-true", "this CPU has no native bf16 instructions, AVX-512 BF16 or AMX; bf16 would run ~50x slower"
    return "32-true", f"bf16 support is not checked on accelerator={accelerator!r}"


def precision_warning(precision: str | int | None, accelerator: str = "auto") -> str | None:
    """One line to print when ``bf16-mixed``/``bf16-true`` is asked for on a CPU without native bf16, else ``None``.

    Args:
        precision: The configured precision (``auto`` never warns: it resolves to the fast choice).
        accelerator: As in :func:`resolve_precision`.
    """
    if precision is None or not str(precision).startswith("bf16"):
        return None
    if _device_kind(str(accelerator)) != "cpu" or cpu_has_native_bf16():
        return None
    return (
        f"precision={precision} on a CPU without native bf16 (no AVX-512 BF16 / AMX) runs ~50x slower than fp32; "
        "use --trainer.precision 32-true (or auto)"
    )
