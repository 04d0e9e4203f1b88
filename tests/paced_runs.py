"""Runs a test can catch mid-way: a callback that sleeps after every training batch for a time read from a file, so
a test signals or kills a run at a step of its choosing and then lets it (or its resumption) finish at full speed.
It changes no number a run computes."""

from __future__ import annotations

from pathlib import Path

PACE_MODULE = '''
import os, time
from pathlib import Path
from lightning.pytorch.callbacks import Callback


class Pace(Callback):
    """Sleeps after every training batch for the seconds written in $LNSTAB_TEST_PACE_FILE (no file: no sleep)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        path = os.environ.get("LNSTAB_TEST_PACE_FILE")
        pace = float(Path(path).read_text() or 0) if path and Path(path).exists() else 0.0
        if pace:
            time.sleep(pace)
'''
PACE_CALLBACK = {"class_path": "pace.Pace"}


def pace_env(tmp: Path, seconds: float) -> dict[str, str]:
    """Write ``pace.py`` and the pace file into ``tmp``; the variables a child needs to import and read them."""
    (tmp / "pace.py").write_text(PACE_MODULE)
    set_pace(tmp, seconds)
    return {"PYTHONPATH": str(tmp), "LNSTAB_TEST_PACE_FILE": str(tmp / "pace")}


def set_pace(tmp: Path, seconds: float) -> None:
    """Change the sleep of every paced run reading ``tmp/pace``, from its next batch on."""
    (tmp / "pace").write_text(str(seconds))
