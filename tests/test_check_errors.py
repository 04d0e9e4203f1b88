"""How ``lnstab check`` fails: a faulty model (one that breaks in training, ends the process, or is NaN) is exit 3
with one line, never the exit 1 of a failed criterion; hostile flags (empty or repeated ladders, a bad ``--out``, a huge
threshold expression, a YAML bomb) are usage errors; a full disk is exit 3 naming the file.

The faulty models (``check_faulty``) pass the check's up-front probe and break in the first stress run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.check import ENCODER, GPT, TINY
from support.hostile import ENOSPC

from lnstab.check.criteria import load_thresholds
from lnstab.cli import main

ONE_RUN = [*TINY, "--lrs", "1e-2", "--no-reference"]
HERE = Path(__file__).resolve().parent


def run_check(capsys, *args: str) -> tuple[int, str]:
    """``lnstab check *args`` in-process: its exit status and its one stderr line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["check", *args])
    err = capsys.readouterr().err.strip()
    assert err.startswith("lnstab: error: ") and "\n" not in err, err
    return info.value.code, err


@pytest.mark.parametrize(("factory", "said"), [
    ("fails_with_grad", "RuntimeError: this model cannot train"),
    ("no_parameters", "the model has no trainable parameters"),
    ("detached_logits", "does not require grad"),
])
def test_a_model_that_fails_in_training_is_exit_3_with_one_line(factory, said, tmp_path, capsys) -> None:
    out = tmp_path / "card"
    code, err = run_check(capsys, "--factory", f"check_faulty:{factory}", "--layer-pattern", r"layers\.(\d+)$",
                          *ONE_RUN, "--out", str(out))
    assert code == 3, err
    assert f"checked (check_faulty:{factory}) failed in its stress run at lr 0.01, seed 0" in err and said in err
    assert f"no verdict (traceback in {out / 'error.txt'})" in err
    assert "Traceback (most recent call last)" in (out / "error.txt").read_text()
    assert not (out / "report.json").exists()  # no card: nothing a gate could read as a verdict


def check_process(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``lnstab check *args`` in a process of its own (a model's os._exit would end pytest's), finding
    ``check_faulty``."""
    cmd = [str(Path(sys.executable).with_name("lnstab")), "check", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.system
def test_a_model_that_raises_keyboardinterrupt_in_training_is_said_to_and_exit_3(tmp_path) -> None:
    """Lightning's fit turns a KeyboardInterrupt into sys.exit(1): the line said 'the model ended the process during
    training (sys.exit(1))' of a model that never called it. In a process of its own: Lightning also sets SIGINT to
    be ignored in the process it ran in."""
    out = tmp_path / "card"
    done = check_process(tmp_path, "--factory", "check_faulty:interrupts_in_training", "--layer-pattern",
                         r"layers\.(\d+)$", *ONE_RUN, "--workers", "1", "--out", str(out))
    err = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 3 and err.startswith("lnstab: error: "), done.stderr[-2000:]
    assert "KeyboardInterrupt: the model raised KeyboardInterrupt during training, which Lightning's fit ends with " \
           "sys.exit(1)" in err and "ended the process" not in err, err


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "workers"])
@pytest.mark.parametrize(("factory", "call"), [("sys_exits", "sys.exit(0)"), ("os_exits", "os._exit(0)")])
def test_a_model_that_ends_the_process_in_training_is_exit_3_with_one_line(factory, call, workers, tmp_path) -> None:
    """A model that calls sys.exit(0) or os._exit(0) in its training forward: the check once exited 0, 'nothing
    fails', with no card (SystemExit passed `except Exception`; os._exit ended the check's own process), so a CI gate
    passed a model that never trained. In its own process, since os._exit would have ended pytest's."""
    out = tmp_path / "card"
    done = check_process(tmp_path, "--factory", f"check_faulty:{factory}", "--layer-pattern", r"layers\.(\d+)$",
                         *ONE_RUN, "--workers", workers, "--out", str(out))
    assert done.returncode == 3, done.stderr[-2000:]
    err = done.stderr.strip()
    assert err.startswith("lnstab: error: ") and "\n" not in err, err
    assert f"checked (check_faulty:{factory}) failed in its stress run at lr 0.01, seed 0" in err
    assert f"the model ended the process during training ({call})" in err, err
    assert not (out / "report.json").exists()


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.parametrize(("factory", "call"), [("sys_exits_when_probed", "sys.exit(0)"),
                                               ("os_exits_when_probed", "os._exit(0)")])
def test_a_model_that_ends_the_process_when_first_run_is_exit_2_with_one_line(factory, call, tmp_path) -> None:
    """The same model ending the process in the check's probe of its forward, before any run (exit 0 before)."""
    out = tmp_path / "card"
    done = check_process(tmp_path, "--factory", f"check_faulty:{factory}", "--layer-pattern", r"layers\.(\d+)$",
                         *ONE_RUN, "--out", str(out))
    err = done.stderr.strip()
    assert done.returncode == 2 and err.startswith("lnstab: error: ") and "\n" not in err, done.stderr[-2000:]
    assert f"the model ended the process ({call}) on token ids of shape (2, 16), before any training" in err, err
    assert not out.exists()


def test_logits_nan_at_initialisation_are_refused_as_such_and_nan_in_training_fails_on_divergence(tmp_path,
                                                                                                capsys) -> None:
    """All-NaN logits were refused as 'not causal (by up to nan)'. A model NaN before any training is refused in one
    line saying so (no run: nothing of its training to grade); one that turns NaN in training is graded, and fails
    on divergence."""
    out = tmp_path / "card"
    code, err = run_check(capsys, "--factory", "check_faulty:nan_logits", "--layer-pattern", r"layers\.(\d+)$",
                          *ONE_RUN, "--out", str(out))
    assert code == 2 and "checked (check_faulty:nan_logits): its logits are not finite at initialisation" in err, err
    assert "2048 of 2048 NaN or infinite" in err and "causal" not in err
    assert not out.exists()  # refused before any run
    with pytest.raises(SystemExit) as info:
        main(["check", "--factory", "check_faulty:nan_in_training", "--layer-pattern", r"layers\.(\d+)$", *ONE_RUN,
              "--out", str(out)])
    card = json.loads((out / "report.json").read_text())
    assert info.value.code == 1 and card["status"] == "fail"
    divergence = next(c for c in card["criteria"] if c["id"] == "divergence")
    assert divergence["status"] == "fail" and "1 of 1 runs diverged" in divergence["why"], divergence


def test_a_selected_block_the_forward_never_calls_is_a_usage_error(tmp_path, capsys) -> None:
    out = tmp_path / "card"
    code, err = run_check(capsys, "--factory", "check_faulty:skips_a_block", "--layer-pattern",
                          r"(?:layers|extra)\.(\d+)$", *ONE_RUN, "--out", str(out))
    assert code == 2 and "block 'extra.0'" in err and "is never called by the model's forward" in err
    assert not out.exists()


def test_blocks_whose_output_the_forward_discards_are_a_usage_error(tmp_path, capsys) -> None:
    """A forward that calls each block and drops what it returns ('block(x)' for 'x = block(x)') trains a bigram
    model: its card graded the unused blocks and said WARN, exit 0, 'Learns: PASS, learns faster than both
    references', with gradient spread n/a as if no run had been measured."""
    out = tmp_path / "card"
    code, err = run_check(capsys, "--factory", "check_faulty:discards_its_blocks", "--layer-pattern",
                          r"layers\.(\d+)$", *ONE_RUN, "--out", str(out))
    assert code == 2 and "its logits depend on none of the 2 blocks" in err and "'x = block(x)'" in err, err
    assert not out.exists()


@pytest.mark.parametrize(("args", "said"), [
    (["--lrs", ""], "--lrs '' is not allowed; give a comma-separated list"),
    (["--lrs", " , "], "--lrs '' is not allowed"),
    (["--seeds", ""], "--seeds '' is not allowed"),
    (["--lrs", "1e-2,0.01"], "--lrs 0.01,0.01 is not allowed; it names 0.01 twice"),
    (["--seeds", "0,1,0"], "--seeds 0,1,0 is not allowed; it names 0 twice"),
    (["--seeds", "18446744073709551616"], "--seeds=18446744073709551616 is not allowed; a seed is at most"),
    (["--lrs", "1e-3,,1e-2"], "'1e-3,,1e-2' has an empty item"),  # it was dropped without a word
    (["--batch-size", "1"], "(--probe-size is 2 unless given: with a smaller --batch-size, give it too)"),
])
def test_empty_and_repeated_ladders_are_refused(args, said, tmp_path, capsys) -> None:
    out = tmp_path / "card"
    code, err = run_check(capsys, *GPT, *TINY, *args, "--out", str(out))
    assert code == 2 and said in err, err
    assert not out.exists()


def test_an_out_that_is_a_file_or_under_one_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("keep me\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out, said in ((tmp_path / "file", f"{tmp_path / 'file'} is a file, not a directory"),
                      (tmp_path / "file" / "card", f"{tmp_path / 'file'} is a file, not a directory"),
                      (tmp_path / "file" / "a" / "b", f"{tmp_path / 'file'} is a file, not a directory"),
                      (tmp_path / "dangling" / "card", "which does not exist")):
        code, err = run_check(capsys, *GPT, *ONE_RUN, "--out", str(out))
        assert code == 2 and f"--out {out} is not allowed; " in err and said in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "file").read_text() == "keep me\n"


def test_a_validation_out_under_a_file_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("keep me\n")
    out = tmp_path / "file" / "validation"  # before, only a file at --out itself was refused; this one hit mkdir
    code, err = run_check(capsys, "--validate", *TINY, "--rows", "pre-ln", "--out", str(out))
    assert code == 2 and f"--out {out} is not allowed; {tmp_path / 'file'} is a file, not a directory" in err, err
    assert (tmp_path / "file").read_text() == "keep me\n"


def test_a_huge_threshold_expression_is_bounded_and_one_short_line(tmp_path, capsys) -> None:
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("loss:\n  warn: '" + " + ".join(["pre"] * 50_000) + "'\n")
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
    assert code == 2 and "loss.warn=" in err and "a threshold expression has at most 200" in err
    assert len(err) < 400 and not (tmp_path / "c").exists()


def test_a_reference_name_in_an_absolute_threshold_is_refused_before_any_training(tmp_path, capsys) -> None:
    """An absolute threshold is used where no reference has a value, so it cannot name one: refused up front in one
    line naming the file, the criterion and what is allowed (it was refused only after the whole check had trained,
    naming neither file nor criterion). Other bad expressions name the file too."""
    thresholds = tmp_path / "t.yaml"
    for text, where, allowed in (
            ("growth_init:\n  absolute: {fail: 2*peri}\n", "growth_init.absolute.fail='2*peri'", "fp16_max, bf16_max"),
            ("loss:\n  absolute: {warn: 'max(sd, 1)'}\n", "loss.absolute.warn='max(sd, 1)'", "max, min, abs"),
            ("attention:\n  fail: peri + nope\n", "attention.fail='peri + nope'", "pre, peri, pre_sd")):
        thresholds.write_text(text)
        out = tmp_path / "card"
        code, err = run_check(capsys, *GPT, *ONE_RUN, "--thresholds", str(thresholds), "--out", str(out))
        assert code == 2 and f"--thresholds {thresholds}: {where} is not allowed; only numbers" in err, err
        assert allowed in err
        if "absolute" in where:
            assert "so it cannot name pre, peri, pre_sd, peri_sd, sd" in err and "pre, peri, pre_sd, peri_sd, sd, " \
                not in err  # the allowed values leave the reference names out
        assert not out.exists()  # nothing trained, no run directory
    thresholds.write_text("overflow:\n  absolute: {warn: fp16_max / 4, fail: null}\n")
    assert load_thresholds(thresholds)["overflow"]["absolute"] == {"warn": "fp16_max / 4", "fail": None}


def test_the_help_documents_every_exit_status(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "0 no criterion fails, 1 one fails, 2 usage error, 3 the checked model or the check itself failed" in text


def test_a_healthy_factory_model_still_gets_its_verdict(tmp_path, capsys) -> None:
    code, _ = 0, None
    try:
        main(["check", *ENCODER, *ONE_RUN, "--out", str(tmp_path / "card")])
    except SystemExit as exc:
        code = exc.code
    assert code in (0, 1) and (tmp_path / "card" / "report.json").is_file() and not Path(
        tmp_path / "card" / "error.txt").exists()


def test_a_default_run_root_under_a_file_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("not a directory\n")
    code, err = run_check(capsys, *GPT, *ONE_RUN)
    assert code == 2 and "runs/check cannot be created" in err and "give --out DIR" in err
    assert (tmp_path / "runs").read_text() == "not a directory\n"


def test_a_billion_laughs_as_a_model_value_is_one_line(tmp_path, capsys) -> None:
    from support.hostile import inline_laughs

    code, err = run_check(capsys, *GPT, "--model.betas", inline_laughs(), *ONE_RUN, "--out", str(tmp_path / "c"))
    assert code == 2 and "a --model.* value: its aliases expand to more than 100000 values" in err
    assert not (tmp_path / "c").exists()


@pytest.mark.system
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the event writer's thread too
def test_lnstab_check_on_a_full_disk_ends_in_one_line_naming_the_file_and_exit_3(full_disk, capsys) -> None:
    """A check is a gate: a full disk is a failure with no verdict (3), never "a criterion fails" (1)."""
    out = full_disk / "check"
    with pytest.raises(SystemExit) as info:
        main(["check", *GPT, *TINY, "--lrs", "1e-2", "--out", str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert info.value.code == 3 and last.startswith("lnstab: error: lnstab check: ") and ENOSPC in last, last
    assert "Traceback" not in err and "Exception in thread" not in err, err  # nor the event writer's thread
    assert f"{out}/" in last, last  # a file of the check's directory is named


def test_a_threshold_of_nan_or_inf_is_refused_not_swapped_for_the_absolute_one(tmp_path, capsys) -> None:
    thresholds = tmp_path / "t.yaml"
    for text in ("divergence:\n  fail: .nan\n", "loss:\n  warn: .inf\n", "loss:\n  absolute: {warn: -.inf}\n",
                 # as expressions: 'log(-1)'/'log(0)' made a model whose every run diverged PASS (no threshold left)
                 "divergence:\n  absolute: {warn: 'log(-1)', fail: 'log(0)'}\n", "loss:\n  fail: 1/0\n",
                 "overflow:\n  warn: fp16_max * 1e308\n"):
        thresholds.write_text(text)
        code, err = run_check(capsys, *GPT, *ONE_RUN, "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
        assert code == 2 and "is not allowed; " in err and "give a finite number, null or an expression" in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "c").exists()


def test_a_threshold_function_given_the_wrong_number_of_arguments_is_refused_before_any_training(tmp_path,
                                                                                                 capsys) -> None:
    """abs(pre, peri) was 'the check failed: TypeError: abs() takes exactly one argument (2 given)', exit 3."""
    thresholds = tmp_path / "t.yaml"
    for text, said in (("growth_init:\n  warn: abs(pre, peri)\n", "abs() takes 1 argument, not 2"),
                       ("loss:\n  warn: max(pre)\n", "max() takes 2 or more arguments, not 1"),
                       ("loss:\n  warn: log(pre, 2, 3)\n", "log() takes 1 to 2 arguments, not 3")):
        thresholds.write_text(text)
        code, err = run_check(capsys, *GPT, *ONE_RUN, "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
        assert code == 2 and f"--thresholds {thresholds}: " in err and said in err, err
        assert not (tmp_path / "c").exists()


def test_two_checks_into_one_empty_out_at_once_are_one_card_and_one_refusal(tmp_path, monkeypatch) -> None:
    """Both found the new --out empty, both wrote into it and exited 0: one card silently replaced the other. The
    directory is now claimed with an exclusive create as it is made; the claim goes when the check ends."""
    import argparse

    from lnstab.check import cli
    from lnstab.errors import LNStabError

    args = argparse.Namespace(out=str(tmp_path / "card"))
    first = cli.run_directory(args, "x")
    monkeypatch.setattr(cli, "check_out", lambda out: None)  # the second looked while the first had not made it
    with pytest.raises(LNStabError, match="is being written by another lnstab check started at the same time"):
        cli.run_directory(args, "x")
    assert first == tmp_path / "card" and (first / cli.CLAIM).is_file()
    cli._claimed.clear()


def test_a_finished_check_leaves_no_claim_in_its_out(tmp_path) -> None:
    from lnstab.cli import main

    out = tmp_path / "card"
    try:
        main(["check", *GPT, *ONE_RUN, "--out", str(out)])
    except SystemExit as exc:  # a card's verdict as its exit status
        assert exc.code in (0, 1)
    assert (out / "report.json").is_file() and not (out / ".claimed").exists()


def test_a_warn_threshold_above_its_fail_threshold_is_refused_before_any_training(tmp_path, capsys) -> None:
    """warn 5 with fail 3 left no value that warns (a warn at or above fail is dropped as 'no warning band'), and the
    file was accepted silently; equal numbers, an expression beside a number and null stay allowed."""
    thresholds = tmp_path / "t.yaml"
    for text, said in (("loss:\n  warn: 5\n  fail: 3\n", "loss.warn=5 is not allowed above loss.fail=3"),
                       ("divergence:\n  absolute: {warn: 0.9}\n",  # its absolute fail stays 0.5
                        "divergence.absolute.warn=0.9 is not allowed above divergence.absolute.fail=0.5")):
        thresholds.write_text(text)
        code, err = run_check(capsys, *GPT, *ONE_RUN, "--thresholds", str(thresholds), "--out", str(tmp_path / "c"))
        assert code == 2 and f"--thresholds {thresholds}: {said}" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "c").exists()
    for warn, fail in ((3, "3"), (5, "pre"), (5, "null")):
        thresholds.write_text(f"loss:\n  warn: {warn}\n  fail: {fail}\n")
        assert load_thresholds(thresholds)["loss"]["warn"] == warn


def test_an_out_with_a_name_longer_than_the_filesystem_takes_is_a_usage_error(tmp_path, capsys) -> None:
    """It was 'the check failed: OSError: [Errno 36] File name too long', exit 3 (a model's or the check's fault)."""
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--out", str(tmp_path / ("a" * 300)))
    assert code == 2 and "--out is not allowed with a name of 300 bytes" in err and len(err.strip().splitlines()) == 1


def test_the_help_says_what_the_check_is(capsys) -> None:
    """Its description was the first line of options.py's docstring once the parser moved there ("``lnstab check``'s
    command line: the parser, the ``--model.*`` arguments, and the :class:`Protocol` and worker"), cut mid-sentence."""
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "A stability report card for any Transformer, measured beside Pre-LN and" in text  # argparse may wrap
    assert "references of its shape." in text
    assert "command line: the parser" not in text and ":class:" not in text


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs/card", ".", "..", "n" * 300])
def test_a_name_that_is_not_one_directory_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, name) -> None:
    """--name ../../x wrote the card two levels above runs/check (into the working directory), /abs anywhere; a/b
    and a name longer than the filesystem takes were exit 3 ('the check failed: FileNotFoundError', 'OSError: File
    name too long') after the data was read; '.' and '..' gave runs/check/.-1 and ..-1."""
    work = tmp_path / "w" / "d"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--name", name.replace("/abs", str(tmp_path / "abs")))
    assert code == 2 and "--name" in err and "is not allowed" in err, err
    assert not any(tmp_path.rglob("report.json")) and not (work / "runs").exists() and not (tmp_path / "abs").exists()


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "mps"])
def test_an_accelerator_the_machine_lacks_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                         accelerator) -> None:
    """--accelerator gpu on a machine without one was exit 3, 'checked (...) failed in its stress run at lr ...:
    MisconfigurationException: No supported gpu backend found!', as if the model had failed, with a run directory
    holding error.txt."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    out = tmp_path / "card"
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--accelerator", accelerator, "--out", str(out))
    assert code == 2 and f"--accelerator {accelerator} is not allowed here" in err and "--accelerator cpu" in err, err
    assert not out.exists()


@pytest.mark.parametrize(("left", "said"), [
    ("error.txt", "(a check that failed: its error.txt says why; remove it to check again there)"),
    (".claimed", "(a check is writing into it, or one killed before it ended (kill -9, out of memory) left its "
                 ".claimed there; remove it to check again there)"),
])
def test_an_out_a_failed_or_killed_check_left_says_so(tmp_path, capsys, left, said) -> None:
    """A check into the --out of one that failed (exit 3: error.txt and the runs' logs) or was killed (kill -9: its
    .claimed and tb/) was refused only as 'already exists and is not empty', a directory with nothing else to read
    there for the killed one; a signal's interrupted.txt was already named."""
    out = tmp_path / "card"
    (out / "tb").mkdir(parents=True)
    (out / left).write_text("")
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--out", str(out))
    assert code == 2 and f"--out {out} already exists and is not empty {said}; a check never overwrites" in err, err
    assert sorted(p.name for p in out.iterdir()) == sorted([left, "tb"])


@pytest.mark.parametrize("words", [2, 40])
def test_too_little_text_is_said_in_the_checks_own_options(tmp_path, capsys, words) -> None:
    """A --data.path shorter than a held-out window and one batch was refused in lnstab fit's options: 'one batch
    needs --data.batch_size 8 x --data.block_size 64 + 1 = 513: give more text, or a smaller --data.val_tokens, ...'
    or 'val_tokens=65 is not allowed ... (1 documents)', options the check does not have."""
    text = tmp_path / "short.txt"
    text.write_text(" ".join(["word"] * words) + "\n")
    out = tmp_path / "card"
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--data.source", "files", "--data.path", str(text), "--out", str(out))
    assert code == 2 and f"--data.path {text} holds less than one window of" in err, err
    assert "give more text, or a smaller --batch-size, --steps or --seq-len" in err
    assert "--data.val_tokens" not in err and "val_tokens=" not in err and not out.exists()


def test_text_that_would_repeat_its_windows_is_refused(tmp_path, capsys) -> None:
    """A --data.path holding one batch but fewer windows than the run's steps take was read round again by the
    training loader: 4,000 characters gave '32 windows of 65 GPT-2 tokens' on the card, 8 distinct ones seen four
    times over (a model learning one batch by heart), and the refusal written for too few windows never fired."""
    text = tmp_path / "short.txt"
    text.write_text(" ".join(f"item{i}" for i in range(120)) + "\n")
    out = tmp_path / "card"
    code, err = run_check(capsys, *GPT, *ONE_RUN, "--data.source", "files", "--data.path", str(text), "--out", str(out))
    assert code == 2 and f"--data.path {text} holds " in err and "the check needs 28 (--batch-size × (--steps + 1)), " \
        "each seen once" in err, err
    assert not out.exists()


@pytest.mark.parametrize(("source", "said"), [
    ("import sys\nsys.exit(0)\n", "ended the process when imported (sys.exit(0))"),
    ("import os\nos._exit(0)\n", "ended the process when imported (os._exit(0))"),
    ("import sys\n\ndef build():\n    sys.exit(0)\n", "ended the process when called (sys.exit(0))"),
])
def test_a_factory_that_ends_the_process_on_import_or_call_is_one_line_never_exit_0(tmp_path, capsys, monkeypatch,
                                                                                     source, said) -> None:
    """A factory module that ran a script's work at import (sys.exit(0), os._exit(0)) or a factory function that
    called sys.exit(0) ended lnstab check silently with status 0, which a CI gate reads as 'no criterion fails'."""
    name = f"exits_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source + ("\ndef build():\n    pass\n" if "def build" not in source else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail(f"os._exit({code}) reached the test process"))
    out = tmp_path / "card"
    code, err = run_check(capsys, "--factory", f"{name}:build", "--layer-pattern", r"layers\.(\d+)$", *ONE_RUN,
                          "--out", str(out))
    assert code == 2 and f"--factory '{name}:build'" in err and said in err, err
    assert not out.exists()


@pytest.mark.parametrize(("source", "said"), [
    ("raise RuntimeError('not today')\n", "cannot be imported (RuntimeError: not today)"),
    ("import sys\nsys.exit(0)\n", "ended the process when imported (sys.exit(0))"),
])
def test_a_module_types_module_that_raises_or_exits_on_import_is_one_line(tmp_path, capsys, monkeypatch, source,
                                                                          said) -> None:
    """--module-types pkg.Block whose module raised on import was exit 3, 'the check failed: RuntimeError', as if
    the check had broken; one that called sys.exit(0) ended the check silently with status 0."""
    name = f"types_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_check(capsys, *ENCODER[:2], "--module-types", f"{name}.Block", *ONE_RUN,
                          "--out", str(tmp_path / "card"))
    assert code == 2 and f"--module-types '{name}.Block': module '{name}' {said}" in err, err
    assert not (tmp_path / "card").exists()
