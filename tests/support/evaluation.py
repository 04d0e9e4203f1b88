"""Two evaluations compared: the same samples exactly, scores up to float rounding."""

from __future__ import annotations

import pytest


def assert_same_evaluation(a: dict, b: dict) -> None:
    """Same windows, texts and order exactly; scores equal up to float rounding (1e-6 relative), since ranks run with
    fewer threads than one process and CPU kernels reduce in thread-count-dependent order."""
    assert len(a["samples"]) == len(b["samples"])
    for x, y in zip(a["samples"], b["samples"], strict=True):
        assert {k: v for k, v in x.items() if isinstance(v, str | int)} == {
            k: v for k, v in y.items() if isinstance(v, str | int)
        }
        for k, v in x.items():
            if isinstance(v, float):
                assert v == pytest.approx(y[k], rel=1e-6, abs=1e-9), k
    assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-6, abs=1e-9)
