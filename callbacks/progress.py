"""``StepProgressBar``: a progress bar that counts optimizer steps towards ``max_steps``, resumed runs included."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lnstab import validation as require


class StepProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, but for step-bounded training (``max_steps``, endless data) it shows
    ``global_step / max_steps``: Lightning's own bar counts the batches of the current epoch against the steps
    *remaining*, so a resumed run showed e.g. ``200/79``, and counts micro-batches under gradient accumulation.
    Epoch-bounded training is shown as Lightning shows it. Plain TQDM (no terminal control codes) also reads well in
    a scheduler's log file.

    Args:
        refresh_rate: Redraw every this many batches (0: no bar), as Lightning's ``TQDMProgressBar``.
        process_position: Lines above the bar (for several bars at once), as Lightning's.
        leave: Keep each epoch's bar after it ends, as Lightning's.

    **Logged metrics**: none.

    Example::

        trainer = Trainer(max_steps=60_000, callbacks=[StepProgressBar()])
    """

    position: tuple[int, int | float | None] | None = None  # (shown, total) after the latest training batch

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(require.integer("refresh_rate", refresh_rate, 0),  # 0: no bar, as Lightning's
                         require.integer("process_position", process_position, 0), require.flag("leave", leave))

    def _by_steps(self) -> bool:
        trainer = self.trainer
        return trainer.max_steps is not None and trainer.max_steps > 0 and not math.isfinite(
            float(trainer.num_training_batches)
        )

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    @property
    @override
    def train_description(self) -> str:
        return "Training steps" if self._by_steps() else super().train_description

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._by_steps():
            super().on_train_epoch_start(trainer, *args)
            return
        # Lightning's reset draws the bar as "Epoch 0: 0/<steps left>" before any description could be set: a line
        # that stayed in logs (and the terminal's scrollback) above the real bar. Drawn once, as it will stay.
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.initial = 0
        bar.set_description(self.train_description, refresh=False)
        bar.reset(total=trainer.max_steps)
        if trainer.global_step:
            bar.n = trainer.global_step  # where a resumed run starts
            bar.refresh()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._by_steps():
            batch_idx = trainer.global_step - 1  # the bar's position is the optimizer step, not the batch
            if self.train_progress_bar is not None and self.train_progress_bar.total != trainer.max_steps:
                self.train_progress_bar.total = trainer.max_steps  # a run resumed mid-epoch skips the epoch start
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        self.position = (bar.n, bar.total) if bar is not None else None
