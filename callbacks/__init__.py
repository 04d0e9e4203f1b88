"""Reusable Lightning callbacks that measure the stability of a Transformer while it trains.

Every callback finds lnstab's residual modules by name by default and works on other models through a module-name
regex (``layer_pattern``) or module types; see each class's docstring for its metrics.
"""

from .divergence import DivergenceMonitor, NonFiniteCheckpointError
from .grad_stats import GradientStatistics
from .growth_bound import GrowthBoundMonitor
from .hidden_stats import HiddenStateStatistics
from .jacobian import JacobianSensitivity, spectral_norm
from .layout import StabilityLayout, stability_layout

__all__ = [
    "DivergenceMonitor",
    "GradientStatistics",
    "GrowthBoundMonitor",
    "HiddenStateStatistics",
    "JacobianSensitivity",
    "NonFiniteCheckpointError",
    "StabilityLayout",
    "spectral_norm",
    "stability_layout",
]
