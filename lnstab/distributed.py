"""End a gloo process group while the interpreter is still whole, and what that cannot do.

Lightning ends an NCCL process group at exit (an ``atexit`` handler) but leaves a gloo group to the interpreter's
finalization. ``import lnstab`` registers :func:`end_gloo_group` with ``atexit``, once per process (a module runs
once): it destroys the default process group if it is still initialised and gloo-backed, and is a no-op in a process
that never starts one. Destroying a gloo group is local to the rank (no collective; it waits only for work this rank
has already queued), so a rank whose peers have already gone still exits.

**The abort at exit, and its cause.** A rank of a completed CPU run sometimes aborted at exit ("terminate called
without an active exception", then SIGABRT; about one full test run in eight here). Its precondition, checked in the
spawned ranks of a two-process FSDP fit: after ``destroy_process_group()`` gloo's worker threads (two
``pt_gloo_runloop``) and its ``gloo_tcp_loop`` thread are still running, because the model still references the group
(FSDP's modules and ``_ExecOrderData``, reachable from Lightning's strategy and trainer until the end), so the C++
group, whose destructor would stop them, is not destroyed, and ``shutdown()`` does not stop them. By PyTorch's c10d
developers' account of this abort, a worker that then drops the last reference to a finished collective's tensor must
take the GIL to free its Python object, and in a finalising interpreter that thread is ended inside a C++ destructor
(``std::terminate``). The abort was too rare to catch on demand (none in 33 stress runs), so that last step is theirs,
not observed here. It lives in torch/gloo; lnstab cannot stop those threads while the model holds the group. What a
completed run has written is not at risk (summary, checkpoints and events are written atomically before the exit); the
rank's exit status is. lnstab's tests end their spawned ranks with ``os._exit(0)`` once their results are handed over
(``tests/fsdp_cpu.py``), as ``multiprocessing``'s fork-started children always end, which removes the precondition;
``lnstab fit``'s own DDP ranks (Lightning's subprocess launcher, torchrun, srun) still end through finalisation, so they
remain exposed.

Every process that runs lnstab's trainer or callbacks — including ranks started by ``ddp_spawn``, which import lnstab
when they unpickle the trainer — has the handler. Lightning's own ``_destroy_dist_connection`` is not reused: importing
it would import torch and Lightning at ``import lnstab``, and it resets SIGINT to the default instead of restoring the
previous handler.
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

