"""The learning-rate ladder with the seeds kept apart (lnstab.report.ladder), on constructed run directories."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import yaml
from support.report import make_run, write_scalars

from lnstab.report import collect
from lnstab.report.figures import lr_ladder, palette
from lnstab.report.ladder import designs, ladder_table, mean_interval, welch_interval
from lnstab.report.tables import group

# design -> seed -> {lr: final val loss}; inf: diverged. Initial loss 6.0 (train/loss at step 0) everywhere.
LOSSES = {
    "pre": {0: {1e-3: 4.0, 1e-2: 3.0, 1e-1: 5.0}, 1: {1e-3: 4.2, 1e-2: 3.1, 1e-1: math.inf},
            2: {1e-3: 4.1, 1e-2: 2.9, 1e-1: 5.5}},
    "peri": {0: {1e-3: 3.6, 1e-2: 3.2, 1e-1: 3.3}, 1: {1e-3: 3.5, 1e-2: 3.1, 1e-1: 3.4},
             2: {1e-3: 3.7, 1e-2: 3.3, 1e-1: 3.2}},
}


def ladder_runs(root: Path, losses: dict = LOSSES) -> Path:
    g = root / "runs" / "ladder"
    for placement, seeds in losses.items():
        for seed, curve in seeds.items():
            for lr, loss in curve.items():
                diverged = math.isinf(loss)
                d = make_run(g, f"{placement}_lr{lr:g}_s{seed}", placement, seed,
                             "diverged" if diverged else "completed", val_loss=None if diverged else loss,
                             diverged_step=5 if diverged else None)
                config = yaml.safe_load((d / "config.yaml").read_text())
                config["model"]["learning_rate"] = lr
                (d / "config.yaml").write_text(yaml.safe_dump(config))
                # the largest attention logit grows with the rate under pre only; log Z is 7 + lr
                logit = 10.0 * (lr / 1e-3) ** (1.0 if placement == "pre" else 0.1)
                write_scalars(d, {"attn/max_logit/L00": [(10, logit / 2)], "attn/max_logit/L01": [(10, logit)],
                                  "output/log_z_mean": [(5, 9.0), (10, 7.0 + lr)]}, "2")
    return g


def hand_sensitivity(curve: dict[float, float]) -> float:
    points = [min(v, 6.0) for v in curve.values()]
    return statistics.fmean(p - min(points) for p in points)


def test_each_seed_has_its_own_sensitivity_and_the_interval_is_students(tmp_path) -> None:
    records = collect([ladder_runs(tmp_path)])
    _, _, found = designs(records)
    by = {d.values["model.norm_placement"]: d for d in found}
    for placement in LOSSES:
        expected = [hand_sensitivity(LOSSES[placement][s]) for s in range(3)]
        assert sorted(by[placement].sensitivities()) == pytest.approx(sorted(expected))
    pre = [hand_sensitivity(LOSSES["pre"][s]) for s in range(3)]
    mean, low, high = mean_interval(pre)
    half = 4.302652729911275 * statistics.stdev(pre) / math.sqrt(3)  # t(0.975, 2)
    assert (low, high) == pytest.approx((mean - half, mean + half))
    table = ladder_table(records)
    rows = {r["norm_placement"]: r for r in table.rows}
    assert rows["pre"]["lr_sensitivity"] == pytest.approx(statistics.fmean(pre))
    # the first configuration in the report's order (here by name: no sweep manifest) is the reference
    peri = [hand_sensitivity(LOSSES["peri"][s]) for s in range(3)]
    assert math.isnan(rows["peri"]["diff_vs_first"])  # the reference against itself: no difference measured
    assert [r["− peri (Welch 95 %)"] for r in table.markdown_rows][0] == "–"
    assert (rows["pre"]["diff_vs_first"], rows["pre"]["diff_ci_low"], rows["pre"]["diff_ci_high"]) == pytest.approx(
        welch_interval(pre, peri))
    assert rows["pre"]["diverged"] == 1 and rows["peri"]["diverged"] == 0
    # the diverged seed counts as L_init = 6.0 at 0.1; the mean over seeds is (5.0 + 6.0 + 5.5) / 3
    assert rows["pre"]["loss@0.1"] == pytest.approx(5.5)
    assert (rows["pre"]["best_lr"], rows["pre"]["best_loss"]) == (1e-2, pytest.approx(3.0))
    assert "3.000 [2.90, 3.10]" in table.to_markdown()  # min and max over seeds at 1e-2


def test_a_one_rate_ladder_counts_its_seeds_and_grades_no_sensitivity(tmp_path) -> None:
    """Three seeds at one rate: the table said 0 seeds (it counted the seeds with a sensitivity, which needs two rates)
    beside a loss averaged over three."""
    one_rate = {p: {s: {1e-2: curve[1e-2]} for s, curve in seeds.items()} for p, seeds in LOSSES.items()}
    table = ladder_table(collect([ladder_runs(tmp_path, one_rate)]))
    rows = {r["norm_placement"]: r for r in table.rows}
    assert rows["pre"]["seeds"] == rows["peri"]["seeds"] == 3
    assert rows["pre"]["loss@0.01"] == pytest.approx(3.0) and math.isnan(rows["pre"]["lr_sensitivity"])
    assert {r["seeds"] for r in table.markdown_rows} == {"3"} and {r["per seed"] for r in table.markdown_rows} == {"–"}


def test_welch_interval_against_a_hand_computation() -> None:
    a, b = [1.0, 1.4, 1.2], [0.2, 0.3, 0.25, 0.35]
    diff, low, high = welch_interval(a, b)
    va, vb = statistics.variance(a) / 3, statistics.variance(b) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    from scipy.stats import t

    half = t.ppf(0.975, df) * math.sqrt(va + vb)
    assert diff == pytest.approx(1.2 - 0.275)
    assert (low, high) == pytest.approx((diff - half, diff + half))
    assert math.isnan(welch_interval([1.0], b)[1])


def test_the_figure_draws_loss_logit_and_log_z_per_design_in_its_colour(tmp_path) -> None:
    g = ladder_runs(tmp_path)
    # the diverged seed's last log Z is its blow-up: left out of the log Z panel (read after the first file)
    write_scalars(g / "pre_lr0.1_s1", {"output/log_z_mean": [(11, 5000.0)]}, "3")
    _, configs = group(collect([g]))
    fig = lr_ladder(configs)
    assert fig is not None
    loss_ax, logit_ax, z_ax = fig.axes[:3]
    colours = palette(configs)
    for ax in (loss_ax, logit_ax, z_ax):
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("L_init")}
        assert set(lines) == {"pre", "peri"}
        for label, line in lines.items():
            assert line.get_color() == colours[label]
            assert list(line.get_xdata()) == [1e-3, 1e-2, 1e-1]
    pre = {line.get_label(): line for line in loss_ax.get_lines()}["pre"]
    assert list(pre.get_ydata()) == pytest.approx([4.1, 3.0, 5.5])  # the diverged seed counts as L_init = 6
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba

    (band,) = [c.get_paths()[0].vertices[:, 1] for c in loss_ax.collections
               if isinstance(c, PolyCollection) and tuple(c.get_facecolor()[0][:3]) == to_rgba(
                   colours["pre"])[:3]]
    assert min(band) == pytest.approx(2.9) and max(band) == pytest.approx(6.0)  # best and worst seed
    logit = {line.get_label(): line for line in logit_ax.get_lines()}["pre"]
    assert list(logit.get_ydata()) == pytest.approx([10.0, 100.0, 1000.0])  # the larger layer's, the seeds' mean
    z = {line.get_label(): line for line in z_ax.get_lines()}["peri"]
    assert list(z.get_ydata()) == pytest.approx([7.001, 7.01, 7.1])  # the last log Z, not the first
    z = {line.get_label(): line for line in z_ax.get_lines()}["pre"]
    assert list(z.get_ydata()) == pytest.approx([7.001, 7.01, 7.1])  # not (7.1 + 5000 + 7.1) / 3 at 0.1
    assert logit_ax.get_yscale() == "log"


def test_no_ladder_no_figure(tmp_path) -> None:
    g = tmp_path / "runs" / "flat"
    make_run(g, "pre_s0", "pre", 0, "completed", val_loss=3.0)
    make_run(g, "peri_s0", "peri", 0, "completed", val_loss=3.1)
    records = collect([g])
    assert lr_ladder(group(records)[1]) is None
    assert ladder_table(records).rows == []


def test_a_configuration_whose_options_are_all_off_is_named_by_them_not_all_runs() -> None:
    """Pre-LN beside Pre-LN + QK-norm was labelled "all runs" (every part of its name an option that is off)."""
    from lnstab.report.tables import config_label

    names = {"model.qk_norm": "qk_norm", "model.residual_scale": "residual_scale"}
    assert config_label(names, {"model.qk_norm": False}) == "qk_norm=False"
    assert config_label(names, {"model.qk_norm": True}) == "qk_norm"
    assert config_label(names, {"model.qk_norm": False, "model.residual_scale": 0.1}) == "Δt=0.1"
    assert config_label(names, {}) == "all runs"


def test_pool_joins_runs_that_differ_only_in_where_they_ran(tmp_path, capsys) -> None:
    from lnstab.cli import main

    g = ladder_runs(tmp_path)
    for d in g.glob("pre_*_s2"):  # one seed of pre ran elsewhere (a grid finished on another machine)
        config = yaml.safe_load((d / "config.yaml").read_text())
        config["trainer"]["accelerator"] = "cpu"
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    for d in g.glob("pre_*"):
        if not d.name.endswith("_s2"):
            config = yaml.safe_load((d / "config.yaml").read_text())
            config["trainer"]["accelerator"] = "gpu"
            (d / "config.yaml").write_text(yaml.safe_dump(config))
    split = ladder_table(collect([g]))
    assert len(split.rows) == 3  # pre on gpu, pre on cpu, peri: the accelerator makes a configuration
    main(["report", str(g), "--out", str(tmp_path / "out"), "--pool", "trainer.accelerator"])
    rows = (tmp_path / "out" / "lr_ladder.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header, pre (3 seeds again), peri
    pre = [hand_sensitivity(LOSSES["pre"][s]) for s in range(3)]
    assert f"{statistics.fmean(pre):.4g}" in (tmp_path / "out" / "lr_ladder.md").read_text()
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Pooled over `trainer.accelerator`: cpu (3 runs), gpu (6 runs)." in report
    with pytest.raises(SystemExit) as info:
        main(["report", str(g), "--out", str(tmp_path / "out2"), "--pool", "trainer.acelerator"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "--pool trainer.acelerator: no run's config has this key" in err and "\n" not in err
    assert not (tmp_path / "out2" / "report.md").exists()


def test_pool_says_numbers_in_their_order_and_one_run_as_one() -> None:
    """Pooled val_check_interval 6 and 20 read '20 (2 runs), 6 (4 runs)' (sorted as text), and one run '(1 runs)'."""
    from lnstab.report.cli import pool
    from lnstab.report.collect import RunRecord

    runs = [RunRecord(f"r{i}", Path(f"/r{i}"), "completed", config={"trainer.val_check_interval": v, "x": "b" * i})
            for i, v in enumerate([6, 20, 20, 100, 6])]
    assert pool(runs, ["trainer.val_check_interval", "x"]) == [
        "Pooled over `trainer.val_check_interval`: 6 (2 runs), 20 (2 runs), 100 (1 run).",
        "Pooled over `x`:  (1 run), b (1 run), bb (1 run), bbb (1 run), bbbb (1 run)."]
