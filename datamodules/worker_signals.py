"""DataLoader workers and the stop signals of a job: a worker ignores what a scheduler or a terminal sends to the whole
process group, ends only when its parent asks, and is forked with those signals blocked
(:func:`ignore_stop_signals`, :class:`SignalSafeDataLoader`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from lnstab.parentdeath import blocked

# Signals a scheduler or a terminal sends to every process of a job or process group. Only the main process acts on
# them (at an optimizer-step boundary, see lnstab.callbacks.RunStatus); a DataLoader worker must not, and it would by
# default: fork gives it the parent's Python handlers (Lightning's SLURM requeue handler on SIGUSR1 among them, which
# then tries to save a checkpoint from inside the worker), and the default action of each is to end the process.
WORKER_IGNORED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, n))
_BLOCKED_AT_FORK = (*WORKER_IGNORED, signal.SIGTERM)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker takes no action on the stop signals of a job or a terminal, only on its parent's SIGTERM.

    SIGINT (Ctrl-C in a terminal), SIGUSR1/SIGUSR2 (SLURM's ``--signal`` and ``scancel -s`` reach every process of a
    step) and SIGHUP (a closed terminal) are ignored. SIGTERM is taken by a thread that ends the worker only when the
    signal comes from its parent (the DataLoader's shutdown, or ``multiprocessing``'s clean-up at exit, which
    terminates and then waits for its daemonic children: a worker that ignored that SIGTERM would hang the parent's
    exit for ever); a scheduler's SIGTERM to the whole job is left to the main process. Where the OS cannot say who sent
    a signal (no ``sigwaitinfo``), SIGTERM keeps its default action.

    :class:`SignalSafeDataLoader` starts its workers with these signals blocked, so none is delivered between the
    fork and this function; they are unblocked here, once ignored (pending ones are then discarded).
    """
    for signum in WORKER_IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):
        parent = os.getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask

        def stop_when_the_parent_asks() -> None:
            while True:
                if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                    os._exit(0)

        threading.Thread(target=stop_when_the_parent_asks, name="lnstab-worker-sigterm", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(WORKER_IGNORED))
    else:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_BLOCKED_AT_FORK))


class SignalSafeDataLoader(DataLoader):
    """A ``DataLoader`` whose worker processes are forked with the job's stop signals blocked.

    Without this, a signal that reaches the whole process group in the instant between a worker's fork and its
    ``worker_init_fn`` (:func:`ignore_stop_signals`) would run the parent's handler in the worker or kill it. The
    signals are blocked in the calling thread only while the iterator starts its workers; one that arrives meanwhile
    is delivered to the main process as soon as the workers exist.
    """

    def __init__(self, *args: Any, before_iter: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """``before_iter``: called as each iteration (each epoch) starts, before workers copy the dataset."""
        self.before_iter = before_iter
        super().__init__(*args, **kwargs)

    def __iter__(self):  # noqa: ANN204 - the DataLoader's iterator type is private
        if self.before_iter is not None:
            self.before_iter()
        if not self.num_workers or threading.current_thread() is not threading.main_thread():
            return super().__iter__()
        with blocked(_BLOCKED_AT_FORK):
            return super().__iter__()
