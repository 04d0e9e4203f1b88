"""End a gloo process group while the interpreter is still whole (``lnstab fit`` once its trainer has finished;
``import lnstab`` registers it with ``atexit`` for every other way out).

Why Lightning's own handler is not reused, and what this cannot do (gloo's threads outliving the group, the rare
SIGABRT at exit): docs/robustness.md, "A gloo group at interpreter exit".
"""

from __future__ import annotations

import signal
import sys
import threading


def end_gloo_group() -> bool:
    """Destroy the default process group if it is initialised and gloo-backed; True if one was destroyed.

    SIGINT is ignored meanwhile (from the main thread), so a second Ctrl+C cannot leave the group half destroyed.
    """
    dist = sys.modules.get("torch.distributed")  # never imports torch: a process without it has no group to end
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return False
    # getsignal is None for a handler installed outside Python: leave that one alone
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dist.destroy_process_group()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return True

