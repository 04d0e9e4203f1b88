"""Child processes that only their parent commands: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), and
signals held back while children start.

A process killed outright (SIGKILL, the out-of-memory killer, a lost ssh session) runs no clean-up code, so its
children would go on working for nobody: a sweep's ``lnstab fit`` children holding their runs' locks, a check's
worker processes training runs whose results no one will read. Arming the signal in the child makes the kernel
send it when the parent ends, however it ends. A child started while a signal is blocked inherits the block, so a
signal sent to the whole process group as it starts cannot reach it before it has set its own handling
(:func:`blocked`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterable, Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "LNSTAB_SWEEP_PARENT"  # set for a sweep's children: the pid of the sweep they must not outlive


def die_with_parent(signum: int, parent: int) -> bool:
    """In a child process: receive ``signum`` when the parent ``parent`` (its pid) ends.

    The kernel sends the signal when the *thread* that started this process ends, so start children from a thread
    that lives as long as the parent process (its main thread). If the parent is already gone when this runs, the
    signal is sent at once.

    Returns:
        Whether the signal was armed (``False`` elsewhere than Linux, or where ``prctl`` is unavailable).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    armed = False
    with contextlib.suppress(OSError, AttributeError):
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    if armed and os.getppid() != parent:  # it ended before the signal was armed
        os.kill(os.getpid(), signum)
    return armed


@contextlib.contextmanager
def blocked(signals: Iterable[int]) -> Iterator[None]:
    """Within: ``signals`` blocked in this thread (children started meanwhile inherit the mask); one that came is
    delivered when the block ends. A no-op where the OS has no ``pthread_sigmask``."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def follow_parent() -> None:
    """In a sweep's child (``$LNSTAB_SWEEP_PARENT`` set): receive SIGTERM when the sweep dies, however it dies.

    A sweep killed outright (SIGKILL, out of memory, a lost ssh session that took it down) would otherwise leave its
    children training, holding their runs' locks, and the next sweep would skip them as running. With Linux's
    parent-death signal the child gets the SIGTERM a sweep's own stop sends: it saves ``last.ckpt`` at its next step
    and ends ``interrupted``, which the next sweep resumes. The variable is removed so that processes this child
    starts (DDP ranks, loader workers) do not inherit it. Elsewhere than Linux this does nothing.
    """
    parent = os.environ.pop(PARENT_ENV, None)
    if parent and parent.isdigit():
        die_with_parent(signal.SIGTERM, int(parent))
