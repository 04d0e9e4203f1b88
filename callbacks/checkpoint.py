"""``RunCheckpoint``: Lightning's ModelCheckpoint that never writes non-finite weights over a good checkpoint."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lnstab.rundir import writes_files

from .run_status import interrupted


def weights_finite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether every parameter of ``pl_module`` is finite on every rank (one fused norm, one host sync, and one
    collective decision when several ranks hold (shards of) the weights)."""
    params = [p.detach() for p in pl_module.parameters() if p.numel()]
    finite = bool(torch.isfinite(torch.stack(torch._foreach_norm(params)).sum()).item()) if params else True
    if trainer.world_size > 1:
        finite = not trainer.strategy.reduce_boolean_decision(not finite, all=False)
    return finite


class RunCheckpoint(ModelCheckpoint):
    """:class:`~lightning.pytorch.callbacks.ModelCheckpoint` (same arguments) that skips a save when the weights
    are not finite, so a diverged run keeps its last good checkpoint instead of crashing or overwriting it.

    The check runs only when this callback may save (a step that is a multiple of ``every_n_train_steps``, the end
    of an epoch, the end of a validation): one fused norm over the parameters and one host sync then. With
    ``save_last``, ``last`` is also saved when training ends at a step not saved yet, so it holds the final weights.
    Under ``fast_dev_run`` it writes nothing: Lightning's own ``save_last`` save at the end of training does not check
    ``fast_dev_run`` (Lightning 2.6), and wrote ``checkpoints/last.ckpt`` into the current directory.

    **Logged metrics**: none.

    Example::

        trainer = Trainer(callbacks=[RunCheckpoint(save_last=True, every_n_train_steps=2000)])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped_nonfinite = 0
        self.resuming = ""  # the checkpoint a fit resumes from (set by lnstab fit --ckpt_path)

    def _finite(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if weights_finite(trainer, pl_module):
            return True
        if not self.skipped_nonfinite:
            rank_zero_warn(
                f"RunCheckpoint: the weights are not finite at step {trainer.global_step}; no checkpoint is written "
                f"from now on (the last good one is kept)"
            )
        self.skipped_nonfinite += 1
        return False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            if self.resuming:  # a resume finds its own checkpoints there: Lightning warned on every one
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)
        if self.dirpath and "://" not in str(self.dirpath):  # saved absolute: a resume from anywhere finds it equal
            self.dirpath = os.path.abspath(self.dirpath)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint saved with a relative dirpath ("runs/x/version_0/checkpoints") read back under the same
        # directory named absolutely, or a resume from this directory's own checkpoint after the run was moved:
        # Lightning warned "The dirpath has changed", forgot last_model_path, and the resumed run wrote last-v1.ckpt
        # beside last.ckpt, which stayed at the resumed step.
        saved = state_dict.get("dirpath")
        own = bool(self.resuming) and os.path.realpath(os.path.dirname(self.resuming)) == os.path.realpath(
            self.dirpath or "")
        if (saved and self.dirpath and saved != self.dirpath and "://" not in str(saved)
                and (own or os.path.realpath(saved) == os.path.realpath(self.dirpath))):
            def here(path: Any) -> Any:
                inside = isinstance(path, str) and path and os.path.realpath(os.path.dirname(path)) == os.path.realpath(
                    saved)
                return os.path.join(self.dirpath, os.path.basename(path)) if inside else path

            state_dict = {**state_dict, "dirpath": self.dirpath,
                          **{k: here(state_dict[k]) for k in ("best_model_path", "kth_best_model_path",
                                                              "last_model_path") if k in state_dict},
                          "best_k_models": {here(k): v for k, v in (state_dict.get("best_k_models") or {}).items()}}
        super().load_state_dict(state_dict)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self.every_n_train_steps or 0
        if every < 1 or trainer.global_step % every or self._finite(trainer, pl_module):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._finite(trainer, pl_module):
            super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning saves `last` here when nothing was saved yet: weights that went non-finite before the first
        # periodic checkpoint (policy continue) made that save raise, and a divergence end as a crash (exit 1);
        # under fast_dev_run Lightning saves nothing else, yet this save of `last` does not ask
        if not writes_files(trainer) or not self._finite(trainer, pl_module):
            return
        super().on_train_end(trainer, pl_module)
        # ... and only then: with max_steps not a multiple of every_n_train_steps a finished run's last.ckpt held an
        # earlier step's weights than its evaluation (7 steps, every 5: step 5). A signal's own save is at this step.
        if self.save_last and self._last_global_step_saved != trainer.global_step and not interrupted(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._finite(trainer, pl_module):
            super().on_validation_end(trainer, pl_module)

    @property
    def every_n_train_steps(self) -> int | None:
        """The ``every_n_train_steps`` this callback was built with."""
        return self._every_n_train_steps
