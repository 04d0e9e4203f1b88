"""``lnstab check``: a stability report card for any Transformer, measured beside Pre-LN and Peri-LN references.

Entry point: :func:`lnstab.check.cli.main`; criteria: :mod:`lnstab.check.criteria` (thresholds in
``thresholds.yaml``); the validation against published outcomes (``--validate``): :mod:`lnstab.check.validation`.
"""

from typing import Any

from lnstab.check.criteria import CRITERIA, DEFAULT_THRESHOLDS, load_thresholds
from lnstab.check.protocol import Protocol
from lnstab.check.runspec import Optimisation, Sites

__all__ = ["CRITERIA", "DEFAULT_THRESHOLDS", "Optimisation", "Protocol", "Sites", "StressModule", "load_thresholds"]


def __getattr__(name: str) -> Any:
    # StressModule is a LightningModule: imported when asked for, so that the check's parent process (which never
    # trains) starts without Lightning.
    if name == "StressModule":
        from lnstab.check.training import StressModule

        return StressModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
