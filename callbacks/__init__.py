"""Reusable Lightning callbacks that measure the stability of a Transformer while it trains.

Every callback finds lnstab's residual modules by name by default and works on other models through a module-name regex
(``layer_pattern``) or module types; see each class's docstring for its metrics. The attention and output-logit
instruments find q, k and the logits of lnstab's GPT and of Hugging Face GPT-2, Llama, Gemma, Mistral, Mixtral, Qwen2,
Qwen3, Gemma 2, Gemma 3 and OLMo 2 and of ``torch.nn.MultiheadAttention`` (``nn.TransformerEncoder``) themselves
(:mod:`lnstab.callbacks._captures`), or of any model through module-name patterns. The activation instruments share
one tap per model and read the statistics registry (:class:`Statistic`, :func:`register_statistic`);
:func:`unsharded` gives any callback a full-parameter view of the model under every served strategy.

Every metric an instrument logs is also in ``trainer.callback_metrics`` from the step it is measured on
(the latest value until it is measured again), so ``EarlyStopping`` and ``ModelCheckpoint(monitor=...)`` can watch
it, e.g. ``hidden/mean_abs/final``, ``attn/max_logit/L11``, ``output/log_z_mean``, ``divergence/events`` or
``growth/exp_rate``.
"""

import importlib
from typing import Any

# Each public name and the module that defines it, imported on first use: a process that needs only the site-finding
# helpers (``lnstab check``'s parent, which never trains) imports them without Lightning.
_EXPORTS = {
    "SiteView": "._stats", "Statistic": "._stats", "register_statistic": "._stats", "unsharded": "._strategy",
    "AttentionLogitStatistics": ".attention", "RunCheckpoint": ".checkpoint", "DivergenceMonitor": ".divergence",
    "NonFiniteCheckpointError": ".divergence", "GradientStatistics": ".grad_stats",
    "GrowthBoundMonitor": ".growth_bound", "HiddenStateStatistics": ".hidden_stats",
    "JacobianSensitivity": ".jacobian", "spectral_norm": ".jacobian", "StabilityLayout": ".layout",
    "stability_layout": ".layout", "OutputLogitStatistics": ".output_logits", "StepProgressBar": ".progress",
    "RunStatus": ".run_status", "Instruments": ".suite", "Throughput": ".throughput",
}
_RENAMED = {"register_statistic": "register"}

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


def __getattr__(name: str) -> Any:
    # FinalEvaluation scores lnstab's own GPT (it imports the model and the metric packages), so it comes from
    # lnstab.evaluation; the rest from their modules (_EXPORTS). Each is cached as an attribute once loaded.
    if name == "FinalEvaluation":
        from lnstab.evaluation.callback import FinalEvaluation as value
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), _RENAMED.get(name, name))
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
