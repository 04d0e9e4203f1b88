"""The ladder's stress runs in this process or in spawned worker processes (``--workers``), one torch thread each;
why, and how they take signals: ARCHITECTURE.md's ``lnstab/check/`` section."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lnstab.check import cache
from lnstab.check.runspec import exit_call, exits_caught
from lnstab.errors import first_line
from lnstab.parentdeath import blocked, die_with_parent

AUTO_MAX_WORKERS = 4
# Signals only the parent acts on: blocked in the workers from their first instruction (inherited through the spawn).
PARENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                       if hasattr(signal, name))


def auto_workers(runs: int, threads: int) -> int:
    """Workers for ``runs`` runs on ``threads`` torch threads: one per thread up to 4 (1 for under 4 runs)."""
    return 1 if runs < 4 else max(1, min(AUTO_MAX_WORKERS, threads, runs))


@dataclass
class Job:
    """One stress run to do: the subject (with its recipe), the rung, and every protocol setting."""

    index: int
    subject: Any
    lr: float
    seed: int
    settings: dict[str, Any]
    tokens: torch.Tensor
    log_root: Path
    cache: Path | None = None  # where reference runs are kept between cards (lnstab.check.cache); None: not kept

    def __getstate__(self) -> dict[str, Any]:
        # By value: a tensor pickled for another process would be shared through a file descriptor that the worker
        # fetches from the parent when it unpickles the job, so a parent gone by then leaves it a traceback.
        return {**self.__dict__, "tokens": self.tokens.numpy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "tokens": torch.from_numpy(state["tokens"])})


@dataclass
class Failure:
    """A run that raised in a worker: what the parent's error line says and the worker's traceback."""

    index: int
    exc_type: str
    first_line: str
    traceback: str

    @classmethod
    def of(cls, index: int, exc: BaseException, exc_type: str = "", first: str | None = None) -> Failure:
        """The failure of job ``index`` that raised ``exc`` (its type and first line unless given)."""
        return cls(index, exc_type or type(exc).__name__, first_line(exc) if first is None else first,
                   "".join(traceback.format_exception(exc)))


def run_job(job: Job) -> Any:
    """Build the seeded model and train it (in this process or a worker); the ``RunResult``, or a
    :class:`Failure` when the model (or the check) raised, or ended the process (``sys.exit``, ``os._exit``)."""
    from lnstab.check.training import stress_run

    key = cache.run_key(job, torch.get_num_threads())
    if key is not None and (kept := cache.load(job, key)) is not None:
        return kept
    try:
        with exits_caught():
            torch.manual_seed(job.seed)
            model = job.subject.build()
            if not any(p.requires_grad for p in model.parameters()):
                raise ValueError("the model has no trainable parameters")
            with quiet():
                result = stress_run(job.subject.key, model, job.subject.sites, job.tokens, lr=job.lr, seed=job.seed,
                                    log_root=job.log_root, z_loss=job.subject.z_loss, **job.settings)
            if key is not None:
                cache.store(job.cache, key, result)
            return result
    except SystemExit as exc:  # would pass `except Exception` and end the check with the model's status (0: a pass)
        if isinstance(exc.__context__, KeyboardInterrupt):  # Lightning's fit turns one into sys.exit(1)
            return Failure.of(job.index, exc, "KeyboardInterrupt", "the model raised KeyboardInterrupt during "
                              "training, which Lightning's fit ends with sys.exit(1)")
        return Failure.of(job.index, exc, "SystemExit", f"the model ended the process during training "
                          f"({exit_call(exc)})")
    except Exception as exc:
        return Failure.of(job.index, exc)


def _start_worker(path: list[str], threads: int, parent: int) -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)  # already blocked where the spawn passed the mask on
    die_with_parent(signal.SIGKILL, parent)  # a worker holds nothing worth saving
    for entry in reversed(path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    torch.set_num_threads(threads)
    from tqdm.std import TqdmDefaultWriteLock

    # tqdm (the data module's Hugging Face reader uses it) would create a named multiprocessing semaphore here, which a
    # worker killed on a failed check leaks (a resource_tracker warning at the parent's exit); threads-only locking
    TqdmDefaultWriteLock.mp_lock = None
    import lnstab.check.training  # noqa: F401  (the heavy imports, at once)


def _ready() -> int:
    return os.getpid()


class RunPool:
    """Runs :class:`Job` s in order in this process (``workers=1``) or in ``workers`` spawned processes.

    Use as a context manager; the pool starts its workers at once, so they import lnstab while the caller prepares
    the runs. Leaving the context normally lets the workers finish and exit in the background; leaving it on an
    exception (a failed run, a signal, Ctrl-C) kills them at once.

    Args:
        workers: Processes; 1 runs everything in this process.
        threads: torch threads per worker (this process keeps its own setting).
    """

    def __init__(self, workers: int, threads: int = 1) -> None:
        self.finished = 0  # jobs done, for a line on an interrupted check
        self.executor: ProcessPoolExecutor | None = None
        self.processes: list[multiprocessing.process.BaseProcess] = []
        if workers > 1:
            before = set(multiprocessing.active_children())
            self.executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=([p for p in sys.path if p] + [os.getcwd()], threads, os.getpid()))
            try:
                with blocked(PARENT_SIGNALS):  # the spawned workers inherit the mask; a signal meanwhile waits here
                    for _ in range(workers):  # each submit starts one worker (none is idle yet)
                        self.executor.submit(_ready)
            except BaseException:  # a signal taken as the mask came back: the context is never entered
                self._found(before)
                self.__exit__(*sys.exc_info())
                raise
            self._found(before)

    def _found(self, before: set[Any]) -> None:
        self.processes = [p for p in multiprocessing.active_children() if p not in before]

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.executor is None:
            return
        if exc[0] is not None:
            self.kill()
        self.executor.shutdown(wait=exc[0] is not None, cancel_futures=True)

    def kill(self) -> None:
        """End every worker now (SIGKILL: a worker holds nothing worth saving)."""
        for process in self.processes:
            with contextlib.suppress(OSError, ValueError):
                process.kill()
        for process in self.processes:
            with contextlib.suppress(OSError, ValueError):
                process.join(timeout=10)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker (in this process when there is none): its result, or what it raised.
        For work that needs the workers' imports (Lightning: the data module); ``fn`` must return something that
        pickles by value (no tensors: numpy arrays)."""
        if self.executor is None:
            return fn(*args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs).result()  # a signal's handler interrupts the wait, as in run()

    def run(self, jobs: list[Job], done: Callable[[Job, Any], None]) -> list[Any]:
        """Every job's result in job order; ``done(job, result)`` after each (e.g. a progress bar). The first
        :class:`Failure` stops the rest and is returned in place of its result."""
        results: list[Any] = [None] * len(jobs)
        futures = {} if self.executor is None else {self.executor.submit(run_job, job): job for job in jobs}
        # here one after the other in order; in the workers as each ends
        ended = ((job, run_job(job)) for job in jobs) if self.executor is None else (
            (futures[f], _outcome(f, futures[f])) for f in as_completed(futures))
        for job, result in ended:
            results[job.index] = result
            self.finished += 1
            done(job, result)
            if isinstance(result, Failure):
                for future in futures:
                    future.cancel()
                break
        return results


def _outcome(future: Future, job: Job) -> Any:
    try:
        return future.result()
    except Exception as exc:  # the worker died (killed, out of memory): the check failed
        return Failure.of(job.index, exc)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's per-fit chatter (devices, tips, ``max_steps`` reached) and routine warnings, silenced."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric", "lnstab")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
