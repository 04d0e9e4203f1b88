"""Reusable Lightning callbacks that measure the stability of a Transformer while it trains.

Every callback finds lnstab's residual modules by name by default and works on other models through a module-name regex
(``layer_pattern``) or module types; see each class's docstring for its metrics. The attention and output-logit
instruments find q, k and the logits of lnstab's GPT and of Hugging Face GPT-2, Llama, Gemma, Mistral, Mixtral, Qwen2,
Qwen3, Gemma 2, Gemma 3 and OLMo 2 themselves (:mod:`lnstab.callbacks._captures`), or of any model through module-name
patterns. The activation instruments share one tap per model and read the statistics registry (:class:`Statistic`,
:func:`register_statistic`); :func:`unsharded` gives any callback a full-parameter view of the model under every served
strategy.
"""

from ._stats import SiteView, Statistic
from ._stats import register as register_statistic
from ._strategy import unsharded
from .attention import AttentionLogitStatistics
from .checkpoint import RunCheckpoint
from .divergence import DivergenceMonitor, NonFiniteCheckpointError
from .grad_stats import GradientStatistics
from .growth_bound import GrowthBoundMonitor
from .hidden_stats import HiddenStateStatistics
from .jacobian import JacobianSensitivity, spectral_norm
from .layout import StabilityLayout, stability_layout
from .output_logits import OutputLogitStatistics
from .progress import StepProgressBar
from .run_status import RunStatus
from .suite import Instruments
from .throughput import Throughput

__all__ = [
    "AttentionLogitStatistics",
    "DivergenceMonitor",
    "FinalEvaluation",
    "GradientStatistics",
    "GrowthBoundMonitor",
    "HiddenStateStatistics",
    "Instruments",
    "JacobianSensitivity",
    "NonFiniteCheckpointError",
    "OutputLogitStatistics",
    "RunCheckpoint",
    "RunStatus",
    "SiteView",
    "StabilityLayout",
    "Statistic",
    "StepProgressBar",
    "Throughput",
    "register_statistic",
    "spectral_norm",
    "stability_layout",
    "unsharded",
]


def __getattr__(name: str):
    # FinalEvaluation scores lnstab's own GPT (it imports the model and the metric packages), so it is loaded only
    # when asked for: the instruments above stay free of lnstab's model.
    if name == "FinalEvaluation":
        from lnstab.evaluation.callback import FinalEvaluation

        return FinalEvaluation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
