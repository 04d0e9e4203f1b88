"""The run's lifecycle: status in ``summary.json``, wall time, and signals that end a run cleanly and resumably."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lnstab import runlock
from lnstab import validation as require
from lnstab.rundir import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    SUMMARY_FILE,
    RunFileError,
    read_summary,
    run_dir,
    update_summary,
    writes_files,
)

from ._aside import bar_cleared

SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP")


class RunInterrupted(BaseException):
    """A handled signal ended the run where there was no optimizer step to wait for (the final evaluation), or a
    second Ctrl-C asked to stop at once. A ``BaseException``, like ``KeyboardInterrupt``, so that ``except
    Exception`` blocks do not swallow it; ``lnstab fit`` exits with ``128 + signum``.

    Attributes:
        signum: The signal.
        at_once: A second Ctrl-C (no checkpoint of this step was written).
    """

    def __init__(self, signum: int, at_once: bool = False) -> None:
        super().__init__(f"{signal.Signals(signum).name} received" + (" twice: stopped at once" if at_once else ""))
        self.signum, self.at_once = int(signum), at_once


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _own_last(trainer: pl.Trainer, path: Path) -> None:
    """Make each ModelCheckpoint whose ``last`` file is ``path`` its owner, before the save (its ``last_model_path``
    is part of the saved state). Otherwise a run stopped before that callback's first save leaves ``last.ckpt`` to
    this save and the callback, saving ``last`` as the stopped epoch ends, writes ``last-v1.ckpt`` beside it; the
    resumed run then keeps writing ``last-v1.ckpt`` while ``last.ckpt`` stays at the stopped step."""
    for callback in trainer.checkpoint_callbacks:
        if (isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath
                and Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}" == path):
            callback.last_model_path = str(path)


class RunStatus(Callback):
    """Keeps ``summary.json``'s ``status`` and ends a signalled run at an optimizer-step boundary, resumably.

    ``status`` (see :mod:`lnstab.rundir`) is ``running`` from ``setup`` of a fit, then, at the end of the fit (after
    the final evaluation),
    ``interrupted`` (a handled signal stopped it), ``diverged`` (a :class:`DivergenceMonitor` recorded a fatal event)
    or ``completed``; ``failed`` with the error when an exception ends it. ``final_step``, ``started_at``,
    ``ended_at`` and ``wall_s`` (summed over resumptions) go beside it. This callback is the only writer of
    ``status``.

    **Signals.** In a validate or test of its own (``lnstab validate``, ``test``, ``evaluate``) a handled signal ends it
    at once, with nothing written. In a fit, from the sanity check's start (else ``on_train_start``) to ``teardown``
    the handled signals (SIGINT = Ctrl-C, SIGTERM = a scheduler's or ``kill``'s stop, SIGUSR1 = SLURM's requeue
    signal, SIGHUP = a closed terminal or ssh session) only set a flag (a SIGTERM Lightning's own handler took before,
    as the run started, too); at the end of the next optimizer step (every rank agrees through
    ``trainer.strategy.reduce_boolean_decision``) the run saves ``checkpoints/last.ckpt`` — resumable exactly, like any
    step checkpoint — records ``status: interrupted``, ``interrupted_step`` and ``signal``, skips the validation
    Lightning would run on stopping and the final evaluation, and stops. Under SLURM, SLURM's requeue signal is then
    passed on to Lightning's own handler, which requeues the job (``scontrol requeue``). A second Ctrl-C stops at once
    (:class:`RunInterrupted`, no checkpoint of that step). Work after the last step that runs inside
    :func:`stop_at_once_on_signal` (the final evaluation) has no step boundary to wait for: a signal there ends the run
    at once, ``interrupted`` at the final step, whose ``last.ckpt`` a resume evaluates. After SIGHUP the process's
    output, if it went to the closed terminal, goes to ``/dev/null``. A run a signal stopped is recorded ``interrupted``
    even when an error follows the signal (a worker killed by the same signal, say), never ``failed``. ``lnstab fit``
    exits with ``128 + signal number`` after an interruption.

    **One owner per run directory.** On global rank zero ``setup`` takes the run directory's lock
    (:mod:`lnstab.runlock`) for the rest of the process: a second fit into a directory a live run holds is refused
    in one line before it writes anything.

    **fast_dev_run.** Lightning suppresses logging and checkpointing there (its logger is a ``DummyLogger``, so the
    run directory would be ``default_root_dir``, the current directory by default): no lock is taken and no
    ``summary.json`` or ``last.ckpt`` is written; signals still stop the run at a step boundary.

    Args:
        signals: Signal names to handle, one or a list (any of ``SIGINT``, ``SIGTERM``, ``SIGUSR1``, ``SIGHUP``);
            ``[]`` handles none.
        save_on_interrupt: Save ``last.ckpt`` when a signal stops the run.

    **Logged metrics**: none (``summary.json`` fields).

    Raises:
        ConfigError: A bad argument (the message names it).

    Example::

        trainer = Trainer(callbacks=[RunStatus(), DivergenceMonitor()])
    """

    def __init__(self, signals: str | list[str] | tuple[str, ...] = SIGNALS, save_on_interrupt: bool = True) -> None:
        self.signals = require.choices("signals", signals, SIGNALS) if signals else ()  # one name or a list
        self.save_on_interrupt = require.flag("save_on_interrupt", save_on_interrupt)
        self.requested: int | None = None  # signal received, not yet acted on
        self.signal: int | None = None  # signal that stopped the run
        self.interrupted_step: int | None = None
        self._previous: dict[int, Any] = {}
        self._started = time.monotonic()
        self._wall_before = 0.0
        self._step_at_batch_start = 0
        self._at_boundary = True  # between optimizer steps (no micro-batch of a step started and unfinished)
        self._urgent = 0  # inside stop_at_once_on_signal
        self._evaluating = False  # a validate or test of its own (no optimizer step to wait for): signals stop it now
        self._val_limit: int | float | None = None
        self._owns_dir = False
        self._before: dict[str, Any] = {}  # the run's summary before this fit
        self._began = True  # this fit got past its setup (a refusal there leaves the run's status as it was)
        self._bar_line = False  # a progress bar is drawing (a signal's line then starts on a line of its own)

    # ------------------------------------------------------------------ summary
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        self._started = time.monotonic()
        self.requested = self.signal = self.interrupted_step = None
        if trainer.is_global_zero and writes_files(trainer):  # fast_dev_run: no lock, no summary
            directory = run_dir(trainer)
            note = runlock.hold(directory)  # RunDirInUse (one line) while another live run trains here
            self._owns_dir = True
            if note:
                rank_zero_info(note)
            before = _previous_summary(directory)
            self._before, self._began = before, False
            self._wall_before = float(before.get("wall_s") or 0.0) if require.is_number(before.get("wall_s")) else 0.0
            update_summary(trainer, status="running", started_at=before.get("started_at") or _now(), ended_at=None,
                           error=None, signal=None, interrupted_step=None)
        else:
            self._owns_dir = True  # rank zero holds the lock for the run (fast_dev_run: none, and nothing is written)

    def _wall(self) -> float:
        return round(self._wall_before + time.monotonic() - self._started, 3)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._began = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Signal handlers stay until on_fit_end/teardown: the final evaluation runs after this hook (or before it,
        # by callback order) and a signal there must end the run as interrupted (stop_at_once_on_signal).
        if self._val_limit is not None:
            trainer.limit_val_batches, self._val_limit = self._val_limit, None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After every on_train_end (the final evaluation included): the status is the run's last word.
        self._restore_signals()
        if self.requested is not None and self.signal is None:
            rank_zero_info(f"lnstab: {signal.Signals(self.requested).name} came after the last step, with nothing "
                           f"left to do; the run is complete")
        diverged = [cb.diverged_step for cb in trainer.callbacks if getattr(cb, "diverged_step", None) is not None]
        if self.signal is not None:
            status = "interrupted"
        elif diverged:
            status = "diverged"
        else:
            status = "completed"
        fields: dict[str, Any] = {"status": status, "final_step": trainer.global_step, "ended_at": _now(),
                                  "wall_s": self._wall()}
        if diverged:
            fields["diverged_step"] = min(diverged)
        if self.signal is not None:
            fields.update(signal=signal.Signals(self.signal).name, interrupted_step=self.interrupted_step)
        update_summary(trainer, **fields)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_signals()
        if trainer.state.fn != TrainerFn.FITTING or not self._owns_dir:
            return  # a failed validate/test/evaluate says nothing about the run; nor does a fit refused its directory
        if not self._began and self._before.get("status") not in (None, "running"):
            # refused before it began (another callback's setup, the checkpoint's restore): nothing of the run changed
            update_summary(trainer, **{k: self._before.get(k) for k in (
                "status", "error", "final_step", "ended_at", "wall_s", "signal", "interrupted_step")})
            return
        fields: dict[str, Any] = {"error": f"{type(exception).__name__}: {exception}"[:2000],
                                  "final_step": trainer.global_step, "ended_at": _now(), "wall_s": self._wall()}
        signum = self._signal_behind(exception)
        if signum is None:
            update_summary(trainer, status="failed", **fields)
            return
        self.signal = signum
        step: int | None = trainer.global_step
        if isinstance(exception, RunInterrupted) and not exception.at_once:
            pass  # after the last step (the final evaluation): last.ckpt holds that step
        elif self._at_boundary and self.save_on_interrupt and writes_files(trainer) and trainer.world_size == 1 and \
                not isinstance(exception, KeyboardInterrupt | RunInterrupted):
            # a signal, then an error between two steps (e.g. a loader worker the same signal killed): the state is
            # that of a step boundary, so this checkpoint resumes exactly (one process only: a save may be collective)
            with contextlib.suppress(Exception):
                self._save_resumable(trainer)
        else:
            step = None  # stopped mid-step: resume from the newest checkpoint
        self.interrupted_step = step
        update_summary(trainer, status="interrupted", signal=signal.Signals(signum).name, interrupted_step=step,
                       **fields)

    def _signal_behind(self, exception: BaseException) -> int | None:
        """The signal that ended the run, if one did: a RunInterrupted, a Ctrl-C, or any error after a signal."""
        if isinstance(exception, RunInterrupted):
            return exception.signum
        if isinstance(exception, KeyboardInterrupt):
            return int(signal.SIGINT)
        return self.requested if self.requested is not None else self.signal

    # ------------------------------------------------------------------ signals
    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_over_signals(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_over_signals(trainer)

    def _take_over_signals(self, trainer: pl.Trainer) -> None:
        """Install the handlers (once a fit), and take as this callback's a SIGTERM that Lightning's own handler got
        first: Lightning puts it in after the setup hooks, and its flag ended the loop after the first step (or the
        sanity check at its next batch) with ``SIGTERMException``, a ``SystemExit`` of status 0, so a run the sweep
        stopped as its loaders started was ``failed``, exit 0, without a checkpoint."""
        if not self._previous:
            self._install_handlers(trainer)
        connector = getattr(trainer, "_signal_connector", None)
        if getattr(connector, "received_sigterm", False) and "SIGTERM" in self.signals:
            connector.received_sigterm = False
            self._handle(signal.SIGTERM, None)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # not a fit's validation: that one waits for a step boundary
            self._stop_at_once(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_at_once(trainer)  # lnstab test and evaluate (its final evaluation runs at the test's end)

    def _stop_at_once(self, trainer: pl.Trainer) -> None:
        """A validate or test has no step to stop after: a signal ends it now (:class:`RunInterrupted`), with no
        result written and the run's summary untouched (``lnstab`` exits ``128 + signal``). Before, Lightning's own
        handler took SIGTERM, printed a line and let the evaluation run to its end, exit status 0."""
        self.requested = self.signal = None
        self._evaluating = True
        if not self._previous:
            self._install_handlers(trainer)

    def _install_handlers(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        bar = trainer.progress_bar_callback
        self._bar_line = bar is not None and bar.is_enabled  # a bar may hold the terminal's line mid-way
        for name in self.signals:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == getattr(signal, "SIGHUP", None):
            _detach_from_closed_terminal()
        if self.requested is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise RunInterrupted(signum, at_once=True)  # a second Ctrl-C: stop now
        self.requested = signum
        if self._urgent or self._evaluating:
            raise RunInterrupted(signum)
        own_line = "\n" if self._bar_line else ""  # not after the bar's text on its line
        rank_zero_info(
            f"{own_line}lnstab: received {signal.Signals(signum).name}; stopping after this optimizer step with a "
            "resumable checkpoint (Ctrl-C again to stop at once, without one)"
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        self._at_boundary = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # inside gradient accumulation: not a step boundary
        self._at_boundary = True
        if not self.signals:
            return
        stop = self.requested is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        signum = self.requested if self.requested is not None else signal.SIGTERM  # another rank's signal
        self.signal, self.interrupted_step, self.requested = signum, trainer.global_step, None
        if self.save_on_interrupt and writes_files(trainer):  # fast_dev_run: Lightning saves no checkpoint either
            path = self._save_resumable(trainer)
            with bar_cleared(trainer):  # the bar may have drawn this step since the signal's line
                rank_zero_info(f"lnstab: saved {path} at step {trainer.global_step}; resume with ckpt_path={path} "
                               "(lnstab fit: --ckpt_path last)")
        trainer.should_stop = True
        # Lightning validates when a run is asked to stop; a signalled run must be quick (SLURM's grace period)
        self._val_limit, trainer.limit_val_batches = trainer.limit_val_batches, 0
        previous = self._previous.get(signum)
        if signum == signal.SIGUSR1 and SLURMEnvironment.detect() and callable(previous):
            previous(signum, None)  # Lightning's SLURM handler: requeue the job, now that the state is saved

    def _save_resumable(self, trainer: pl.Trainer) -> Path:
        """Save the whole state (optimizer, loops, callbacks) to :meth:`checkpoint_path`, owned by the checkpoint
        callback that writes ``last`` there; the path."""
        path = self.checkpoint_path(trainer)
        _own_last(trainer, path)
        trainer.save_checkpoint(path, weights_only=False)
        return path

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        """Where an interrupted run saves: the ModelCheckpoint's directory (else the run's), ``last.ckpt``."""
        callback = trainer.checkpoint_callback
        directory = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        return Path(directory or run_dir(trainer) / CHECKPOINT_DIR) / LAST_CHECKPOINT

    def _restore_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_signals()
        self._evaluating = False

    @property
    def bar_drawing(self) -> bool:
        """Whether a progress bar was drawing when the handlers went in (it may hold the terminal's line)."""
        return self._bar_line

    def raise_if_requested(self) -> None:
        """Raise :class:`RunInterrupted` if a handled signal arrived and was not acted on yet."""
        if self.requested is not None and self.signal is None:
            raise RunInterrupted(self.requested)

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` after a signal stopped the run, else 0."""
        return 128 + int(self.signal) if self.signal is not None else 0


@contextlib.contextmanager
def stop_at_once_on_signal(trainer: pl.Trainer) -> Iterator[None]:
    """Inside this block a signal the trainer's :class:`RunStatus` handles ends the run at once
    (:class:`RunInterrupted`) instead of at the next optimizer step, which would never come: for work after the last
    step, such as the final evaluation. A signal that arrived before the block raises on entry. Without a
    ``RunStatus`` (or outside the main thread) this does nothing."""
    status = next((cb for cb in trainer.callbacks if isinstance(cb, RunStatus)), None)
    if status is None or not status._previous:  # no handlers installed: signals keep their previous meaning
        yield
        return
    status.raise_if_requested()
    status._urgent += 1
    try:
        yield
    finally:
        status._urgent -= 1


def _previous_summary(directory: Path) -> dict[str, Any]:
    """The summary a resumed run continues (``{}`` for a new run). A damaged one must not stop the run that can
    repair it: it is moved aside to ``summary.damaged-<k>.json`` (nothing is lost) and the run starts a new summary,
    without the wall time and start time the old one held."""
    try:
        return read_summary(directory)
    except RunFileError as exc:
        k = 1
        while (aside := directory / f"summary.damaged-{k}.json").exists():
            k += 1
        os.replace(directory / SUMMARY_FILE, aside)
        rank_zero_info(f"lnstab: {exc}; moved to {aside.name}, and this run writes a new summary.json")
        return {}


def _detach_from_closed_terminal() -> None:
    """After SIGHUP: point stdout/stderr that are a terminal at ``/dev/null`` (writing to a hung-up terminal fails
    with EIO, which would turn a clean stop into a traceback)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if os.isatty(fd):
                    os.dup2(null, fd)
    finally:
        os.close(null)


def interrupted(trainer: pl.Trainer) -> bool:
    """Whether a :class:`RunStatus` of ``trainer`` stopped the run on a signal."""
    return any(isinstance(cb, RunStatus) and cb.signal is not None for cb in trainer.callbacks)


def trained_steps(trainer: pl.Trainer, pl_module: Any) -> int:
    """Optimizer steps behind the module's weights: ``trainer.global_step`` while fitting, else the step of the
    checkpoint the module was loaded from (``pl_module.loaded_step``, recorded by :class:`lnstab.module.GPTModule`)."""
    loaded = getattr(pl_module, "loaded_step", None)
    if trainer.state.fn == TrainerFn.FITTING or loaded is None:
        return trainer.global_step
    return int(loaded)


__all__ = ["RunInterrupted", "RunStatus", "interrupted", "stop_at_once_on_signal", "trained_steps"]
