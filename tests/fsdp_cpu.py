"""Lightning's FSDP and DDP strategies on CPU processes (gloo) started with ``spawn``, for tests.

The plain FSDP class refuses the CPU accelerator and gives FSDP no device (FSDP then asks for a GPU), so
:class:`CPUFSDPStrategy` passes ``device_id=cpu``, spawns its processes like ``ddp_spawn`` and does not copy the
(sharded) weights back into the parent process. Everything else — wrapping each unit of ``auto_wrap_policy``,
``use_orig_params=True``, optimizer set-up, the training loop, gradient reduce-scatter — is Lightning's and torch's own
code path. :class:`CPUDDPSpawnStrategy` is Lightning's ``ddp_spawn`` as it is.

Both launchers end a rank that has finished, and handed its results to the parent (a ``SimpleQueue``, written
synchronously), with ``os._exit(0)``, as ``multiprocessing``'s fork-started children always end, instead of through
the interpreter's finalisation. There, gloo's worker threads are still running: ``destroy_process_group()`` does not
stop them while the model still references the group (FSDP's and DDP's modules, reachable from Lightning's strategy
and trainer until the end; checked: two ``pt_gloo_runloop`` threads and ``gloo_tcp_loop`` are alive after it in
each rank), and a worker that drops the last reference to a finished collective's tensor then takes the GIL of a
finalising interpreter, is ended with ``pthread_exit`` inside a C++ destructor, and the process aborts ("terminate
called without an active exception", SIGABRT): the rare abort of our two-process tests after a passing run.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.fsdp import FullyShardedDataParallel


class _CleanExitLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher whose ranks end with ``os._exit(0)`` once their work and results are done (module
    docstring); a rank that raises ends as before (torch reports its traceback to the parent, exit code 1)."""

    def _wrapping_function(self, *args, **kwargs) -> None:
        super()._wrapping_function(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class _Launcher(_CleanExitLauncher):
    def _recover_results_in_main_process(self, worker_output, trainer) -> None:
        if worker_output.weights_path is not None:
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)


class CPUFSDPStrategy(FSDPStrategy):
    """:class:`FSDPStrategy` for ``accelerator="cpu"`` (tests only)."""

    def _configure_launcher(self) -> None:
        self._launcher = _Launcher(self, start_method="spawn")

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class CPUDDPSpawnStrategy(DDPStrategy):
    """``ddp_spawn`` on CPU processes whose ranks end without the interpreter's finalisation (tests only)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(start_method="spawn", **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = _CleanExitLauncher(self, start_method="spawn")
