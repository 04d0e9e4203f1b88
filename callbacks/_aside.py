"""Work an instrument does between training steps (the Jacobian probe): said on the progress bar while it runs, and
its time left out of :class:`~lnstab.callbacks.Throughput`'s training rates."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Per trainer: the seconds spent aside so far (weakly held, as the metric registry in _sites).
_SECONDS: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def aside_seconds(trainer: Any) -> float:
    """Seconds spent in :func:`aside` blocks of ``trainer`` since it was created."""
    try:
        return _SECONDS.get(trainer, 0.0)
    except TypeError:  # a stand-in trainer that cannot be weakly referenced
        return 0.0


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class _Bar:
    """The training bar of Lightning's TQDM progress bar (its postfix) or Rich progress bar (its description), when
    one is shown: ``say(text)`` shows ``text`` there, ``restore()`` puts back what was shown."""

    def __init__(self, trainer: Any) -> None:
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        self.tqdm = self.rich = self.before = None
        callback = getattr(trainer, "progress_bar_callback", None)
        if callback is None or not callback.is_enabled:
            return
        if isinstance(callback, TQDMProgressBar):
            try:
                self.tqdm = callback.train_progress_bar
            except TypeError:  # not created yet
                return
            self.before = self.tqdm.postfix
        elif isinstance(callback, RichProgressBar) and callback.progress is not None:
            task = next((t for t in callback.progress.tasks if t.id == callback.train_progress_bar_id), None)
            if task is not None:
                self.rich, self.task, self.before = callback.progress, task.id, task.description

    @property
    def shown(self) -> bool:
        return self.tqdm is not None or self.rich is not None

    def say(self, text: str) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix_str(text, refresh=True)
        elif self.rich is not None:
            self.rich.update(self.task, description=f"{self.before} · {text}")
            self.rich.refresh()

    def restore(self) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix_str(self.before or "", refresh=False)
        elif self.rich is not None:
            self.rich.update(self.task, description=self.before)


@contextmanager
def bar_cleared(trainer: Any) -> Iterator[None]:
    """Say a line where a drawing TQDM training bar is not: clear the bar's line, say it, draw the bar again below
    (what ``tqdm.write`` does); else the line is glued to the bar's text, which holds the terminal's line mid-way."""
    bar = _Bar(trainer).tqdm
    if bar is None or bar.disable:
        yield
        return
    bar.clear()
    try:
        yield
    finally:
        bar.refresh()


@contextmanager
def aside(trainer: Any, what: str, device: torch.device | None = None) -> Iterator[None]:
    """Run the block as work outside training: the device is synchronised before and after it (so the step's queued
    work is not counted in it), its seconds are added to :func:`aside_seconds`, and ``what`` is the training progress
    bar's postfix (TQDM) or beside its description (Rich) while it runs, or, without such a bar, a rank-zero line."""
    from lightning.pytorch.utilities import rank_zero_info

    _sync(device)
    start = time.perf_counter()
    bar = _Bar(trainer)
    if bar.shown:
        bar.say(f"{what}…")
    else:
        rank_zero_info(f"{what} at step {getattr(trainer, 'global_step', '?')}…")
    try:
        yield
    finally:
        _sync(device)
        bar.restore()
        try:
            _SECONDS[trainer] = _SECONDS.get(trainer, 0.0) + time.perf_counter() - start
        except TypeError:
            pass
