"""The criteria that predict, on constructed cases: Wortsman et al.'s LR sensitivity on constructed loss curves, the
attention-logit and output-logit criteria on constructed metric series, gradient spread and the Jacobian slope that
warn only (mechanisms: only outcomes fail, and a thresholds file cannot make a mechanism fail); the protocol
vocabulary and the branch probe."""

from __future__ import annotations

import math

import pytest
import torch

from lnstab.check.analysis import lr_sensitivity, summarise
from lnstab.check.card import build_rows
from lnstab.check.criteria import DEFAULT_PATH, DEFAULT_THRESHOLDS, IDS, load_thresholds, read_defaults, resolve, status
from lnstab.check.probes import branch_norm
from lnstab.check.training import RunResult
from lnstab.datamodules.vocab import compact_vocabulary
from lnstab.errors import LNStabError
from lnstab.measures import ladder_sensitivity
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


def test_without_references_a_loss_that_ends_above_its_start_is_flagged(tmp_path) -> None:
    """``--no-reference``: the Learns row warns when no rate took the loss below its own initial loss (it passed a
    rising loss: the absolute threshold was null), and a model that learned nothing gets no LR sensitivity (it read
    0, "less sensitive than both references"), while a model that learns passes both."""
    def rows(end: float) -> dict[str, dict]:
        checked = summarise([run(lr, seed, curve(10, end + lr)) for lr in (1e-3, 1e-2) for seed in (0, 1)], 4)
        return {r["id"]: r for r in build_rows({"checked": checked}, DEFAULT_THRESHOLDS, {})}

    rising, learns = rows(11.0), rows(6.0)
    assert rising["loss"]["status"] == "warn" and rising["loss"]["warn"] == pytest.approx(10.0)
    assert rising["loss"]["warn_rule"] == "loss_init" and rising["loss"]["warn_source"] == "absolute"
    assert learns["loss"]["status"] == "pass" and learns["loss"]["measured"] == pytest.approx(6.001)
    assert math.isnan(rising["lr_sensitivity"]["measured"]) and rising["lr_sensitivity"]["status"] == "n/a"
    assert "no learning rate took the loss below its initial 10" in rising["lr_sensitivity"]["why"]
    assert learns["lr_sensitivity"]["measured"] == pytest.approx(0.0045)
    assert learns["lr_sensitivity"]["status"] == "pass"
    # a thresholds file may name the model's own initial loss in an absolute threshold, and no reference there
    custom = tmp_path / "t.yaml"
    custom.write_text("loss:\n  absolute: {warn: loss_init - 1, fail: loss_init}\n")
    limits = resolve(load_thresholds(custom)["loss"], None, {"loss_init": 10.0})
    assert (limits["warn"], limits["fail"]) == (9.0, 10.0) and status(9.5, limits) == "warn"


def attention_runs(logits_at_end: float, diverged_logits: float | None = None) -> list[RunResult]:
    runs = [run(lr, seed, curve(10, 7), metrics={
        0: {"attn/max_logit/L00": 0.5, "attn/max_logit/L01": 0.6, "attn/collapsed/L00": 0.0,
            "output/log_z_mean": 8.3},
        10: {"attn/max_logit/L00": logits_at_end / 2, "attn/max_logit/L01": logits_at_end, "output/log_z_mean": -3.0},
    }) for lr in (1e-2, 1e-1) for seed in (0, 1)]
    if diverged_logits is not None:  # a diverged run's huge logits do not count (its weights are gone)
        runs.append(run(3e-1, 0, [10.0, math.nan], True, {10: {"attn/max_logit/L00": diverged_logits}}))
    return runs


def test_attention_logit_growth_beyond_the_collapse_threshold_warns_as_a_mechanism() -> None:
    checked = summarise(attention_runs(2000.0, diverged_logits=1e9), 10)
    assert checked["attention"]["mean"] == pytest.approx(2000.0) and checked["attention"]["init"] == pytest.approx(0.6)
    refs = {"pre-ln": summarise(attention_runs(20.0), 10), "peri-ln": summarise(attention_runs(12.0), 10)}
    rows = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}
    assert rows["attention"]["status"] == "warn" and rows["attention"]["fail"] is None  # it failed until issue 39
    assert "grow larger than both references" in rows["attention"]["why"]
    assert "a mechanism, so it warns and never fails" in rows["attention"]["why"]
    assert resolve(DEFAULT_THRESHOLDS["attention"], None)["warn"] == 1000  # without references: the collapse level
    bounded = summarise(attention_runs(5.0), 10)  # QK-norm bounds the logits: below both references
    rows = {r["id"]: r for r in build_rows({"checked": bounded, **refs}, DEFAULT_THRESHOLDS, {})}
    assert rows["attention"]["status"] == "pass" and "smaller than both references" in rows["attention"]["why"]
    middle = summarise(attention_runs(40.0), 10)  # larger than both references, far below the collapse threshold
    assert {r["id"]: r for r in build_rows({"checked": middle, **refs}, DEFAULT_THRESHOLDS, {})}["attention"][
        "status"] == "warn"


def test_attention_beside_references_that_collapse_too_passes_as_the_references_and_never_fails() -> None:
    refs = {"pre-ln": summarise(attention_runs(8000.0), 10), "peri-ln": summarise(attention_runs(7600.0), 10)}
    for logits, expected in ((8000.0, "pass"), (9000.0, "warn"), (90000.0, "warn")):  # 90000 failed until issue 39
        checked = summarise(attention_runs(logits), 10)
        row = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}["attention"]
        assert row["fail"] is None and row["status"] == expected, logits


def collapsing_runs(collapsed: float) -> list[RunResult]:
    return [run(1e-1, seed, curve(10, 7), metrics={0: {"attn/max_logit/L00": 0.5, "attn/collapsed/L00": 0.0},
                                                   10: {"attn/max_logit/L00": 8000.0, "attn/collapsed/L00": collapsed}})
            for seed in (0, 1)]


def test_a_pass_beside_collapsed_attention_rows_says_whether_the_references_collapse_as_much() -> None:
    """Issue 39: a PASS beside 95 % collapsed rows read as if collapse were fine; it is said to be what the references
    do, or not."""
    refs = {"pre-ln": summarise(collapsing_runs(0.99), 10), "peri-ln": summarise(collapsing_runs(0.97), 10)}

    def attention(collapsed: float) -> dict:
        checked = summarise(collapsing_runs(collapsed), 10)
        return {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}["attention"]

    same = attention(0.95)
    assert same["status"] == "pass"
    assert "largest collapsed-row fraction 0.95, as the references (Pre-LN 0.99, Peri-LN 0.97)" in same["why"]
    assert "less than the references" in attention(0.2)["why"]
    refs = {"pre-ln": summarise(collapsing_runs(0.1), 10), "peri-ln": summarise(collapsing_runs(0.0), 10)}
    assert "0.95, more than the references (Pre-LN 0.1, Peri-LN 0)" in attention(0.95)["why"]


def test_attention_is_not_applicable_where_q_and_k_are_not_found() -> None:
    plain = summarise([run(1e-2, 0, curve(10, 7))], 10)
    refs = {"pre-ln": summarise(attention_runs(20.0), 10), "peri-ln": summarise(attention_runs(12.0), 10)}
    rows = {r["id"]: r for r in build_rows({"checked": plain, **refs}, DEFAULT_THRESHOLDS, {"attention": False})}
    assert rows["attention"]["status"] == "n/a" and "q and k were not found" in rows["attention"]["why"]


def log_z_runs(drift: float) -> list[RunResult]:
    return [run(1e-2, seed, curve(10, 7), metrics={0: {"output/log_z_mean": 10.8},  # log V at initialisation
                                                   10: {"output/log_z_mean": drift}}) for seed in (0, 1)]


@pytest.mark.parametrize(("drift", "expected"), [(-40.0, "warn"), (7.5, "warn"), (6.8, "pass"), (0.2, "pass")])
def test_output_logit_drift_reads_log_z_after_initialisation(drift, expected) -> None:
    refs = {"pre-ln": summarise(log_z_runs(6.0), 10), "peri-ln": summarise(log_z_runs(5.5), 10)}
    checked = summarise(log_z_runs(drift), 10)
    assert checked["log_z"]["mean"] == pytest.approx(abs(drift)) and checked["log_z"]["init"] == pytest.approx(10.8)
    row = {r["id"]: r for r in build_rows({"checked": checked, **refs}, DEFAULT_THRESHOLDS, {})}["log_z"]
    assert row["warn"] == pytest.approx(7.0) and row["fail"] is None and row["status"] == expected  # -40 failed


def test_gradient_spread_warns_and_never_fails_however_wide() -> None:
    """Issue 39: gradient spread is a mechanism its sources say is not the cause (Liu et al. 2020; DeepNet §3), so
    Post-LN's vanishing gradients (x8e7), which failed, warn, and so does a spread of 300 decades."""
    limits = resolve(DEFAULT_THRESHOLDS["grad_spread"], {"pre-ln": (0.247, 0.03), "peri-ln": (0.168, 0.02)})
    # OLMo 2's reordered norm (x4.4: trains stably) warns; Post-LN's vanishing gradients (x8e7) warn too
    assert status(math.log10(4.4), limits) == "warn" and status(7.92, limits) == "warn" and limits["fail"] is None
    refs = {k: summarise([run(1e-2, 0, curve(10, 7), metrics={5: {"grad/norm/L00": 1.0, "grad/norm/L01": 2.0}})], 10)
            for k in ("pre-ln", "peri-ln")}
    extreme = summarise([run(1e-2, 0, curve(10, 7), metrics={5: {"grad/norm/L00": 1e-150, "grad/norm/L01": 1e150}})],
                        10)
    assert extreme["grad_spread"]["mean"] == pytest.approx(300.0)
    for references in (refs, {}):  # graded against the references, and without them (--no-reference)
        row = {r["id"]: r for r in build_rows({"checked": extreme, **references}, DEFAULT_THRESHOLDS, {})}[
            "grad_spread"]
        assert row["status"] == "warn" and row["fail"] is None, references
        assert "unbalanced gradients are not the root cause of instability (Liu et al. 2020)" in row["why"]
        assert "DeepNet §3" in row["why"]


def test_only_outcome_criteria_can_fail() -> None:
    """Every criterion is an outcome or a mechanism in thresholds.yaml; no mechanism fails at any value, with or
    without references."""
    kinds = {cid: DEFAULT_THRESHOLDS[cid]["kind"] for cid in IDS}
    assert {cid for cid, kind in kinds.items() if kind == "outcome"} == {"divergence", "lr_sensitivity", "loss"}
    assert set(kinds.values()) == {"outcome", "mechanism"}
    refs = {"pre-ln": (0.5, 0.1), "peri-ln": (0.4, 0.1)}
    for cid, kind in kinds.items():
        if kind == "mechanism":
            for references in (refs, None):
                limits = resolve(DEFAULT_THRESHOLDS[cid], references)
                assert limits["fail"] is None and status(1e300, limits) == "warn", (cid, references)


def test_a_fail_threshold_on_a_mechanism_is_refused_in_one_line(tmp_path) -> None:
    """In a --thresholds file and in the package's thresholds.yaml: one line naming the file and the criterion."""
    path = tmp_path / "t.yaml"
    for text, said in (("grad_spread:\n  fail: 2\n", "grad_spread.fail=2 is not allowed"),
                       ("growth_init:\n  absolute: {fail: 1}\n", "growth_init.absolute.fail=1 is not allowed"),
                       ("attention:\n  kind: outcome\n  fail: 1000\n", "attention.kind='outcome' is not allowed")):
        path.write_text(text)
        with pytest.raises(LNStabError, match="^--thresholds ") as info:
            load_thresholds(path)
        message = str(info.value)
        assert f"--thresholds {path}: {said}" in message and "\n" not in message, message
    assert "only outcome criteria fail: divergence, lr_sensitivity, loss" in str(
        pytest.raises(LNStabError, load_thresholds, _write(path, "grad_spread:\n  fail: 2\n")).value)
    path.write_text("grad_spread:\n  kind: mechanism\n  fail: null\n  warn: 0.5\n")  # a card's own thresholds.yaml
    assert load_thresholds(path)["grad_spread"]["warn"] == 0.5
    path.write_text("divergence:\n  fail: 0.1\n")  # an outcome may fail
    assert load_thresholds(path)["divergence"]["fail"] == 0.1
    package = tmp_path / "thresholds.yaml"
    package.write_text(DEFAULT_PATH.read_text().replace("grad_spread:\n  kind: mechanism\n  warn: peri + 2*sd\n"
                                                        "  fail: null", "grad_spread:\n  kind: mechanism\n"
                                                        "  warn: peri + 2*sd\n  fail: max(pre, peri) + 2*sd + 1"))
    assert read_defaults(DEFAULT_PATH) == DEFAULT_THRESHOLDS
    with pytest.raises(LNStabError) as info:
        read_defaults(package)
    assert str(info.value).startswith(f"{package}: grad_spread.fail='max(pre, peri) + 2*sd + 1' is not allowed; "
                                      "grad_spread is a mechanism criterion")
    package.write_text(DEFAULT_PATH.read_text().replace("loss:\n  kind: outcome\n", "loss:\n"))
    with pytest.raises(LNStabError, match=f"^{package}: loss.kind=None is not allowed; use outcome, mechanism$"):
        read_defaults(package)


def _write(path, text: str):
    path.write_text(text)
    return path


def test_lnstab_check_refuses_a_fail_threshold_on_a_mechanism_before_training(tmp_path, capsys) -> None:
    from lnstab.cli import main

    thresholds = _write(tmp_path / "t.yaml", "sensitivity:\n  fail: 0\n")
    out = tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", "--model.preset", "tiny", "--thresholds", str(thresholds), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"lnstab: error: --thresholds {thresholds}: sensitivity.fail=0 is not allowed; "
                          "sensitivity is a mechanism criterion"), err
    assert not out.exists()  # nothing trained


def test_divergence_shows_one_threshold_where_warn_and_fail_are_the_same() -> None:
    """Issue 39: with neither reference diverging, warn (Peri-LN's rate) and fail (both references') were both
    "> 0"; there is no warning band then, and the card shows the fail threshold only."""
    limits = resolve(DEFAULT_THRESHOLDS["divergence"], {"pre-ln": (0.0, 0.0), "peri-ln": (0.0, 0.0)})
    assert limits["warn"] is None and limits["fail"] == 0 and status(1 / 6, limits) == "fail"
    apart = resolve(DEFAULT_THRESHOLDS["divergence"], {"pre-ln": (0.5, 0.0), "peri-ln": (1 / 6, 0.0)})
    assert apart["warn"] == pytest.approx(1 / 6) and apart["fail"] == 0.5 and status(1 / 3, apart) == "warn"
    assert resolve(DEFAULT_THRESHOLDS["divergence"], None)["warn"] == 0  # absolute: warn 0, fail 0.5


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
