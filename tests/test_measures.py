"""lnstab.measures, the one home of the measures the callbacks, the report and the check share."""

from __future__ import annotations

import math

import pytest

from lnstab.measures import (
    BF16_MAX,
    FP16_MAX,
    best_rate,
    deep_doublings,
    fit_line,
    growth_law,
    jacobian_points,
    ladder_sensitivity,
    log_log_slope,
)


def test_no_spread_in_x_is_no_fit_even_when_rounded_means_leave_a_remainder() -> None:
    # sum([0.1] * 3) / 3 is not 0.1, so a variance from the mean is a few ulps and a slope of them would be noise.
    assert math.isnan(fit_line([0.1] * 3, [1.0, 2.0, 4.0])["slope"])
    assert math.isnan(log_log_slope([(0.1, 1.0), (0.1, 2.0), (0.1, 4.0)])["slope"])


def test_complete_makes_one_non_finite_value_undefine_the_growth_law() -> None:
    depths, values = [0.5, 1.0, 1.5, 2.0], [1.0, 2.0, 0.0, 8.0]
    assert math.isfinite(growth_law(depths, values)["exp_rate"])  # the zero left out of log y
    live = growth_law(depths, values, complete=True)
    assert math.isnan(live["exp_rate"]) and math.isfinite(live["lin_slope"]) and live["law"] == "n/a"


def test_ladder_sensitivity_and_best_rate() -> None:
    points = {1e-3: 4.0, 1e-2: 3.0, 1e-1: 5.0}
    assert ladder_sensitivity(points) == pytest.approx((1.0 + 0.0 + 2.0) / 3)
    assert best_rate({**points, 3e-2: 3.0}) == (1e-2, 3.0)  # a tie: the lowest rate
    assert math.isnan(ladder_sensitivity({1e-3: 4.0})) and best_rate({}) is None
    assert math.isnan(ladder_sensitivity({1e-3: 4.0, 1e-2: math.nan}))


def test_jacobian_points_pair_each_block_and_step_and_drop_what_has_no_logarithm() -> None:
    scalars = {"jacobian/sensitivity/L01": [(0, 2.0), (5, 0.0)], "jacobian/act_scale/L01": [(5, 1.0), (0, 3.0)],
               "jacobian/sensitivity/L00": [(0, 1.0), (5, math.nan)], "jacobian/act_scale/L00": [(0, 4.0)],
               "jacobian/residual/L00": [(0, 9.0)]}
    assert jacobian_points(scalars) == [(3.0, 2.0), (4.0, 1.0)]  # blocks in the mapping's order, steps ascending


def test_deep_doublings_is_nan_not_an_error_when_mid_depth_overflowed() -> None:
    # a profile that overflowed at mid-depth and came back finite at the top (an fp16 inf, say) has no ratio
    assert math.isnan(deep_doublings([1.0, 2.0, 3.0, 4.0], [1.0, math.inf, math.inf, 5.0]))
    assert deep_doublings([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]) == 1.0  # linear from 0: one doubling


def test_the_overflow_limits_are_torchs() -> None:
    """The report's fp16-overflow count and the card's fp16/bf16 thresholds read these: the dtypes' largest finite."""
    import torch

    assert FP16_MAX == torch.finfo(torch.float16).max and BF16_MAX == torch.finfo(torch.bfloat16).max
