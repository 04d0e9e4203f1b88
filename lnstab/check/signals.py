"""What a signal does to ``lnstab check``: SIGINT (Ctrl-C), SIGTERM and SIGHUP end it at once (a check has nothing
to resume), with no verdict: :class:`Interrupted` is raised in the main thread, and a write that must be whole holds
the signal back until it is done (:func:`deferred`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_held: dict[str, int | None] = {"depth": 0, "signum": None}


class Interrupted(BaseException):
    """A signal ended the check (a ``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` of a
    model's or of Lightning's swallows it).

    Attributes:
        signum: The signal.
        where: What the check leaves behind, in words, for the one line ``lnstab check`` prints.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum
        self.where = ""


def _raise(signum: int, frame: object) -> None:
    if _held["depth"]:
        _held["signum"] = _held["signum"] or signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (only in the main thread, where Python runs
    signal handlers; elsewhere this changes nothing). The previous handlers come back at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise) for signum in HANDLED}
    try:
        yield
    finally:
        _held["signum"] = None
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within: a signal is held back, and raised as :class:`Interrupted` once the block is done (never inside it)."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
    if not _held["depth"] and _held["signum"] is not None:
        signum, _held["signum"] = _held["signum"], None
        raise Interrupted(signum)
