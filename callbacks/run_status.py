"""The run's lifecycle: status in ``summary.json``, wall time, and signals that end a run cleanly and resumably."""

from __future__ import annotations

import datetime as dt
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lnstab import validation as check
from lnstab.rundir import CHECKPOINT_DIR, LAST_CHECKPOINT, read_summary, run_dir, update_summary

SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class RunStatus(Callback):
    """Keeps ``summary.json``'s ``status`` and ends a signalled run at an optimizer-step boundary, resumably.

    ``status`` (see :mod:`lnstab.rundir`) is ``running`` from ``setup`` of a fit, then, at the end of the fit (after
    the final evaluation),
    ``interrupted`` (a handled signal stopped it), ``diverged`` (a :class:`DivergenceMonitor` recorded a fatal event)
    or ``completed``; ``failed`` with the error when an exception ends it. ``final_step``, ``started_at``,
    ``ended_at`` and ``wall_s`` (summed over resumptions) go beside it. This callback is the only writer of
    ``status``.

    **Signals.** From ``on_train_start`` to ``teardown`` the handled signals (SIGINT = Ctrl-C, SIGTERM = a
    scheduler's or ``kill``'s stop, SIGUSR1 = SLURM's requeue signal) only set a flag; at the end of the next
    optimizer step (every rank agrees through ``trainer.strategy.reduce_boolean_decision``) the run saves
    ``checkpoints/last.ckpt`` — resumable exactly, like any step checkpoint — records ``status: interrupted``,
    ``interrupted_step`` and ``signal``, skips the validation Lightning would run on stopping and the final
    evaluation, and stops. Under SLURM, SLURM's requeue signal is
    then passed on to Lightning's own handler, which requeues the job (``scontrol requeue``). A second Ctrl-C stops
    at once (``KeyboardInterrupt``, no checkpoint). ``lnstab fit`` exits with ``128 + signal number`` after an
    interruption.

    Args:
        signals: Signal names to handle (any of ``SIGINT``, ``SIGTERM``, ``SIGUSR1``); ``[]`` handles none.
        save_on_interrupt: Save ``last.ckpt`` when a signal stops the run.

    **Logged metrics**: none (``summary.json`` fields).

    Raises:
        ConfigError: A bad argument (the message names it).

    Example::

        trainer = Trainer(callbacks=[RunStatus(), DivergenceMonitor()])
    """

    def __init__(self, signals: list[str] | tuple[str, ...] = SIGNALS, save_on_interrupt: bool = True) -> None:
        self.signals = check.choices("signals", list(signals), SIGNALS) if signals else ()
        self.save_on_interrupt = bool(save_on_interrupt)
        self.requested: int | None = None  # signal received, not yet acted on
        self.signal: int | None = None  # signal that stopped the run
        self.interrupted_step: int | None = None
        self._previous: dict[int, Any] = {}
        self._started = time.monotonic()
        self._wall_before = 0.0
        self._step_at_batch_start = 0
        self._val_limit: int | float | None = None

    # ------------------------------------------------------------------ summary
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        self._started = time.monotonic()
        self.requested = self.signal = self.interrupted_step = None
        if trainer.is_global_zero:
            before = read_summary(run_dir(trainer))
            self._wall_before = float(before.get("wall_s") or 0.0)
            update_summary(trainer, status="running", started_at=before.get("started_at") or _now(), ended_at=None,
                           error=None, signal=None, interrupted_step=None)

    def _wall(self) -> float:
        return round(self._wall_before + time.monotonic() - self._started, 3)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_signals()
        if self._val_limit is not None:
            trainer.limit_val_batches, self._val_limit = self._val_limit, None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After every on_train_end (the final evaluation included): the status is the run's last word.
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
        if trainer.state.fn != TrainerFn.FITTING:
            return  # a failed validate/test/evaluate says nothing about the run that trained the checkpoint
        interrupted = isinstance(exception, KeyboardInterrupt)
        update_summary(
            trainer,
            status="interrupted" if interrupted else "failed",
            error=f"{type(exception).__name__}: {exception}"[:2000],
            final_step=trainer.global_step,
            ended_at=_now(),
            wall_s=self._wall(),
            **({"signal": "SIGINT", "interrupted_step": None} if interrupted else {}),
        )

    # ------------------------------------------------------------------ signals
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for name in self.signals:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = signum
        rank_zero_info(
            f"lnstab: received {signal.Signals(signum).name}; stopping after this optimizer step with a resumable "
            f"checkpoint (Ctrl-C again to stop at once, without one)"
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.signals or trainer.global_step == self._step_at_batch_start:
            return  # inside gradient accumulation: not a step boundary
        stop = self.requested is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        signum = self.requested if self.requested is not None else signal.SIGTERM  # another rank's signal
        self.signal, self.interrupted_step, self.requested = signum, trainer.global_step, None
        if self.save_on_interrupt:
            path = self.checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            rank_zero_info(f"lnstab: saved {path} at step {trainer.global_step}; resume with --ckpt_path last")
        trainer.should_stop = True
        # Lightning validates when a run is asked to stop; a signalled run must be quick (SLURM's grace period)
        self._val_limit, trainer.limit_val_batches = trainer.limit_val_batches, 0
        previous = self._previous.get(signum)
        if signum == signal.SIGUSR1 and SLURMEnvironment.detect() and callable(previous):
            previous(signum, None)  # Lightning's SLURM handler: requeue the job, now that the state is saved

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

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` after a signal stopped the run, else 0."""
        return 128 + int(self.signal) if self.signal is not None else 0


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


__all__ = ["RunStatus", "interrupted", "trained_steps"]
