"""Lightning's FSDPStrategy on CPU processes (gloo), for tests: the plain class refuses the CPU accelerator and gives
FSDP no device (FSDP then asks for a GPU), so this subclass passes ``device_id=cpu``, spawns its processes like
``ddp_spawn`` and does not copy the (sharded) weights back into the parent process. Everything else — wrapping each
unit of ``auto_wrap_policy``, ``use_orig_params=True``, optimizer set-up, the training loop, gradient reduce-scatter —
is Lightning's and torch's own code path."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.fsdp import FullyShardedDataParallel


class _Launcher(_MultiProcessingLauncher):
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
