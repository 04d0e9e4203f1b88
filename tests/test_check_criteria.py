"""The criteria that predict, on constructed cases: Wortsman et al.'s LR sensitivity on constructed loss curves, the
attention-logit and output-logit criteria on constructed metric series, gradient spread's warn and fail bands, the
Jacobian slope that warns only; the protocol vocabulary and the branch probe."""

from __future__ import annotations

import math

import pytest
import torch

from lnstab.check.analysis import ladder_sensitivity, lr_sensitivity, summarise
from lnstab.check.card import build_rows
from lnstab.check.criteria import DEFAULT_THRESHOLDS, resolve, status
from lnstab.check.probes import branch_norm
from lnstab.check.protocol import compact_vocabulary
from lnstab.check.training import RunResult
from lnstab.report.lr_sensitivity import Ladder


def run(lr: float, seed: int, losses: list[float], diverged: bool = False,
        metrics: dict[int, dict[str, float]] | None = None) -> RunResult:
    """A stress run with only what the criteria read (no hidden-state series)."""
    return RunResult(subject="checked", lr=lr, seed=seed, log_dir="tb", losses=losses, diverged=diverged,
                     diverged_step=len(losses) - 1 if diverged else None, events=[], hidden_tags=[], hidden_steps=[],
                     hidden={}, metrics=metrics or {})


def curve(start: float, end: float, steps: int = 5) -> list[float]:
    return [start + (end - start) * k / (steps - 1) for k in range(steps)]


def test_lr_sensitivity_is_the_mean_loss_lost_over_the_ladder() -> None:
    # L_init 10; final losses 8, 6, 7 at three rates: L* = 6, sensitivity = mean(2, 0, 1) = 1.
    runs = [run(1e-3, 0, curve(10, 8)), run(1e-2, 0, curve(10, 6)), run(1e-1, 0, curve(10, 7))]
    out = lr_sensitivity(runs)
    assert out["mean"] == pytest.approx(1.0) and out["best_lr"] == 1e-2 and out["best"] == pytest.approx(6.0)
    assert out["initial"] == pytest.approx(10.0)
    # the same points through lnstab report's implementation
    assert ladder_sensitivity(out["points"]) == pytest.approx(Ladder({}, "", points=dict(out["points"])).sensitivity)


def test_a_diverged_rung_and_a_rung_that_got_worse_count_as_the_initial_loss() -> None:
    runs = [run(1e-3, 0, curve(10, 7)), run(1e-2, 0, curve(10, 6)), run(1e-1, 0, [10.0, 9.0, math.nan], True),
            run(3e-1, 0, curve(10, 12))]  # ends above L_init: no better than not training
    out = lr_sensitivity(runs)
    assert out["points"][1e-1] == pytest.approx(10.0) and out["points"][3e-1] == pytest.approx(10.0)
    assert out["mean"] == pytest.approx((1 + 0 + 4 + 4) / 4)


def test_lr_sensitivity_spread_over_seeds_and_a_one_rung_ladder() -> None:
    runs = [run(1e-3, 0, curve(10, 8)), run(1e-2, 0, curve(10, 6)),  # seed 0: mean(2, 0) = 1
            run(1e-3, 1, curve(10, 6)), run(1e-2, 1, curve(10, 6))]  # seed 1: 0
    out = lr_sensitivity(runs)
    assert out["mean"] == pytest.approx(0.5) and out["sd"] == pytest.approx(0.5)
    assert math.isnan(lr_sensitivity([run(1e-2, 0, curve(10, 6))])["mean"])


def test_lr_sensitivity_warns_above_both_references_and_never_fails() -> None:
    limits = resolve(DEFAULT_THRESHOLDS["lr_sensitivity"], {"pre-ln": (0.4, 0.02), "peri-ln": (0.3, 0.05)})
    assert limits["warn"] == pytest.approx(0.5) and limits["fail"] is None
    assert [status(v, limits) for v in (0.35, 0.6, 5.0)] == ["pass", "warn", "warn"]


def attention_runs(logits_at_end: float, diverged_logits: float | None = None) -> list[RunResult]:
    runs = [run(lr, seed, curve(10, 7), metrics={
        0: {"attn/max_logit/L00": 0.5, "attn/max_logit/L01": 0.6, "attn/collapsed/L00": 0.0,
            "output/log_z_mean": 8.3},
        10: {"attn/max_logit/L00": logits_at_end / 2, "attn/max_logit/L01": logits_at_end, "output/log_z_mean": -3.0},
    }) for lr in (1e-2, 1e-1) for seed in (0, 1)]
    if diverged_logits is not None:  # a diverged run's huge logits do not count (its weights are gone)
        runs.append(run(3e-1, 0, [10.0, math.nan], True, {10: {"attn/max_logit/L00": diverged_logits}}))
    return runs


def test_attention_logit_growth_fails_beyond_the_collapse_threshold() -> None:
    checked = summarise(attention_runs(2000.0, diverged_logits=1e9), 10)
    assert checked["attention"]["mean"] == pytest.approx(2000.0) and checked["attention"]["init"] == pytest.approx(0.6)
    refs = {"pre-ln": summarise(attention_runs(20.0), 10), "peri-ln": summarise(attention_runs(12.0), 10)}
    rows = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}
    assert rows["attention"]["status"] == "fail" and rows["attention"]["fail"] == 1000
    assert "grow larger than both references" in rows["attention"]["why"]
    bounded = summarise(attention_runs(5.0), 10)  # QK-norm bounds the logits: below both references
    rows = {r["id"]: r for r in build_rows({"checked": bounded, **refs}, DEFAULT_THRESHOLDS, {})}
    assert rows["attention"]["status"] == "pass" and "smaller than both references" in rows["attention"]["why"]
    middle = summarise(attention_runs(40.0), 10)  # larger than both references, far below the collapse threshold
    assert {r["id"]: r for r in build_rows({"checked": middle, **refs}, DEFAULT_THRESHOLDS, {})}["attention"][
        "status"] == "warn"


def test_attention_fails_only_an_order_of_magnitude_beyond_references_that_collapse_too() -> None:
    refs = {"pre-ln": summarise(attention_runs(8000.0), 10), "peri-ln": summarise(attention_runs(7600.0), 10)}
    for logits, expected in ((8000.0, "pass"), (9000.0, "warn"), (90000.0, "fail")):
        checked = summarise(attention_runs(logits), 10)
        row = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}["attention"]
        assert row["fail"] == pytest.approx(80000.0) and row["status"] == expected, logits


def test_attention_is_not_applicable_where_q_and_k_are_not_found() -> None:
    plain = summarise([run(1e-2, 0, curve(10, 7))], 10)
    refs = {"pre-ln": summarise(attention_runs(20.0), 10), "peri-ln": summarise(attention_runs(12.0), 10)}
    rows = {r["id"]: r for r in build_rows({"checked": plain, **refs}, DEFAULT_THRESHOLDS, {"attention": False})}
    assert rows["attention"]["status"] == "n/a" and "q and k were not found" in rows["attention"]["why"]


def log_z_runs(drift: float) -> list[RunResult]:
    return [run(1e-2, seed, curve(10, 7), metrics={0: {"output/log_z_mean": 10.8},  # log V at initialisation
                                                   10: {"output/log_z_mean": drift}}) for seed in (0, 1)]


@pytest.mark.parametrize(("drift", "expected"), [(-40.0, "fail"), (7.5, "warn"), (6.8, "pass"), (0.2, "pass")])
def test_output_logit_drift_reads_log_z_after_initialisation(drift, expected) -> None:
    refs = {"pre-ln": summarise(log_z_runs(6.0), 10), "peri-ln": summarise(log_z_runs(5.5), 10)}
    checked = summarise(log_z_runs(drift), 10)
    assert checked["log_z"]["mean"] == pytest.approx(abs(drift)) and checked["log_z"]["init"] == pytest.approx(10.8)
    row = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}["log_z"]
    assert row["warn"] == pytest.approx(7.0) and row["fail"] == 30 and row["status"] == expected


def test_gradient_spread_warns_for_a_few_times_and_fails_for_orders_of_magnitude() -> None:
    limits = resolve(DEFAULT_THRESHOLDS["grad_spread"], {"pre-ln": (0.247, 0.03), "peri-ln": (0.168, 0.02)})
    # OLMo 2's reordered norm (x4.4: trains stably) warns; Post-LN's vanishing gradients (x8e7) fail
    assert status(math.log10(4.4), limits) == "warn" and status(7.92, limits) == "fail"
    assert limits["fail"] == pytest.approx(0.247 + 0.06 + 1)


def test_the_jacobian_slope_warns_but_never_fails() -> None:
    limits = resolve(DEFAULT_THRESHOLDS["sensitivity"], {"pre-ln": (-0.15, 0.1), "peri-ln": (-1.27, 0.1)})
    assert limits["fail"] is None and status(1.0, limits) == "warn"
    assert resolve(DEFAULT_THRESHOLDS["sensitivity"], None)["fail"] is None


def test_compact_vocabulary_keeps_the_text_and_drops_unused_ids() -> None:
    tokens = torch.tensor([[50256, 11, 11, 7], [7, 30000, 11, 50256]])
    compact, size = compact_vocabulary(tokens)
    assert size == 4 and compact.tolist() == [[3, 1, 1, 0], [0, 2, 1, 3]]  # 7 < 11 < 30000 < 50256
    assert torch.equal(compact[:, None, :] == compact[:, :, None], tokens[:, None, :] == tokens[:, :, None])


def test_branch_norm_is_the_largest_singular_value() -> None:
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6))
    weight = q @ torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1, 0.05])) @ q.T
    x = torch.randn(4, 6)
    assert float(branch_norm(lambda z: z @ weight, x, 60)) == pytest.approx(3.0, rel=1e-4)


def test_branch_norm_matches_the_callbacks_spectral_norm_on_a_block() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lnstab.callbacks import spectral_norm
    from lnstab.model import GPT, GPTConfig

    torch.manual_seed(0)
    block = GPT(GPTConfig.preset("tiny", vocab_size=64)).eval().transformer.h[1]
    x = torch.randn(2, 16, 64)
    fn = lambda z: block(z)[0] - z  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH):
        ours, theirs = branch_norm(fn, x, 8), spectral_norm(fn, x, 8)
    assert float(ours) == pytest.approx(float(theirs.detach()), rel=1e-4)
