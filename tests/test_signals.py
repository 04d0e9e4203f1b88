"""Signals at every stage of a run, and one owner per run directory: a signal is never recorded as a failure or a
completion it did not let happen, the exit status says which signal, and a second run cannot train into a live one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from support.runs import fit, one_line_error, tiny_config

from lnstab import runlock
from lnstab.cli import main
from lnstab.rundir import latest_eval, read_summary

LNSTAB = str(Path(sys.executable).with_name("lnstab"))


def ckpt_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def lasts(run: Path) -> list[str]:
    """The run's ``last*.ckpt`` files (beside them: the step checkpoints ``save_top_k: -1`` keeps)."""
    return sorted(p.name for p in (run / "checkpoints").glob("last*.ckpt"))


@pytest.mark.system
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_during_the_final_evaluation_ends_the_run_interrupted_and_a_resume_evaluates(
        signame, tmp_path, monkeypatch) -> None:
    """Before: SIGTERM there was swallowed (exit 0, ``completed`` without an evaluation), SIGINT exited 1, SIGHUP
    gave a traceback and left ``running``."""
    import lnstab.evaluation.callback as callback

    signum = getattr(signal, signame)
    real = callback.evaluate_model
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)  # what a scheduler or a terminal does while the evaluation runs
        for _ in range(100):
            time.sleep(0.05)
        raise AssertionError("the signal did not stop the evaluation")

    monkeypatch.setattr(callback, "evaluate_model", signalled)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(cfg), "--run_dir", str(run)])
    assert info.value.code == 128 + signum
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == signame
    assert summary["interrupted_step"] == summary["final_step"] == 4
    assert ckpt_step(run / "checkpoints" / "last.ckpt") == 4 and not (run / "eval.json").exists()

    monkeypatch.setattr(callback, "evaluate_model", real)
    main(["fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last"])  # nothing to train: evaluates
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["final_step"] == 4 and (run / "eval.json").is_file()


@pytest.mark.system
def test_a_run_killed_or_failed_in_its_final_evaluation_is_evaluated_when_resumed(tmp_path, monkeypatch) -> None:
    """Only an ``interrupted`` run was owed its evaluation: one killed in it (``running``, its process gone) or failed
    in it (a full disk) resumed to ``completed`` with no evaluation at all."""
    import lnstab.evaluation.callback as callback

    cfg = tiny_config(tmp_path)
    failed, killed = tmp_path / "failed", tmp_path / "killed"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(callback, "evaluate_model", disk_full)
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(cfg), "--run_dir", str(failed)])
    kill = ("import os, signal; import lnstab.evaluation.callback as c; from lnstab.cli import main; "
            "c.evaluate_model = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
            f"main(['fit', '--config', {str(cfg)!r}, '--run_dir', {str(killed)!r}])")
    assert subprocess.run([sys.executable, "-c", kill], capture_output=True).returncode == -signal.SIGKILL
    for run, status in ((failed, "failed"), (killed, "running")):
        assert read_summary(run)["status"] == status and not (run / "eval.json").exists()
        assert ckpt_step(run / "checkpoints" / "last.ckpt") == 4
        main(["fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last"])  # nothing to train
        summary = read_summary(run)
        assert summary["status"] == "completed" and summary["final_step"] == 4, (status, summary)
        assert (run / "eval.json").is_file() and latest_eval(run)["global_step"] == 4, status


@pytest.mark.system
@pytest.mark.parametrize(("command", "signame"), [("evaluate", "SIGTERM"), ("test", "SIGINT"), ("validate", "SIGTERM")])
def test_a_signal_during_validate_test_or_evaluate_stops_it_at_once_with_nothing_written(
        command, signame, tmp_path, monkeypatch, capsys) -> None:
    """Before: Lightning's handler took SIGTERM ("[rank: 0] Received SIGTERM"), the evaluation ran to its end
    (145 s more for 2,000 samples), wrote its eval file and exited 0."""
    import lnstab.evaluation.callback as callback
    from lnstab.module import GPTModule

    signum = getattr(signal, signame)
    run = tmp_path / "run"
    fit("--config", str(tiny_config(tmp_path)), "--run_dir", str(run))
    before = read_summary(run)
    files = sorted(p.name for p in run.iterdir() if not p.name.startswith(("events.", "config-")))

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)  # what a scheduler or a terminal does while it runs
        for _ in range(100):
            time.sleep(0.05)
        raise AssertionError("the signal did not stop it")

    if command == "validate":
        monkeypatch.setattr(GPTModule, "validation_step", signalled)
    else:
        monkeypatch.setattr(callback, "evaluate_model", signalled)
    capsys.readouterr()
    handler = signal.getsignal(signum)
    with pytest.raises(SystemExit) as info:
        main([command, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert info.value.code == 128 + signum
    assert f"lnstab: lnstab {command} stopped by {signame} before it wrote its result" in capsys.readouterr().err
    assert read_summary(run) == before  # the run is as it was: no eval, no val, its status
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(("events.", "config-"))) == files
    assert signal.getsignal(signum) is handler  # the process's own handler again


SIGNAL_HELPERS = '''
import os
from lightning.pytorch.callbacks import Callback
from lnstab.datamodules import OpenWebTextDataModule


class SignalAt(Callback):
    """At the end of optimizer step ``at``, signal this process ``times`` times (``mid_step``: during the step that
    ends at ``at``, before its update, as a signal mostly arrives: the progress bar then draws that step after it)."""

    def __init__(self, at: int = 2, signum: int = 15, times: int = 1, mid_step: bool = False) -> None:
        self.at, self.signum, self.times, self.sent, self.mid_step = at, signum, times, False, mid_step

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._send(-1)  # at: -1: as the run starts, to Lightning's handler before the fit's first step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.mid_step:
            self._send(trainer.global_step)
        elif self.sent and trainer.progress_bar_callback is not None:  # the bar draws this step, as an instrument's
            trainer.progress_bar_callback.train_progress_bar.set_postfix_str("probe", refresh=True)  # postfix does

    def _send(self, step) -> None:
        if step == self.at and not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.mid_step:
            self._send(trainer.global_step + 1)


class SignalThenFailingData(OpenWebTextDataModule):
    """Fetching training batch ``fail_at`` (0-based) delivers SIGTERM to this process and then fails, as a loop
    does whose loader worker the job's signal killed: the error comes before any step boundary."""

    def __init__(self, fail_at: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training and self.batches_consumed == self.fail_at:
            os.kill(os.getpid(), 15)
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return batch
'''


def with_helpers(tmp_path: Path, monkeypatch, callback: dict | None = None, data: dict | None = None) -> Path:
    """The tiny config, 8 steps, with a callback or a data module from :data:`SIGNAL_HELPERS`."""
    (tmp_path / "signal_helpers.py").write_text(SIGNAL_HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config(tmp_path, **{"trainer.max_steps": 8})
    config = yaml.safe_load(cfg.read_text())
    if callback is not None:
        config["trainer"]["callbacks"] = [{"class_path": "signal_helpers.SignalAt", "init_args": callback}]
    if data is not None:
        config["data"] = {"class_path": "signal_helpers.SignalThenFailingData",
                          "init_args": {**config["data"]["init_args"], **data}}
    cfg.write_text(yaml.safe_dump(config))
    return cfg


@pytest.mark.system
def test_a_second_ctrl_c_stops_at_once_with_exit_130(tmp_path, monkeypatch, capsys) -> None:
    """Before: the second Ctrl-C's KeyboardInterrupt made Lightning exit 1. Its last line then still said 'stopping
    after this optimizer step with a resumable checkpoint'; it says now that no checkpoint of the step was written,
    and --ckpt_path auto, as it says, carries the run on (moving aside a run with no checkpoint at all)."""
    cfg = with_helpers(tmp_path, monkeypatch, callback={"at": 2, "signum": int(signal.SIGINT), "times": 2})
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(cfg), "--run_dir", str(run)])
    assert info.value.code == 130
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    assert summary["interrupted_step"] is None  # no checkpoint of the step it stopped in
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lnstab: stopped at once by a second SIGINT, without a checkpoint of this step"), last
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "auto", "--trainer.callbacks", "[]")
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 8


@pytest.mark.system
@pytest.mark.parametrize("sanity_batches", [1, 2])
def test_a_sigterm_as_the_run_starts_stops_it_after_its_first_step_resumably(tmp_path, monkeypatch, sanity_batches,
                                                                             caplog) -> None:
    """A SIGTERM after Lightning's handler went in and before lnstab's (a sweep stopped as its run's loaders started)
    reached Lightning's alone: the run ended after its first step (or in the sanity check) ``failed`` with
    'SIGTERMException: ', exit status 0 and no checkpoint."""
    cfg = with_helpers(tmp_path, monkeypatch, callback={"at": -1, "signum": int(signal.SIGTERM)})
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(cfg), "--run_dir", str(run), "--trainer.num_sanity_val_steps",
              str(sanity_batches), "--trainer.limit_val_batches", "2"])
    assert info.value.code == 128 + signal.SIGTERM
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    assert summary["interrupted_step"] == 1 and ckpt_step(run / "checkpoints" / "last.ckpt") == 1
    assert "lnstab: received SIGTERM; stopping after this optimizer step" in caplog.text


@pytest.mark.system
def test_an_error_after_a_signal_is_an_interruption_that_resumes_exactly(tmp_path, monkeypatch, capsys) -> None:
    """Before: a loader worker killed by the job's signal failed the run (``failed``), and the requeued sweep
    element then skipped it for ever."""
    cfg = with_helpers(tmp_path, monkeypatch, data={"fail_at": 3})
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(cfg), "--run_dir", str(run)])
    assert info.value.code == 128 + signal.SIGTERM
    assert "recorded as interrupted" in capsys.readouterr().err
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    assert summary["interrupted_step"] == 3 and ckpt_step(run / "checkpoints" / "last.ckpt") == 3
    # the checkpoint written between two steps resumes exactly: equal to an uninterrupted run
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--data.init_args.fail_at", "-1")
    fit("--config", str(cfg), "--run_dir", str(tmp_path / "straight"), "--data.init_args.fail_at", "-1")
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.system
def test_a_run_stopped_before_its_first_checkpoint_keeps_one_last_ckpt_that_resumes_exactly(tmp_path, monkeypatch,
                                                                                              terminal) -> None:
    """Stopped at step 1, before the checkpoint callback's first save (step 2 here; the quickstart's 100): one
    ``last.ckpt``, which the resumed run goes on writing. Before: the callback wrote ``last-v1.ckpt`` beside it as the
    stopped epoch ended, and the resumed run kept writing ``last-v1.ckpt`` while ``last.ckpt`` stayed at step 1.
    With a progress bar drawing, the signal's line and the save's start lines of their own (both were glued to the
    bar's)."""
    cfg = with_helpers(tmp_path, monkeypatch, callback={"at": 1, "signum": int(signal.SIGTERM), "mid_step": True})
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(cfg), "--run_dir", str(run), "--trainer.enable_progress_bar", "true"])
    assert info.value.code == 128 + signal.SIGTERM
    shown = terminal()
    assert any(line.startswith("lnstab: received SIGTERM") for line in shown), shown
    assert any(line.startswith(f"lnstab: saved {last} at step 1; resume with") for line in shown), shown
    assert lasts(run) == ["last.ckpt"] and ckpt_step(last) == read_summary(run)["interrupted_step"] == 1
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.enable_progress_bar", "true")
    assert lasts(run) == ["last.ckpt"] and ckpt_step(last) == 8
    assert not list(run.glob("config-*.yaml"))  # the same config: nothing beside config.yaml (config-fit-1.yaml before)
    straight = tmp_path / "straight"
    fit("--config", str(tiny_config(tmp_path, name="plain", **{"trainer.max_steps": 8})), "--run_dir", str(straight))
    resumed = torch.load(last, weights_only=True)["state_dict"]
    for key, value in torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"].items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.system
def test_a_second_fit_into_a_live_run_directory_is_refused_and_writes_nothing(tmp_path, capsys) -> None:
    """Before: both trained into it (two event files, the other's config beside the first's, a crashed save)."""
    cfg = tiny_config(tmp_path, **{"trainer.max_steps": 100000})
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen([LNSTAB, "fit", "--config", str(cfg), "--run_dir", str(run)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "last.ckpt").exists():
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last")
        assert "is in use by lnstab fit (pid" in err and f"pid {first.pid} " in err
        # nothing of this process's: no event file (named with the writer's pid), no second config
        assert not [p for p in run.glob("events.out.tfevents.*") if f".{os.getpid()}." in p.name]
        assert not list(run.glob("config-*.yaml")) and read_summary(run)["status"] == "running"
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    # the lock ends with its holder: the run resumes in the same directory
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps",
        str(read_summary(run)["final_step"] + 2))
    assert read_summary(run)["status"] == "completed"


@pytest.mark.system
def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lnstab import runlock; "
                               f"runlock.hold({str(run)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunDirInUse, match=f"pid {holder.pid} "):
            runlock.hold(run)
    finally:
        holder.kill()
        holder.wait()
    note = runlock.hold(run)  # SIGKILL released the flock; the file it left names it
    try:
        assert note is not None and f"pid {holder.pid}" in note and "has ended" in note
        assert runlock.holder(run)["pid"] == os.getpid()
    finally:
        runlock.release(run)


@pytest.mark.system
@pytest.mark.parametrize("ending", ["return", "exit 130"])
def test_a_lock_whose_holder_ended_by_itself_is_taken_over_without_a_word(tmp_path, ending) -> None:
    """A completed run, or one a signal stopped (exit 130 after Ctrl-C), empties its record as it exits: the run that
    resumes it said 'lnstab: …/.lnstab.lock was left by lnstab fit (pid …), which has ended' on every resume."""
    run = tmp_path / "run"
    end = "" if ending == "return" else "; raise SystemExit(130)"
    done = subprocess.run([sys.executable, "-c", f"from lnstab import runlock; runlock.hold({str(run)!r}){end}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if ending == "return" else 130), done.stderr
    assert runlock.holder(run) == {}  # the file stays; its record is gone
    note = runlock.hold(run)
    try:
        assert note is None and runlock.holder(run)["pid"] == os.getpid()
    finally:
        runlock.release(run)
    assert (run / runlock.LOCK_FILE).read_text() == ""  # released by this process: emptied too


def test_resuming_refuses_model_settings_from_a_config_file_that_contradict_the_checkpoint(tmp_path, capsys) -> None:
    """Before: only --model.* flags were compared; a --config file (or an edited base YAML under a sweep) was
    silently overridden by the checkpoint."""
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    fit("--config", str(cfg), "--run_dir", str(run))
    dt = tmp_path / "dt.yaml"
    dt.write_text("model: {residual_scale: 0.1}\n")
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--config", str(dt), "--run_dir", str(run),
                         "--ckpt_path", "last", "--trainer.max_steps", "6")
    assert "model.residual_scale=0.1 (from the --config files) contradicts the checkpoint's residual_scale=1.0" in err
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last",
                         "--trainer.max_steps", "6", "--model.learning_rate", "0.01")
    assert "--model.learning_rate 0.01 contradicts the checkpoint's learning_rate=0.003" in err
    assert read_summary(run)["final_step"] == 4  # nothing trained on
    # settings that do not change what is trained may differ, and the run's own config always resumes it
    fit("--config", str(run / "config.yaml"), "--run_dir", str(run), "--ckpt_path", "last",
        "--trainer.max_steps", "6")
    assert read_summary(run)["final_step"] == 6


def test_resuming_a_diverged_run_is_refused(tmp_path, capsys) -> None:
    """Before: it trained on and recorded its events a second time."""
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    fit("--config", str(cfg), "--run_dir", str(run), "--model.learning_rate", "1000", "--model.min_lr", "1",
        "--model.norm_placement", "none", "--trainer.max_steps", "30")
    summary = read_summary(run)
    assert summary["status"] == "diverged", summary
    err = one_line_error(capsys, "fit", "--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last",
                         "--model.learning_rate", "1000", "--model.min_lr", "1", "--model.norm_placement", "none",
                         "--trainer.max_steps", "40")
    assert f"that run ended diverged at step {summary['diverged_step']}" in err
    assert read_summary(run) == summary


def test_resuming_a_run_whose_summary_is_damaged_keeps_the_damaged_file_and_completes(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    fit("--config", str(cfg), "--run_dir", str(run))
    (run / "summary.json").write_text('{"status": "compl')  # truncated by a full disk, say
    fit("--config", str(cfg), "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", "6")
    assert read_summary(run)["status"] == "completed" and read_summary(run)["final_step"] == 6
    assert (run / "summary.damaged-1.json").read_text() == '{"status": "compl'


def test_a_logger_directory_under_a_file_is_one_line(tmp_path, capsys) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs would go")
    err = one_line_error(capsys, "fit", "--config", str(tiny_config(tmp_path)))
    assert f"{blocker} is a file, not a directory" in err
    assert blocker.read_text() == "a file where the runs would go"


@pytest.mark.slow
@pytest.mark.system
def test_a_closed_terminal_stops_the_run_resumably(tmp_path) -> None:
    """A run in a terminal that closes (an ssh session dropped): the kernel sends SIGHUP to the terminal's foreground
    process group and every later write to it fails. Before: a traceback, and ``summary.json`` left ``running``."""
    import contextlib
    import pty
    import select
    import termios

    cfg = tiny_config(tmp_path, **{"trainer.max_steps": 100000})
    data = yaml.safe_load(cfg.read_text())
    data["trainer"]["enable_progress_bar"] = True  # writes to the terminal on every step
    data["data"]["init_args"]["num_workers"] = 2  # the workers are in the terminal's process group too
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    master, slave = pty.openpty()

    def controlling_terminal() -> None:  # a new session whose controlling terminal is the pty, as a login shell's
        os.setsid()
        import fcntl

        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([LNSTAB, "fit", "--config", str(cfg), "--run_dir", str(run)], stdin=slave,
                            stdout=slave, stderr=slave, preexec_fn=controlling_terminal, close_fds=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(slave)
    seen = bytearray()
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "last.ckpt").exists():  # read what the run writes, as a terminal does
            assert proc.poll() is None, bytes(seen[-3000:]).decode(errors="replace")
            assert time.monotonic() < deadline
            if select.select([master], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    seen.extend(os.read(master, 65536))
        os.close(master)  # the terminal goes away: SIGHUP to its foreground process group (nothing else reads it)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGHUP, bytes(seen[-3000:]).decode(errors="replace")
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGHUP", summary
    assert ckpt_step(run / "checkpoints" / "last.ckpt") == summary["interrupted_step"]


def test_a_process_the_holder_started_shares_its_lock(tmp_path) -> None:
    """Ranks that a spawn launcher starts (``ddp_spawn``, the CPU FSDP tests) are children of the process that took
    the run directory's lock; they work for the same run and must not be refused."""
    run = tmp_path / "run"
    script = ("import subprocess, sys; from lnstab import runlock; runlock.hold(sys.argv[1]); "
              "child = 'import sys; from lnstab import runlock; print(runlock.hold(sys.argv[1]), flush=True)'; "
              "sys.exit(subprocess.run([sys.executable, '-c', child, sys.argv[1]]).returncode)")
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
