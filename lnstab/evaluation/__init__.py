"""Final evaluation: validation loss, two perplexities, ROUGE-1/2/L and BERTScore P/R/F1.

- :mod:`~lnstab.evaluation.settings`: :class:`EvalSettings`, the one place the settings are declared; it feeds the
  callback, :func:`evaluate_model` and ``lnstab evaluate``'s ``--evaluation.*`` flags.
- :mod:`~lnstab.evaluation.core`: :func:`evaluate_model` (plain torch, sharded over ranks) and ``eval.json``.
- :mod:`~lnstab.evaluation.metrics`: ROUGE and BERTScore through their reference packages, offline by default.
- :mod:`~lnstab.evaluation.callback`: :class:`FinalEvaluation`, the Lightning callback (end of fit / test).
"""

from lnstab.evaluation.core import (
    METRICS,
    SCHEMA_VERSION,
    eval_scalars,
    evaluate_model,
    safe_exp,
    select_windows,
    write_eval_json,
)
from lnstab.evaluation.settings import PROTOCOLS, EvalSettings

__all__ = [
    "METRICS",
    "PROTOCOLS",
    "SCHEMA_VERSION",
    "EvalSettings",
    "FinalEvaluation",
    "eval_scalars",
    "evaluate_model",
    "safe_exp",
    "select_windows",
    "write_eval_json",
]


def __getattr__(name: str):
    if name == "FinalEvaluation":  # a Lightning callback: imported when asked for
        from lnstab.evaluation.callback import FinalEvaluation

        return FinalEvaluation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
