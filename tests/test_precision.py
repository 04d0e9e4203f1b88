"""Precision that fits the hardware: auto resolves by the (simulated) native-bf16 check, with a reason."""

from __future__ import annotations

import pytest

from lnstab import precision
from lnstab.precision import precision_warning, resolve_precision


def simulate(monkeypatch, *, cpu_bf16: bool, cuda: bool = False, cuda_bf16: bool = False) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: cpu_bf16)
    monkeypatch.setattr(precision, "cuda_has_native_bf16", lambda: cuda and cuda_bf16)
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(precision.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")


@pytest.mark.parametrize("accelerator", ["auto", "cpu"])
def test_auto_is_32_true_on_a_cpu_without_native_bf16(monkeypatch, accelerator: str) -> None:
    simulate(monkeypatch, cpu_bf16=False)
    value, reason = resolve_precision("auto", accelerator)
    assert value == "32-true"
    assert "no native bf16" in reason and "\n" not in reason


def test_auto_is_bf16_mixed_on_a_cpu_with_native_bf16(monkeypatch) -> None:
    simulate(monkeypatch, cpu_bf16=True)
    value, reason = resolve_precision("auto", "cpu")
    assert value == "bf16-mixed" and "natively" in reason


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda"])
def test_auto_is_bf16_mixed_on_a_gpu_with_native_bf16(monkeypatch, accelerator: str) -> None:
    simulate(monkeypatch, cpu_bf16=False, cuda=True, cuda_bf16=True)
    value, reason = resolve_precision("auto", accelerator)
    assert value == "bf16-mixed" and "NVIDIA H200" in reason


def test_auto_is_32_true_on_a_gpu_without_bf16_and_cpu_accelerator_ignores_the_gpu(monkeypatch) -> None:
    simulate(monkeypatch, cpu_bf16=False, cuda=True, cuda_bf16=False)
    assert resolve_precision("auto", "gpu")[0] == "32-true"
    simulate(monkeypatch, cpu_bf16=False, cuda=True, cuda_bf16=True)
    assert resolve_precision("auto", "cpu")[0] == "32-true"  # the run is on the CPU, whatever GPU is visible


def test_explicit_values_pass_through_and_bf16_on_a_slow_cpu_warns(monkeypatch) -> None:
    simulate(monkeypatch, cpu_bf16=False)
    assert resolve_precision("bf16-mixed", "cpu") == ("bf16-mixed", "")  # explicit values pass through, no reason
    assert resolve_precision(32, "cpu") == (32, "") and resolve_precision(None, "cpu") == (None, "")
    line = precision_warning("bf16-mixed", "cpu")
    assert line is not None and "bf16-mixed" in line and "32-true" in line and "\n" not in line
    assert precision_warning("32-true", "cpu") is None
    simulate(monkeypatch, cpu_bf16=True)
    assert precision_warning("bf16-mixed", "cpu") is None
    simulate(monkeypatch, cpu_bf16=False, cuda=True, cuda_bf16=True)
    assert precision_warning("bf16-mixed", "auto") is None  # auto picks the GPU here


def test_other_accelerators_resolve_auto_to_32_true(monkeypatch) -> None:
    simulate(monkeypatch, cpu_bf16=True, cuda=True, cuda_bf16=True)
    value, reason = resolve_precision("auto", "mps")
    assert value == "32-true" and "mps" in reason
