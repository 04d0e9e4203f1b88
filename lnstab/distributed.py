"""End a gloo process group while the interpreter is still whole.

Lightning ends an NCCL process group at exit (an ``atexit`` handler) but leaves a gloo group to the interpreter's
finalization. There, by PyTorch's c10d developers' account, gloo's worker threads can still hold work objects whose
tensors reference Python objects, and freeing them once the interpreter is half torn down aborts the process
("terminate called without an active exception", then SIGABRT) after a run that completed. Our two-process CPU tests
saw such aborts about one run in eight in earlier sessions. This handler is not the whole cure: a test run with it
still had one (in an FSDP test); the tests retry that failure only.

``import lnstab`` registers :func:`end_gloo_group` with ``atexit``, once per process (a module runs once): it
destroys the default process group if it is still initialised and gloo-backed, and is a no-op in a process that never
starts one. Destroying a gloo group is local to the rank (no collective; it waits only for work this rank has already
queued), so a rank whose peers have already gone still exits. Every process that runs lnstab's trainer or callbacks —
including ranks started by ``ddp_spawn``, which import lnstab when they unpickle the trainer — has it. Lightning's own
``_destroy_dist_connection`` is not reused: importing it would import torch and Lightning at ``import lnstab``, and it
resets SIGINT to the default instead of restoring the previous handler.
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

