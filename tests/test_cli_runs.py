"""Runs through the CLI: where they live, how they resume (past a damaged summary too), what their saved config
reruns, and what is refused (among it a run directory behind a broken link, or one whose summary is damaged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support.hostile import HUGE
from support.runs import fit, one_line_error, tiny_config, weights

from lnstab import runlock
from lnstab.cli import cli_main, main
from lnstab.datamodules.sample import sample_path
from lnstab.rundir import latest_eval, read_summary


def test_runs_are_named_after_the_experiment_and_resume_with_last_exactly(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    fit("--config", str(cfg), "--trainer.max_steps", "6", "--run_dir", str(tmp_path / "full"))
    fit("--config", str(cfg))  # 4 steps into runs/tiny/version_0
    run = tmp_path / "runs" / "tiny" / "version_0"
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 4
    fit("--config", str(cfg), "--trainer.max_steps", "6", "--ckpt_path", "last")  # continues version_0
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir()) == ["version_0"]
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["final_step"] == 6
    resumed, full = weights(run / "checkpoints" / "last.ckpt"), weights(tmp_path / "full" / "checkpoints" / "last.ckpt")
    for key, value in full.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
    assert (run / "config-fit-1.yaml").is_file()  # the resumed leg's config (max_steps 6); config.yaml kept


def test_saved_config_is_resolved_and_reruns_as_a_new_run(tmp_path) -> None:
    tiny_config(tmp_path, name="base")
    child = tmp_path / "exp" / "child.yaml"
    child.parent.mkdir()
    child.write_text(yaml.safe_dump({"extends": "../base.yaml", "model": {"norm_placement": "peri"}}))
    fit("--config", str(child), "--trainer.max_steps", "2")
    saved_path = tmp_path / "runs" / "child" / "version_0" / "config.yaml"
    saved = yaml.safe_load(saved_path.read_text())
    assert "extends" not in saved and "run_dir" not in saved and "ckpt_path" not in saved
    assert saved["trainer"]["logger"]["init_args"]["name"] == "child" and saved["model"]["norm_placement"] == "peri"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copy = elsewhere / "config.yaml"
    copy.write_text(saved_path.read_text())  # no base.yaml beside it: it must not need one
    fit("--config", str(copy))
    assert read_summary(tmp_path / "runs" / "child" / "version_1")["status"] == "completed"


def test_print_config_has_no_extends_and_the_experiment_name(tmp_path, capsys) -> None:
    base = tiny_config(tmp_path, name="base")
    (tmp_path / "exp.yaml").write_text("extends: base.yaml\n")
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(tmp_path / "exp.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert "extends" not in printed and printed["trainer"]["logger"]["init_args"]["name"] == "exp"
    assert base.exists()
    with pytest.raises(SystemExit):  # -c, as fit --help offers it (it skipped extends: 'data=… choose one of: null')
        cli_main(["fit", "-c", str(tmp_path / "exp.yaml"), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out) == printed


def test_resume_refusals_are_one_line_and_write_nothing(tmp_path, capsys) -> None:
    cfg = tiny_config(tmp_path)
    runs = tmp_path / "runs"
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--ckpt_path", "last")
    assert "--ckpt_path last: no complete checkpoint under" in err and "tiny/*/checkpoints" in err
    assert not runs.exists()
    fit("--config", str(cfg), "--trainer.max_steps", "2", "--run_dir", str(tmp_path / "r"))
    before = sorted(p.name for p in (tmp_path / "r").rglob("*"))
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(tmp_path / "r"))
    assert "already holds a run (status completed)" in err and "--ckpt_path last" in err
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(tmp_path / "r"), "--ckpt_path", "last",
                         "--model.n_layer", "3")
    assert "--model.n_layer 3 contradicts the checkpoint's n_layer=2" in err
    assert sorted(p.name for p in (tmp_path / "r").rglob("*")) == before
    (tmp_path / "trunc.ckpt").write_bytes((tmp_path / "r" / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--ckpt_path", str(tmp_path / "trunc.ckpt"))
    assert "is not a readable checkpoint (truncated" in err
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--ckpt_path", str(tmp_path / "missing.ckpt"))
    assert "missing.ckpt does not exist" in err


def test_ckpt_path_last_skips_a_truncated_newest_file(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    run = tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run))
    good = run / "checkpoints" / "last.ckpt"
    (run / "checkpoints" / "epoch=0-step=6.ckpt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", "6")
    assert read_summary(run)["final_step"] == 6  # resumed from step 4's last.ckpt, not the truncated file


@pytest.mark.system
def test_a_resume_past_a_summary_with_a_number_too_long_keeps_it_and_trains_on(tmp_path) -> None:
    """``--ckpt_path last`` with such a summary: a damaged summary, which the resume sets aside byte for byte and
    repairs (as it does a truncated one), instead of a ValueError after a new event file was written."""
    cfg, run = tiny_config(tmp_path), tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lnstab.cli", "fit", "--config", str(cfg), "--run_dir", str(run)]
    done = subprocess.run([*command, "--trainer.max_steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = run / "summary.json"
    damaged = summary.read_text().replace('"final_step": 2', f'"final_step": {HUGE}')
    summary.write_text(damaged)
    done = subprocess.run([*command, "--ckpt_path", "last"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (run / "summary.damaged-1.json").read_text() == damaged  # nothing lost
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 4


def test_a_fit_its_data_refuses_leaves_the_run_dir_as_it_was(tmp_path, capsys) -> None:
    """The data module refuses a fit before any callback's setup (here a vocab_size that is not the relabelled
    vocabulary's): a fresh run directory gets no summary, so the corrected command runs there; a refused resume keeps
    the run's divergence events (the monitor wrote 0 over them before)."""
    data = {"source": "files", "path": str(sample_path()), "val_split": "documents", "val_documents": 25,
            "vocab": "top_k", "vocab_top_k": 127, "batch_size": 4, "num_workers": 0, "val_tokens": 256}
    cfg = tiny_config(tmp_path, data={"class_path": "lnstab.datamodules.OpenWebTextDataModule", "init_args": data})
    run = tmp_path / "run"
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run), "--model.vocab_size", "256")
    assert "model.vocab_size=256 is not allowed with --data.vocab top_k" in err and "--model.vocab_size 128" in err
    assert not (run / "summary.json").exists()
    fit("--config", str(cfg), "--run_dir", str(run), "--model.vocab_size", "128",
        "--instruments.divergence_policy", "continue", "--instruments.grad_norm_threshold", "1e-9")  # 4 events
    before = (run / "summary.json").read_bytes()
    assert read_summary(run)["status"] == "completed" and read_summary(run)["divergence_events"] == 4
    err = one_line_error(capsys, "fit", "--config", str(run / "config.yaml"), "--run_dir", str(run), "--ckpt_path",
                         "last", "--data.vocab_top_k", "63", "--trainer.max_steps", "6")
    assert "model.vocab_size=128 is not allowed with --data.vocab top_k" in err
    assert (run / "summary.json").read_bytes() == before


def test_a_fit_refused_before_it_began_leaves_no_run_directory(tmp_path, capsys) -> None:
    """A fit its data refuses (here a --data.path that does not exist, after the logger made its event file) removes
    the run directory it created: a version number is not taken and ``lnstab report`` over the experiment does not
    refuse a directory that is not a run. A directory that was there before is left as it was."""
    cfg = tiny_config(tmp_path, **{"model.vocab_size": 50257, "model.pad_vocab_multiple": 64})  # GPT-2's ids
    missing = ["--data.source", "files", "--data.path", str(tmp_path / "nowhere.txt")]
    err = one_line_error(capsys, "fit", "--config", str(cfg), *missing)
    assert "--data.path" in err and not (tmp_path / "runs").exists()  # nor runs/tiny, which it made on the way
    one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(tmp_path / "fresh" / "a"), *missing)
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    one_line_error(capsys, "fit", "--config", str(cfg), *missing)
    assert (tmp_path / "runs" / "tiny").is_dir() and not any((tmp_path / "runs" / "tiny").iterdir())
    (tmp_path / "mine").mkdir()
    one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(tmp_path / "mine"), *missing)
    assert (tmp_path / "mine").is_dir()
    fit("--config", str(cfg))
    assert read_summary(tmp_path / "runs" / "tiny" / "version_0")["status"] == "completed"
    main(["report", str(tmp_path / "runs" / "tiny"), "--out", str(tmp_path / "report")])
    assert "1 run in 1 configuration(s): 1 completed." in (tmp_path / "report" / "report.md").read_text()


def test_auto_starts_fresh_when_there_is_nothing_to_resume(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    fit("--config", str(cfg), "--run_dir", str(tmp_path / "a"), "--ckpt_path", "auto", "--trainer.max_steps", "2")
    assert read_summary(tmp_path / "a")["final_step"] == 2
    fit("--config", str(cfg), "--run_dir", str(tmp_path / "a"), "--ckpt_path", "auto")
    assert read_summary(tmp_path / "a")["final_step"] == 4


def test_validate_and_evaluate_use_the_run_and_its_data(tmp_path, caplog) -> None:
    """``validate|evaluate --ckpt_path`` without --config: the run's config and data; the checkpoint's step."""
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 300}) + "\n" for i in range(40)))
    cfg = tiny_config(tmp_path, **{"model.vocab_size": 50257, "model.pad_vocab_multiple": 64})
    run = tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run), "--data.source", "files", "--data.path", str(text),
        "--data.val_tokens", "512")
    ckpt = run / "checkpoints" / "last.ckpt"
    cli_main(["validate", "--ckpt_path", str(ckpt)])
    assert read_summary(run)["val"]["step"] == 4
    assert f"data of the checkpoint's run ({run / 'config.yaml'})" in caplog.text and "source=files" in caplog.text
    caplog.clear()
    main(["evaluate", "--config", str(tiny_config(tmp_path, name="other")), "--ckpt_path", str(ckpt)])
    record = json.loads((run / "eval-1.json").read_text())
    assert record["stage"] == "evaluate" and record["global_step"] == 4
    assert "source=files" in caplog.text  # the run's data, not the other config's synthetic stream
    caplog.clear()
    # a source that reads no path replaces the run's files: "--data.path docs.jsonl is not used with --data.source
    # synthetic" named a path the user never typed (it came from the run's config.yaml)
    cli_main(["validate", "--ckpt_path", str(ckpt), "--data.source", "synthetic", "--data.val_tokens", "4096"])
    assert "source=synthetic" in caplog.text and read_summary(run)["val"]["step"] == 4
    saved = yaml.safe_load((run / "config-validate-2.yaml").read_text())["data"]["init_args"]
    assert saved["source"] == "synthetic" and saved["path"] is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.max_steps", "-5"], "trainer.max_steps=-5 is not allowed; it must be an integer >= 1, or -1"),
        (["--trainer.max_steps", "0"], "trainer.max_steps=0 is not allowed"),
        (["--model.vocab_size", "32"], "model.vocab_size=32 is not allowed with this data: its token ids go up to 63"),
        (["--instruments.every_n_steps", "0"], "instruments.every_n_steps=0 is not allowed"),
        (["--instruments.divergence_policy", "panic"], "instruments.divergence_policy='panic' is not allowed"),
        (["--checkpoint.every_n_train_steps", "-2"], "every_n_train_steps"),
        (["--evaluation.top_k", "0"], "top_k=0 is not allowed"),
        (["--run_dir", "."], "run_dir='.' is not allowed"),
        # before: OSError 'File name too long' as a traceback, exit 1
        (["--run_dir", "a" * 300], "--run_dir is not allowed with a name of 300 bytes (aaaaaaaaaaaaaaaaaaaa…); this "
                                   "filesystem takes names of at most 255"),
        # before: jsonargparse's ~1,000 characters of every subtype and why each failed
        (["--trainer.precision", "bf17"], "trainer.precision='bf17' is not allowed; choose one of: 64, 32, 16, "
                                          "transformer-engine, transformer-engine-float16, 16-true, 16-mixed, "
                                          "bf16-true, bf16-mixed, 32-true, 64-true, bf16, auto, null"),
        # before: Lightning's ValueError as a traceback, exit 1
        (["--trainer.accelerator", "tpu9"], "trainer: You selected an invalid accelerator name: `accelerator='tpu9'`"),
        (["--trainer.num_nodes", "0"], "trainer: `num_nodes` must be a positive integer, but got 0"),
        # before: ZeroDivisionError inside Lightning's loops, a traceback and exit 1
        (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches=0 is not allowed; it must be "
                                                      "an integer >= 1"),
        (["--trainer.check_val_every_n_epoch", "0"], "trainer.check_val_every_n_epoch=0 is not allowed; it must be "
                                                      "an integer >= 1, or null"),
        (["--trainer.val_check_interval", "0"], "trainer.val_check_interval=0 is not allowed; it must be > 0"),
        # before: Lightning's bounds ValueError as a traceback, exit 1
        (["--seed_everything", "-5"], "seed_everything=-5 is not allowed; it must be an integer in [0, 4294967295]"),
        # before: accepted, and Lightning then clipped nothing (FSDP's clip_grad_norm_ would flip the gradients)
        (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val=-1.0 is not allowed; it must be > 0, or "
                                                 "0 or null for no clipping"),
        # before: tracebacks from torch's AdamW and numpy, after the run directory was written and left 'failed'
        (["--model.eps=-1"], "model.eps=-1.0 is not allowed; it must be a finite number > 0"),
        (["--data.seed=-1"], "data.seed=-1 is not allowed; it must be an integer >= 0"),
        # before: refused only by the final evaluation, after all the training, leaving the run 'failed'
        (["--evaluation.bertscore_model", "lnstab-test/unreachable"],
         "bertscore_model='lnstab-test/unreachable' could not be loaded"),
        # before: a "completed" run of 0 steps
        (["--trainer.max_epochs", "0"], "trainer.max_epochs=0 is not allowed; it must be an integer >= 1, or -1 "
                                        "or null"),
    ],
)
def test_bad_run_options_are_one_line(tmp_path, capsys, args, expected) -> None:
    err = one_line_error(capsys, "fit", "--config", str(tiny_config(tmp_path)), *args)
    assert expected in err, err
    assert not (tmp_path / "runs").exists()


def test_a_nan_from_a_config_file_is_refused_where_a_number_is_checked(tmp_path, capsys) -> None:
    """YAML's .nan passed 'gradient_clip_val < 0' and Lightning failed at step 0 ('Please use only one of them'),
    leaving the run 'failed'; for eps torch's AdamW refused it in a traceback."""
    for key, expected in (("trainer.gradient_clip_val", "trainer.gradient_clip_val=nan is not allowed; it must be > 0"),
                          ("model.eps", "model.eps=nan is not allowed; it must be a finite number > 0")):
        err = one_line_error(capsys, "fit", "--config", str(tiny_config(tmp_path, **{key: float("nan")})))
        assert expected in err, err
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("extends: [a.yaml, b.yaml]\n", "extends=['a.yaml', 'b.yaml'] is not allowed; it must be one file name"),
        ("extends: 3\n", "extends=3 is not allowed"),
        ("model:\n  preset: tiny\n    bad: indent\n", "is not valid YAML at line 3, column"),
        ("- a list\n", "it must hold a YAML mapping"),
    ],
)
def test_bad_config_files_are_one_line_with_the_line_number(tmp_path, capsys, text, expected) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert expected in one_line_error(capsys, "fit", "--config", str(path))


def test_help_lists_every_subcommand_and_predict_is_not_one(tmp_path, capsys) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "evaluate", "prepare", "sweep", "report", "check"):
        assert f"  {name} " in out, name
    # predict was listed, and could only fail after writing into the run (no predict step, no predict data)
    assert "predict" not in out
    for name in ("validate", "test", "evaluate"):  # '--help lists a command's options': these asked for a run
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0 and "--ckpt_path" in capsys.readouterr().out, name
    fit("--config", str(tiny_config(tmp_path)), "--run_dir", str(tmp_path / "r"))
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    err = one_line_error(capsys, "predict", "--ckpt_path", str(tmp_path / "r" / "checkpoints" / "last.ckpt"))
    assert "invalid choice: 'predict' (choose from 'fit', 'validate', 'test', 'evaluate')" in err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before


def test_a_diverged_run_is_a_result_exit_0_with_nonfinite_metrics_marked(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    run = tmp_path / "div"
    main(["fit", "--config", str(cfg), "--run_dir", str(run), "--model.norm_placement", "none",
          "--model.learning_rate", "1e4", "--model.min_lr", "1", "--trainer.max_steps", "8"])  # returns: exit 0
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["diverged_step"] is not None
    assert summary["divergence_events"] >= 1 and summary["final_step"] <= 8
    record = json.loads((run / "eval.json").read_text())  # the final evaluation ran and says what is not finite
    for key in record["nonfinite"]:
        assert record["metrics"][key] in ({"$float": "nan"}, {"$float": "inf"})  # strict JSON, read back as floats
    assert all(isinstance(record["metrics"][k], float) for k in record["metrics"] if k not in record["nonfinite"])
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())  # the last good weights


def test_the_progress_bar_counts_optimizer_steps_after_a_resume(tmp_path) -> None:
    cfg = tiny_config(tmp_path, **{"trainer.accumulate_grad_batches": 2})
    run = tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run), "--trainer.enable_progress_bar", "true")
    cli = cli_main(["fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last",
                    "--trainer.max_steps", "6", "--trainer.enable_progress_bar", "true"])
    # Lightning's own bar showed the batches of the epoch against the steps remaining
    assert cli.trainer.progress_bar_callback.position == (6, 6)


def test_an_unwritable_run_dir_or_a_bad_callback_in_yaml_is_one_line_before_anything_runs(tmp_path, capsys) -> None:
    cfg = tiny_config(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is a file, not a directory" in one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir",
                                                          str(blocker / "run"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    probe = locked / "x"
    try:
        probe.write_text("x")  # root ignores the mode bits: use a filesystem that takes no files instead
        locked = Path("/proc/lnstab-run")
    except PermissionError:
        pass
    assert "is not writable" in one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(locked))
    assert "lnstab evaluate needs --ckpt_path" in one_line_error(capsys, "evaluate", "--config", str(cfg))
    bad = tmp_path / "bad_callback.yaml"
    bad.write_text(yaml.safe_dump({"extends": "tiny.yaml", "trainer": {"callbacks": [
        {"class_path": "lnstab.callbacks.HiddenStateStatistics", "init_args": {"every_n_steps": 0}}]}}))
    assert "every_n_steps=0 is not allowed" in one_line_error(capsys, "fit", "--config", str(bad))
    assert not (tmp_path / "runs").exists()


def test_a_fresh_fit_into_a_run_dir_with_a_corrupt_summary_is_the_usual_refusal(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"status": "comp')
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(tiny_config(tmp_path)), "--run_dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err
    assert f"--run_dir {run} already holds a run (status unknown: summary.json is damaged: not valid JSON" in err
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("kind", ["dangling", "loop", "under_dangling", "under_file"])
def test_a_run_dir_behind_a_broken_link_or_under_a_file_is_one_line(kind, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    run_dir, expected = {
        "dangling": (tmp_path / "dangling", "is a symbolic link to"),
        "loop": (tmp_path / "loop_a", "is a loop of symbolic links"),
        "under_dangling": (tmp_path / "dangling" / "run", "which does not exist"),
        "under_file": (tmp_path / "file" / "a" / "run", "is a file, not a directory"),
    }[kind]
    cfg = tiny_config(tmp_path)
    assert expected in one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run_dir))
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "runs").exists()


def test_run_files_are_readable_by_others(tmp_path) -> None:
    fit("--config", str(tiny_config(tmp_path)), "--run_dir", str(tmp_path / "r"), "--trainer.max_steps", "2")
    for name in ("summary.json", "eval.json", "hidden_stats.json", "config.yaml", "checkpoints/last.ckpt"):
        assert (tmp_path / "r" / name).stat().st_mode & 0o044 == 0o044, name  # mkstemp's 0600 used to leak out


def test_a_run_directory_as_ckpt_path_is_named_as_such(tmp_path, capsys) -> None:
    cfg = str(tiny_config(tmp_path))
    run = tmp_path / "r"
    fit("--config", cfg, "--run_dir", str(run))
    before = sorted(p.name for p in run.iterdir())
    expected = f"--ckpt_path {run} is a run directory, not a checkpoint; give --run_dir {run} --ckpt_path last"
    # evaluate/validate said they needed "a --ckpt_path inside a run directory that holds config.yaml" (it does)
    for args in (["evaluate"], ["validate"], ["fit", "--config", cfg]):
        assert expected in one_line_error(capsys, *args, "--ckpt_path", str(run))
    assert sorted(p.name for p in run.iterdir()) == before


def test_evaluate_and_validate_score_a_checkpoint_on_other_data_as_documented(tmp_path, capsys) -> None:
    """docs/runs.md: `lnstab evaluate --ckpt_path … --data.*` to choose other data. The data module checked a fit's
    resumption invariants there too: '--data.batch_size 2 differs from the checkpoint's 4; exact resumption needs
    the same value', exit 2, after a config-evaluate file and an event file were written into the run."""
    cfg, run = tiny_config(tmp_path), tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run))
    ckpt = str(run / "checkpoints" / "last.ckpt")
    main(["evaluate", "--ckpt_path", ckpt, "--data.batch_size", "2", "--data.seed", "7"])
    assert json.loads((run / "eval-1.json").read_text())["stage"] == "evaluate"
    cli_main(["validate", "--ckpt_path", ckpt, "--data.batch_size", "2"])
    assert read_summary(run)["val"]["step"] == 4
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(SystemExit) as info:  # a fit still needs them: exact resumption
        main(["fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--data.batch_size", "2",
              "--trainer.max_steps", "6"])
    assert info.value.code == 2 and "--data.batch_size 2 differs from the checkpoint's 4" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_checkpoint_finds_its_run_however_its_path_is_spelled(tmp_path, monkeypatch, capsys) -> None:
    """'lnstab validate needs --config, or a --ckpt_path/--run_dir inside a run directory' was said of checkpoints
    inside one: given as --ckpt_path=FILE, relative to a cd, through '..', or with a --run_dir of its own for the
    results (a read-only run, say)."""
    cfg, run = tiny_config(tmp_path), tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run))
    ckpt = run / "checkpoints" / "last.ckpt"
    cli_main(["validate", f"--ckpt_path={ckpt}"])
    monkeypatch.chdir(run / "checkpoints")
    cli_main(["validate", "--ckpt_path", "last.ckpt"])
    monkeypatch.chdir(run)
    cli_main(["validate", "--ckpt_path", "checkpoints/../checkpoints/last.ckpt"])
    assert read_summary(run)["val"]["step"] == 4
    elsewhere = tmp_path / "scores"
    main(["evaluate", "--ckpt_path", str(ckpt), "--run_dir", str(elsewhere)])
    assert json.loads((elsewhere / "eval.json").read_text())["global_step"] == 4
    with pytest.raises(SystemExit) as info:
        main(["validate", "--ckpt_path", str(run / "checkpoints")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "is a run's checkpoint directory, not a checkpoint" in err, err


@pytest.mark.system
def test_evaluating_a_read_only_run_names_the_runs_directory_and_run_dir(tmp_path, capsys) -> None:
    """A run on a read-only disk: '--run_dir R is not allowed; … not writable' named a flag nobody gave."""
    from support.hostile import read_only_view

    cfg, run = tiny_config(tmp_path), tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run))
    with read_only_view(run, tmp_path / "ro") as mounted:
        if not mounted:
            pytest.skip("mount --bind is refused here (it needs root): no read-only run directory to test against")
        ckpt = str(tmp_path / "ro" / "checkpoints" / "last.ckpt")
        err = one_line_error(capsys, "evaluate", "--ckpt_path", ckpt)
        assert err.startswith(f"lnstab: error: the run directory of --ckpt_path {ckpt} cannot take lnstab "
                              "evaluate's results (") and err.endswith("; give --run_dir DIR for them"), err
        main(["evaluate", "--ckpt_path", ckpt, "--run_dir", str(tmp_path / "scores")])  # as the message says
        assert (tmp_path / "scores" / "eval.json").is_file()


def test_a_run_dir_runs_saved_config_reruns_as_a_new_run_where_its_config_says_not_beside_it(tmp_path) -> None:
    """config.yaml recorded the logger --run_dir had placed (save_dir: the run's parent): a sweep run's config, rerun
    as docs/runs.md says, trained into the grid's own directory, and every later report of the grid failed on it."""
    cfg, run = tiny_config(tmp_path), tmp_path / "grid" / "pre_s0"
    fit("--config", str(cfg), "--run_dir", str(run))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["logger"]["init_args"]["save_dir"] == str(tmp_path / "runs")  # as the config gave it
    fit("--config", str(run / "config.yaml"))
    assert sorted(p.name for p in (tmp_path / "grid").iterdir()) == ["pre_s0"]  # nothing beside the run
    assert (tmp_path / "runs" / "tiny" / "version_0" / "summary.json").is_file()  # the experiment the config names


def test_a_divergence_under_policy_continue_is_a_result_not_a_crash(tmp_path) -> None:
    """Weights non-finite before the first periodic checkpoint: Lightning's ModelCheckpoint saves `last` at the end
    of training, the monitor refused to save NaN weights there, and the run ended 'failed' with a traceback, exit 1."""
    cfg, run = tiny_config(tmp_path), tmp_path / "div"
    main(["fit", "--config", str(cfg), "--run_dir", str(run), "--model.norm_placement", "none",
          "--model.learning_rate", "1e4", "--model.min_lr", "1", "--trainer.max_steps", "8",
          "--instruments.divergence_policy", "continue"])  # returns: exit 0
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["diverged_step"] is not None
    for ckpt in (run / "checkpoints").glob("*.ckpt"):  # none with NaN weights
        assert all(torch.isfinite(v).all() for v in torch.load(ckpt, weights_only=True)["state_dict"].values())


def test_auto_starts_afresh_a_run_left_without_a_checkpoint_and_keeps_its_files(tmp_path, capsys) -> None:
    """A run stopped before its first checkpoint (a double Ctrl-C, a kill at start-up): ``--ckpt_path last`` said
    'use --ckpt_path auto to start afresh' and ``auto`` said 'resume it with --ckpt_path last', so the directory could
    be neither resumed nor restarted. ``auto`` now moves its files to ``attempts/1`` and starts afresh; a run with a
    result, or one still running, is never moved."""
    cfg, run = tiny_config(tmp_path), tmp_path / "r"
    fit("--config", str(cfg), "--run_dir", str(run))
    for ckpt in (run / "checkpoints").iterdir():  # as a double Ctrl-C leaves it: interrupted, nothing saved
        ckpt.unlink()
    (run / "checkpoints").rmdir()
    summary = read_summary(run)
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "interrupted_step": None}))
    old = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lnstab.lock"}
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run))
    assert "holds a run (status interrupted) with no checkpoint to resume; start it afresh with --ckpt_path auto" in err
    capsys.readouterr()
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "auto")
    assert f"its files are in {run / 'attempts' / '1'}, and this run starts afresh" in capsys.readouterr().err
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 4
    assert {p.name: p.read_bytes() for p in (run / "attempts" / "1").iterdir()} == old  # nothing lost
    # a completed run whose checkpoints are gone holds a result: auto refuses it, as before
    for ckpt in (run / "checkpoints").iterdir():
        ckpt.unlink()
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "auto")
    assert "already holds a run (status completed); resume it with --ckpt_path last" in err
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["1"]


def test_a_finished_runs_last_checkpoint_holds_its_final_step_when_the_cadence_does_not_divide_it(tmp_path) -> None:
    """max_steps 5 with a checkpoint every 2 steps: last.ckpt stayed at step 4 while eval.json scored step 5, so
    'lnstab evaluate --ckpt_path last.ckpt' scored an older model, and '--ckpt_path last' retrained a step."""
    run = tmp_path / "run"
    fit("--config", str(tiny_config(tmp_path, **{"trainer.max_steps": 5})), "--run_dir", str(run))
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5 == latest_eval(run)["global_step"] == read_summary(run)["final_step"]
    assert "optimizer_states" in last  # a whole state: a longer run resumes from it
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                                         "last.ckpt"]


def test_a_run_with_a_relative_directory_resumes_into_its_own_last_checkpoint(tmp_path, monkeypatch) -> None:
    """The quickstart's runs/ is relative: Lightning saved the checkpoint directory so, found it 'changed' when the
    resume named it absolutely (a warning), forgot last_model_path, and the resumed run wrote last-v1.ckpt beside
    last.ckpt, which stayed at the resumed step (README's own '--ckpt_path last'). With save_top_k != 0 (base.yaml's
    -1) every resume also warned that the checkpoint directory 'exists and is not empty': its own checkpoints."""
    import warnings

    from lnstab.callbacks import RunCheckpoint

    monkeypatch.chdir(tmp_path)
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs"}}
    cfg = tiny_config(tmp_path, **{"trainer.logger": logger})
    fit("--config", str(cfg))
    run = tmp_path / "runs" / "tiny" / "version_0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("--config", str(cfg), "--ckpt_path", "last", "--trainer.max_steps", "6")
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "dirpath has changed" in m or "exists and is not empty" in m], said
    assert sorted(p.name for p in (run / "checkpoints").glob("last*")) == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    # a checkpoint an earlier lnstab saved with the relative directory is read as the same directory
    callback = RunCheckpoint(dirpath=str(run / "checkpoints"), save_last=True)
    relative = "runs/tiny/version_0/checkpoints"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.load_state_dict({"dirpath": relative, "best_model_score": None, "best_model_path": "",
                                  "last_model_path": f"{relative}/last.ckpt", "best_k_models": {}})
    assert not caught and callback.last_model_path == str(run / "checkpoints" / "last.ckpt")


def test_a_moved_run_resumes_into_its_own_last_checkpoint(tmp_path) -> None:
    """A run directory moved (or copied from a cluster) before its resume: its checkpoints hold the old directory, so
    Lightning warned "The dirpath has changed", forgot last_model_path, and the resume wrote last-v1.ckpt beside
    last.ckpt, which stayed at the old step."""
    import shutil
    import warnings

    cfg = tiny_config(tmp_path)
    fit("--config", str(cfg), "--run_dir", str(tmp_path / "there"))
    runlock.release(tmp_path / "there")  # as the fit's process would at its exit
    run = shutil.move(tmp_path / "there", tmp_path / "here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", "6")
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "dirpath has changed" in m], said
    assert sorted(p.name for p in (run / "checkpoints").glob("last*")) == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6


def test_fast_dev_run_leaves_no_lock_and_names_no_run_directory(tmp_path, monkeypatch, caplog) -> None:
    """``lnstab fit --trainer.fast_dev_run true`` (Lightning's debug run, a DummyLogger: its run directory is the
    current one) left ``.lnstab.lock`` in the current directory and ended "run directory <cwd>; to view it:
    tensorboard --logdir <cwd>", a directory with nothing to view."""
    cfg = tiny_config(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with caplog.at_level("INFO"):
        main(["fit", "--config", str(cfg), "--trainer.fast_dev_run", "true"])
    assert list(work.iterdir()) == []
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lnstab: ")]
    assert said[-1] == "lnstab: fast_dev_run: nothing was written (no run directory, checkpoint or event file)", said
    assert not [m for m in said if "to view it" in m]
