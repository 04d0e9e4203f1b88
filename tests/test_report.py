"""``lnstab report``: tables computed from fixture run directories (a diverged, an interrupted and a missing run
among them), figures written, resumed TensorBoard logs, and one-line errors for what is not an lnstab run; damaged
run files (cut short, not JSON or YAML, a number too long) and a corrupt sweep manifest named in one line each and
counted, the healthy runs reported as before; a full disk as one line, exit 1."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from support.hostile import ENOSPC, HUGE, truncate
from support.report import TAGS, make_run, write_scalars

from lnstab.cli import main
from lnstab.report import collect, divergence_table, performance_table, stability_table
from lnstab.report.collect import read_scalars
from lnstab.report.tables import mean_std, runs_table
from lnstab.rundir import write_json


def rows_by_placement(table) -> dict[str, dict]:
    return {row["norm_placement"]: row for row in table.rows}


def test_divergence_table_counts_finished_runs_and_lists_steps(grid) -> None:
    records = collect([grid])
    assert [r.status for r in records if r.name == "peri_s2"] == ["missing"]
    assert [r.name for r in records] == ["pre_s0", "pre_s1", "pre_s2", "peri_s0", "peri_s1", "peri_s2", "none_s0",
                                         "none_s1"]  # the grid's order (from the manifest), not the directory's
    rows = rows_by_placement(divergence_table(records))
    assert set(rows) == {"pre", "peri", "none"}  # seeds are not configurations; the logger is not a difference
    assert (rows["none"]["diverged"], rows["none"]["finished"], rows["none"]["divergence_steps"]) == (1, 2, "17")
    assert (rows["pre"]["runs"], rows["pre"]["finished"], rows["pre"]["unfinished"]) == (3, 2, "1 interrupted")
    assert (rows["peri"]["runs"], rows["peri"]["finished"], rows["peri"]["unfinished"]) == (3, 2, "1 missing")
    markdown = divergence_table(records).to_markdown()
    assert "| none | 1/2 | 17 | 2 | – |" in markdown and "| peri | 0/2 | – | 3 | 1 missing |" in markdown


def test_performance_table_is_mean_and_std_over_completed_runs(grid) -> None:
    rows = rows_by_placement(performance_table(collect([grid])))
    pre, none = rows["pre"], rows["none"]
    assert (pre["n"], pre["runs"]) == (2, 3)  # the interrupted run has no score and counts only in runs
    assert pre["val_loss_mean"] == pytest.approx((3.0 + 3.4) / 2)
    assert pre["val_loss_std"] == pytest.approx(abs(3.4 - 3.0) / math.sqrt(2))
    assert pre["rouge1_mean"] == pytest.approx(0.3) and pre["bertscore_f1_std"] == pytest.approx(0.1 / math.sqrt(2))
    assert pre["eval_loss_mean"] == pytest.approx(3.7)
    assert pre["ppl_exp_mean_loss_mean"] == pytest.approx((math.exp(3.5) + math.exp(3.9)) / 2)
    assert pre["ppl_mean_seq_mean"] == pytest.approx((math.exp(3.5) + math.exp(3.9)) / 2 + 1)
    assert (none["n"], none["val_loss_mean"], none["rouge2_mean"]) == (1, 4.0, 0.2)  # the diverged run left out
    assert math.isnan(none["val_loss_std"]) and rows["peri"]["rougeL_std"] == 0.0
    table = performance_table(collect([grid]))
    assert "| pre | 2/3 | 3.2 ± 0.28 |" in table.to_markdown()
    header, *lines = table.to_csv().splitlines()
    assert header.startswith("norm_placement,n,runs,val_loss_mean,val_loss_std,eval_loss_mean")
    by_name = {line.split(",")[0]: line for line in lines}
    assert by_name["pre"].startswith("pre,2,3,3.2") and by_name["none"].startswith("none,1,2,4.0,,")  # no std: empty


def test_stability_table_from_hidden_series_and_scalars(grid) -> None:
    rows = rows_by_placement(stability_table(collect([grid])))
    pre, peri, none = rows["pre"], rows["peri"], rows["none"]
    last_depth = len(TAGS)  # "final": factor (1 + 5) at step 100 -> (100 + 1) / 101 = 1
    assert pre["ma_last_mean"] == pytest.approx(statistics.fmean([100.0 * last_depth, 300.0 * last_depth,
                                                                   200.0 * last_depth]))
    assert pre["var_entry_last_mean"] == pytest.approx(2 * 200.0 * last_depth)
    assert peri["var_data_last_std"] == pytest.approx(statistics.stdev([0.5 * 2 * 6, 0.5 * 4 * 6]))
    assert none["ma_last_mean"] == pytest.approx((1e5 * 6 + 50.0 * 6) / 2)  # the diverged run: last finite value
    assert none["max_abs_mean"] == pytest.approx((10 * 1e5 * 6 + 10 * 50 * 6) / 2)
    assert (none["over_fp16"], pre["over_fp16"], peri["over_fp16"]) == (1, 0, 0)
    assert peri["thm4_slack_min_mean"] == pytest.approx((1.5 + 0.5) / 2) and peri["thm4_violations_mean"] == 0
    assert math.isnan(pre["thm4_slack_min_mean"])  # no bound for Pre-LN
    assert pre["growth_exp_rate_mean"] == pytest.approx(0.3) and pre["growth_exp_r2_mean"] == pytest.approx(0.9)
    assert pre["jacobian_scale_slope_mean"] == pytest.approx(0.5)
    assert peri["jacobian_scale_slope_mean"] == pytest.approx(-1.0)
    assert peri["jacobian_sensitivity_max_mean"] == pytest.approx(3 * 8.0**-1)  # max over layers at the last probe
    assert (pre["n"], peri["n"]) == (3, 2)  # every run with data, missing ones not


def test_report_command_writes_tables_and_figures(grid, tmp_path, capsys) -> None:
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])
    assert "lnstab report: 8 runs -> " in capsys.readouterr().out  # the missing run counts too
    for name in ("depth_profile.png", "last_layer_steps.png", "jacobian_scale.png", "theorem4_bound.png",
                 "loss_curves.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    report = (out / "report.md").read_text()
    assert "8 runs in 3 configuration(s): 5 completed, 1 diverged, 1 interrupted, 1 missing." in report
    for name in ("divergence", "performance", "stability", "runs"):
        assert (out / f"{name}.csv").read_text() and (out / f"{name}.md").read_text() in report
    with pytest.raises(SystemExit) as info:  # nothing is overwritten
        main(["report", str(grid), "--out", str(out)])
    assert info.value.code == 2 and "already holds a report (report.md)" in capsys.readouterr().err
    main(["report", str(grid / "pre_s0"), str(grid / "peri_s0"), "--out", str(out), "--overwrite"])
    assert "2 runs in 2 configuration(s)" in (out / "report.md").read_text()
    blocker = tmp_path / "a-file"
    blocker.write_text("kept\n")
    for bad in (blocker, blocker / "report"):  # a file in the way: one line, before any run is read
        with pytest.raises(SystemExit) as info:
            main(["report", str(grid), "--out", str(bad)])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and f"{blocker} is a file, not a directory" in err and "\n" not in err, err
    assert blocker.read_text() == "kept\n"


def test_resumed_tensorboard_logs_keep_the_latest_value_per_step(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_scalars(run, {"train/loss": [(0, 5.0), (1, 4.0), (2, 3.0), (3, 99.0)]}, "1")
    write_scalars(run, {"train/loss": [(2, 2.5), (3, 2.0), (4, 1.5)]}, "2")  # resumed from the step-2 checkpoint
    assert read_scalars(run)["train/loss"] == [(0, 5.0), (1, 4.0), (2, 2.5), (3, 2.0), (4, 1.5)]


def test_what_is_not_an_lnstab_run_is_one_line(grid, tmp_path, capsys) -> None:
    (grid / "notes").mkdir()
    (grid / "notes" / "todo.txt").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    for paths, expected in (([grid], f"{grid / 'notes'} is not an lnstab run directory"),
                            ([empty], f"{empty} is not an lnstab run directory, nor a directory of runs"),
                            ([tmp_path / "absent"], "is not a directory")):
        with pytest.raises(SystemExit) as info:
            main(["report", *map(str, paths), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and expected in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_mean_std_conventions() -> None:
    assert mean_std([2.0, 4.0]) == (3.0, math.sqrt(2.0))
    assert math.isnan(mean_std([1.0])[1]) and all(math.isnan(v) for v in mean_std([]))


def test_keys_that_vary_together_name_a_configuration_once(grid) -> None:
    from lnstab.report.tables import varying_keys

    records = collect([grid])
    for r in records:  # a grid that sets a callback list together with the placement, and the data seed per seed
        r.config["trainer.callbacks"] = [{"class_path": "X", "placement": r.config["model.norm_placement"]}]
        r.config["data.init_args.seed"] = r.config.get("seed_everything")
        r.config["trainer.max_steps"] = 100 if r.config["model.norm_placement"] == "pre" else 200
    assert varying_keys(records) == ["model.norm_placement", "trainer.max_steps"]  # scalars are always shown


def test_how_often_a_run_was_measured_is_not_part_of_its_configuration(grid) -> None:
    """Runs that differ only in instrument and checkpoint cadence (the mini grid probes the Jacobian at one learning
    rate only) are one configuration; a missing run takes its own overrides, not a sibling's cadence."""
    from lnstab.report.tables import varying_keys

    manifest = json.loads((grid / ".sweep" / "manifest.json").read_text())
    for run in manifest["runs"]:
        if run["name"].startswith("pre"):
            run["overrides"]["instruments.jacobian_every_n_steps"] = 150
    write_json(grid / ".sweep" / "manifest.json", manifest)
    for name in ("pre_s0", "pre_s1", "pre_s2"):
        path = grid / name / "config.yaml"
        config = yaml.safe_load(path.read_text())
        config["instruments"] = {"jacobian_every_n_steps": 150, "jacobian_n_iter": 8}
        config["checkpoint"] = {"every_n_train_steps": 10}
        path.write_text(yaml.safe_dump(config))
    records = collect([grid])
    assert varying_keys(records) == ["model.norm_placement"]
    missing = {r.name: r for r in records if r.status == "missing"}
    assert set(missing) == {"peri_s2"} and not any(k.startswith("instruments.") for k in missing["peri_s2"].config)


def add_events(run: Path, events: list[dict]) -> None:
    (run / "divergence_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_divergence_table_shows_attention_collapse_and_logit_drift(grid) -> None:
    add_events(grid / "pre_s0", [{"step": 300, "kind": "attention_collapse", "value": 0.7, "layer": "L01",
                                  "stat": "collapsed"},
                                 {"step": 100, "kind": "attention_collapse", "value": 0.6, "layer": "L00",
                                  "stat": "collapsed"},
                                 {"step": 200, "kind": "logit_drift", "value": -31.0, "layer": "output",
                                  "stat": "log_z_mean"}])
    add_events(grid / "pre_s1", [{"step": 50, "kind": "attention_collapse", "value": 2e3, "layer": "L01",
                                  "stat": "max_logit"}])
    add_events(grid / "pre_s2", [{"step": 10, "kind": "logit_drift", "value": 40.0, "layer": "output"}])  # unfinished
    table = divergence_table(collect([grid]))
    rows = rows_by_placement(table)
    pre, peri = rows["pre"], rows["peri"]
    assert (pre["attention_collapse"], pre["attention_collapse_steps"]) == (2, "50 100")  # first step of each run
    assert (pre["logit_drift"], pre["logit_drift_steps"]) == (1, "200")  # the interrupted run is not counted
    assert (peri["attention_collapse"], peri["logit_drift"]) == (0, 0)
    markdown = table.to_markdown()
    assert "| attention collapse | logit drift |" in markdown.splitlines()[0] + "|"
    assert "| pre | 0/2 | – | 3 | 1 interrupted | 2/2 (from 50, 100) | 1/2 (from 200) |" in markdown
    assert table.to_csv().splitlines()[0].endswith("attention_collapse,attention_collapse_steps,logit_drift,"
                                                   "logit_drift_steps")


def ladder_grid(root: Path) -> Path:
    """Two configurations over a learning-rate ladder; initial loss 6.0 (train/loss at step 0) everywhere."""
    g = root / "runs" / "ladder"
    runs = [("pre", 1e-3, 0, "completed", 4.0), ("pre", 1e-3, 1, "completed", 4.4), ("pre", 1e-2, 0, "completed", 3.0),
            ("pre", 1e-1, 0, "diverged", 9.0), ("peri", 1e-3, 0, "completed", 3.5),
            ("peri", 1e-2, 0, "completed", 3.2), ("peri", 1e-2, 1, "interrupted", 2.0),
            ("peri", 1e-1, 0, "completed", 3.3), ("peri", 3e-1, 0, "completed", None)]
    for placement, lr, seed, status, val in runs:
        name = f"{placement}_lr{lr:g}_s{seed}"
        d = make_run(g, name, placement, seed, status, val_loss=val, diverged_step=5 if status == "diverged" else None)
        config = yaml.safe_load((d / "config.yaml").read_text())
        config["model"]["learning_rate"] = lr
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    return g


def test_lr_sensitivity_on_constructed_curves(tmp_path) -> None:
    from lnstab.report.lr_sensitivity import lr_sensitivity_table

    table = lr_sensitivity_table(collect([ladder_grid(tmp_path)]))
    rows = rows_by_placement(table)
    pre, peri = rows["pre"], rows["peri"]
    # pre: L(1e-3) = (4.0 + 4.4)/2 = 4.2, L(1e-2) = 3.0, L(1e-1) = min(inf, 6.0) = 6.0 (diverged); L* = 3.0
    assert pre["lr_sensitivity"] == pytest.approx((1.2 + 0.0 + 3.0) / 3)
    assert (pre["best_lr"], pre["best_loss"], pre["initial_loss"]) == (1e-2, 3.0, 6.0)
    assert (pre["ladder"], pre["runs"], pre["diverged"]) == ("0.001 0.01 0.1", 4, 1)
    # peri: 3.5, 3.2 (the interrupted run does not count), 3.3, and 4.0 at 3e-1 (no val loss: last train loss)
    assert peri["lr_sensitivity"] == pytest.approx((0.3 + 0.0 + 0.1 + 0.8) / 4)
    assert (peri["best_lr"], peri["runs"], peri["all_runs"]) == (1e-2, 4, 5)
    assert set(table.columns) >= {"norm_placement", "lr_sensitivity"} and "learning_rate" not in table.columns
    assert "| pre | 1.4 | 0.01 | 3 | 6 | 0.001, 0.01, 0.1 | 4/4 | 1 |" in table.to_markdown()


def test_the_initial_loss_is_that_of_step_0_else_ln_v_not_a_loss_after_training() -> None:
    from lnstab.report.lr_sensitivity import initial_loss

    class Run:  # what initial_loss reads of a RunRecord
        def __init__(self, losses, vocab) -> None:
            self.losses, self.config = losses, {"model.vocab_size": vocab} if vocab else {}

        def series(self, tag):
            return self.losses

    assert initial_loss(Run([(0, 6.2), (9, 5.0)], 64)) == 6.2
    # first logged at step 9 (log_every_n_steps 10): it has trained at the run's own rate already
    assert initial_loss(Run([(9, 5.0), (19, 4.0)], 64)) == pytest.approx(math.log(64))
    assert initial_loss(Run([(9, 5.0)], None)) == 5.0


def test_report_draws_logit_figures_and_the_lr_sensitivity(tmp_path, capsys) -> None:
    g = ladder_grid(tmp_path)
    for i, run in enumerate(sorted(p for p in g.iterdir() if p.is_dir())):
        write_scalars(run, {"attn/max_logit/L00": [(0, 1.0), (50, 5.0 + i)], "attn/max_logit/L01": [(0, 2.0),
                                                                                                 (50, 40.0 + i)],
                            "output/log_z_mean": [(0, 4.6), (50, 3.0 - i)]}, "2")
    from lnstab.report.collect import read_run
    from lnstab.report.figures import max_over_layers

    assert max_over_layers(read_run(sorted(g.iterdir())[0]), "attn/max_logit") == [(0, 2.0), (50, 40.0)]
    out = tmp_path / "report"
    main(["report", str(g), "--out", str(out)])
    capsys.readouterr()
    for name in ("attention_max_logit.png", "log_z.png", "lr_sensitivity.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    report = (out / "report.md").read_text()
    assert "LR sensitivity (Wortsman et al. 2023)" in report and (out / "lr_sensitivity.csv").read_text()
    assert "![final loss against learning rate, one line per configuration](lr_sensitivity.png)" in report


def test_logit_table_takes_extremes_over_layers_and_steps_then_means_over_seeds(tmp_path) -> None:
    from lnstab.report.logits import logit_table

    g = ladder_grid(tmp_path)
    runs = {p.name: p for p in g.iterdir() if p.is_dir()}
    write_scalars(runs["pre_lr0.001_s0"], {"attn/max_logit/L00": [(0, 1.0), (50, 30.0)],
                                           "attn/max_logit/L01": [(0, 2.0), (50, 10.0), (100, float("nan"))],
                                           "attn/entropy_min/L00": [(0, 0.6), (50, 0.2)],
                                           "attn/collapsed/L01": [(0, 0.0), (50, 0.25)],
                                           "output/log_z_mean": [(0, 6.9), (50, 5.0)],
                                           "output/max_logit": [(0, 1.0), (50, 4.0)]}, "a")
    write_scalars(runs["pre_lr0.001_s1"], {"attn/max_logit/L00": [(0, 1.0), (50, 50.0)],
                                           "output/log_z_mean": [(0, 6.9), (50, 7.0)]}, "a")
    rows = [r for r in logit_table(collect([g])).rows if r["norm_placement"] == "pre" and r["learning_rate"] == "0.001"]
    (row,) = rows
    assert row["n"] == 2 and row["attn_max_logit_mean"] == pytest.approx(40.0)  # 30 and 50: NaN steps left out
    assert row["attn_entropy_min_mean"] == pytest.approx(0.2) and row["attn_collapsed_mean"] == pytest.approx(0.25)
    assert row["log_z_last_mean"] == pytest.approx(6.0) and row["output_max_logit_mean"] == pytest.approx(4.0)


DAMAGE = {  # run -> (file, how, what the line says)
    "pre_s0": ("summary.json", "truncate", "summary.json is damaged: not valid JSON at line"),
    "pre_s1": ("eval.json", "truncate", "eval.json is damaged: not valid JSON"),
    "peri_s0": ("hidden_stats.json", "truncate", "hidden_stats.json is damaged: not valid JSON"),
    "peri_s1": ("divergence_events.jsonl", "half-line", "divergence_events.jsonl is damaged: line 2 is not valid JSON"),
    "none_s1": ("config.yaml", "not-yaml", "config.yaml is damaged: not valid YAML at line 2"),
}


def damage(run: Path, name: str, how: str) -> None:
    path = run / name
    if how == "truncate":
        truncate(path)
    elif how == "half-line":
        path.write_text('{"step": 3, "kind": "loss_spike", "value": 9.5}\n{"step": 4, "kind": "nonfin')
    else:
        path.write_text("model: [unclosed\n")


def test_damaged_run_files_are_named_counted_and_the_rest_reported(grid, tmp_path, capsys) -> None:
    for run, (name, how, _) in DAMAGE.items():
        damage(grid / run, name, how)
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == len(DAMAGE), captured.err
    for run, (_, _, said) in DAMAGE.items():
        assert any(said in line and f"{run} is counted as a damaged run" in line for line in lines), (run, lines)
    report = (out / "report.md").read_text()
    assert "8 runs in 3 configuration(s): 5 damaged, 1 diverged, 1 interrupted, 1 missing." in report
    assert all(f"- `{run}`: " in report for run in DAMAGE)
    records = collect([grid], warn=lambda line: None)
    assert {r.name for r in records if r.status == "damaged"} == set(DAMAGE)
    divergence = {row["norm_placement"]: row for row in divergence_table(records).rows}
    assert divergence["none"]["runs"] == 2 and divergence["none"]["diverged"] == 1  # none_s1 counted in its config
    assert divergence["pre"]["unfinished"] == "2 damaged, 1 interrupted"
    performance = {row["norm_placement"]: row for row in performance_table(records).rows}
    assert performance["pre"]["n"] == 0 and performance["pre"]["runs"] == 3  # no data used, still counted
    assert {row["run"]: row["status"] for row in runs_table(records).rows}["peri_s1"] == "damaged"


def test_a_corrupt_manifest_is_one_line_and_the_runs_are_still_reported(grid, tmp_path, capsys) -> None:
    manifest = grid / ".sweep" / "manifest.json"
    truncate(manifest)
    main(["report", str(grid), "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{manifest} is damaged: not valid JSON" in err and "left out" in err
    assert "7 runs in 3 configuration(s)" in (tmp_path / "report" / "report.md").read_text()  # no missing run now


def test_lnstab_report_counts_a_run_with_a_number_too_long_as_damaged(grid, tmp_path, capsys) -> None:
    summary = grid / "pre_s0" / "summary.json"
    summary.write_text(summary.read_text().replace('"final_step": 100', f'"final_step": {HUGE}'))
    events = grid / "peri_s1" / "divergence_events.jsonl"
    events.write_text(f'{{"step": {HUGE}, "kind": "loss_spike"}}\n')
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])  # before: ValueError, no report
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert any(f"{summary} is damaged: holds a number of 5001 characters" in line and "pre_s0 is counted as a "
               "damaged run" in line for line in lines), lines
    assert any(f"{events} is damaged: line 1 holds a number of 5001 characters" in line for line in lines), lines
    assert "8 runs in 3 configuration(s): 3 completed, 2 damaged, 1 diverged," in (out / "report.md").read_text()


# run -> (file, what it is made to hold, what the line says). Before: read silently, as a configuration of None (or
# of ["pre"]) whose data was used, a status shown as unknown, a run at step abc, an evaluation without scores.
WRONG_KIND = {
    "pre_s0": ("config.yaml", "model: 5\ntrainer: [1]\n", "config.yaml is damaged: 'model' holds 5, not a config "
                                                           "section (a mapping)"),
    "pre_s1": ("config.yaml", "model: {norm_placement: [pre], residual_scale: 1.0}\n",
               "config.yaml is damaged: 'model.norm_placement' holds [\"pre\"], not a string"),
    "pre_s2": ("config.yaml", "model: {norm_placement: pre, residual_scale: abc}\n",
               "config.yaml is damaged: 'model.residual_scale' holds \"abc\", not a number"),
    "peri_s0": ("summary.json", {"status": 5}, "summary.json is damaged: 'status' holds 5, not a run status"),
    "peri_s1": ("summary.json", {"final_step": "abc"}, "summary.json is damaged: 'final_step' holds \"abc\", not a "
                                                       "step"),
    "none_s1": ("eval.json", {"metrics": "nope"}, "eval.json is damaged: 'metrics' holds a JSON str, not an object"),
}


def test_run_files_holding_values_of_a_kind_lnstab_never_writes_are_damaged_runs(grid, tmp_path, capsys) -> None:
    for run, (name, content, _) in WRONG_KIND.items():
        path = grid / run / name
        if isinstance(content, str):
            path.write_text(content)
        else:
            write_json(path, {**json.loads(path.read_text()), **content})
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len(WRONG_KIND), lines
    for run, (name, _, said) in WRONG_KIND.items():
        assert any(f"{grid / run / name}" in line and said in line and f"{run} is counted as a damaged run" in line
                   for line in lines), (run, lines)
    assert "8 runs in 3 configuration(s): 6 damaged, 1 diverged, 1 missing." in (out / "report.md").read_text()
    records = collect([grid], warn=lambda line: None)
    assert {r.name for r in records if r.status == "damaged"} == set(WRONG_KIND)
    performance = {row["norm_placement"]: row for row in performance_table(records).rows}
    assert set(performance) == {"pre", "peri", "none"}  # no phantom configuration of None or ["pre"]
    assert performance["pre"]["n"] == 0 and performance["pre"]["runs"] == 3


def event_file(run: Path) -> Path:
    (path,) = run.glob("events.out.tfevents.*")
    return path


@pytest.mark.parametrize(("how", "said"), [
    ("truncate", "it ends inside its record at byte"),
    ("empty", "it is empty, not a TensorBoard event file"),
    ("random", "the record at byte 0 fails its length checksum: not a TensorBoard event file"),
])
def test_a_damaged_event_file_makes_its_run_damaged(grid, tmp_path, capsys, how, said) -> None:
    path = event_file(grid / "none_s1")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-7], "empty": b"", "random": bytes(range(256)) * 3}[how])
    out = tmp_path / "report"
    main(["report", str(grid), "--out", str(out)])  # before: silent, the run's scalars cut short or none at all
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{path} is damaged: {said}" in lines[0], lines
    assert "none_s1 is counted as a damaged run" in lines[0]
    records = {r.name: r for r in collect([grid], warn=lambda line: None)}
    assert records["none_s1"].status == "damaged" and records["none_s1"].scalars() == {}
    assert all(r.status != "damaged" for name, r in records.items() if name != "none_s1")


def test_a_live_runs_event_file_may_end_inside_a_record(grid) -> None:
    """A running run's newest event file is being written: empty at first, and a flush may end inside a record."""
    run = grid / "peri_s1"
    write_json(run / "summary.json", {**json.loads((run / "summary.json").read_text()), "status": "running"})
    path = event_file(run)
    whole = read_scalars(run)
    path.write_bytes(path.read_bytes()[:-7])
    (record,) = collect([run])
    assert record.status == "running" and record.problem is None
    assert record.scalars()["train/loss"] == whole["train/loss"][:len(record.scalars()["train/loss"])]
    write_json(run / "summary.json", {**json.loads((run / "summary.json").read_text()), "status": "completed"})
    assert [r.status for r in collect([run], warn=lambda line: None)] == ["damaged"]  # finished: cut short


@pytest.mark.system
def test_lnstab_report_on_a_full_disk_is_one_line_and_exit_1(grid, full_disk, capsys) -> None:
    out = full_disk / "report"
    with pytest.raises(SystemExit) as info:
        main(["report", str(grid), "--out", str(out)])  # before: an OSError traceback
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1 and "\n" not in err, err
    assert err.startswith(f"lnstab: error: {out}/") and err.endswith(ENOSPC), err
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())  # no partial file left


def test_a_run_given_before_its_grid_is_counted_once_and_not_as_missing(grid) -> None:
    """`lnstab report G/pre_s0 G`: pre_s0 was left out of G's batch as seen, then counted again as a planned run
    with no directory ('5 runs … 1 missing' for 4 runs)."""
    alone = collect([grid])
    both = collect([grid / "pre_s0", grid])
    assert sorted(r.name for r in both) == sorted(r.name for r in alone)  # each once
    assert [r.name for r in both if r.status == "missing"] == ["peri_s2"]  # the one planned run never started


def test_the_report_takes_each_runs_own_final_evaluation_not_a_later_one(grid) -> None:
    """A later `lnstab evaluate` (eval-1.json, on other data, say) was averaged into the table as the run's result."""
    later = {"schema": 1, "stage": "evaluate", "metrics": {"loss": 99.0, "rouge1": 0.0}}
    write_json(grid / "pre_s0" / "eval-1.json", later)
    write_json(grid / "pre_s2" / "eval.json", {**later, "metrics": {"loss": 7.0}})  # its fit never evaluated
    runs = {r.name: r for r in collect([grid])}
    assert runs["pre_s0"].metrics["eval_loss"] == 3.5 and runs["pre_s0"].metrics["rouge1"] == 0.25  # eval.json's
    assert runs["pre_s2"].metrics["eval_loss"] == 7.0  # no evaluation of its fit: the newest there is


def test_out_inside_a_directory_of_runs_is_refused_and_overwrite_leaves_no_stale_figure(grid, tmp_path,
                                                                                        capsys) -> None:
    """--out G/report was accepted, and every later report of G then failed on G/report as a stranger; a report
    --overwrite of runs without Theorem 4 data left the earlier report's theorem4_bound.png beside it."""
    with pytest.raises(SystemExit) as info:
        main(["report", str(grid), "--out", str(grid / "report")])
    assert info.value.code == 2 and "is not allowed inside" in capsys.readouterr().err
    assert not (grid / "report").exists()
    out = tmp_path / "out"
    main(["report", str(grid), "--out", str(out)])
    assert (out / "theorem4_bound.png").is_file()
    main(["report", str(grid / "pre_s0"), "--out", str(out), "--overwrite"])  # Pre-LN: no output norms
    assert not (out / "theorem4_bound.png").exists()
    assert "Theorem 4" in (out / "report.md").read_text()


def test_a_column_over_fewer_runs_than_its_rows_n_says_its_own_count(grid) -> None:
    """n counts the runs with any of the table's metrics; a run without hidden_stats.json still has its growth and
    Jacobian scalars, so its row said n 2/2 beside a last-layer MA of one run."""
    (grid / "peri_s0" / "hidden_stats.json").unlink()
    table = stability_table(collect([grid]))
    peri = next(i for i, row in enumerate(table.rows) if row.get("norm_placement") == "peri")
    row, md = table.rows[peri], table.markdown_rows[peri]
    assert row["n"] == 2 and row["ma_last_n"] == 1 and md["n"] == "2/3"
    assert md["ma_last"].endswith(" (n=1)") and "(n=" not in md["jacobian_scale_slope"]
    assert "ma_last_n" in table.columns and "jacobian_scale_slope_n" not in table.columns  # only where a count differs
    full = stability_table(collect([grid / "pre_s0", grid / "pre_s1"]))
    assert not any(c.endswith("_n") for c in full.columns) and "(n=" not in full.to_markdown()


@pytest.mark.system
def test_a_run_killed_while_running_is_reported_killed_not_running(tmp_path) -> None:
    """SIGKILL (or the OOM killer) leaves summary.json at 'running'; the report showed it as training. Its lock,
    held while it lives and never released by a kill, tells the two apart on this host."""
    import subprocess
    import sys

    run = make_run(tmp_path / "g", "pre_s0", "pre", 0, "running", val_loss=3.0)
    holder = subprocess.Popen([sys.executable, "-c", "import time; from lnstab import runlock; "
                               f"runlock.hold({str(run)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert [r.status for r in collect([run])] == ["running"]  # live
    finally:
        holder.kill()
        holder.wait()
    assert [r.status for r in collect([run])] == ["killed"]
    (run / ".lnstab.lock").write_text("")  # a holder that exited by itself empties its record: not judged
    assert [r.status for r in collect([run])] == ["running"]
