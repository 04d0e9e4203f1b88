"""``Instruments``: every stability instrument at one cadence, the single place a config changes it."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lnstab import validation as require

from .attention import AttentionLogitStatistics
from .divergence import FATAL, KINDS, POLICIES, DivergenceMonitor
from .grad_stats import GradientStatistics
from .growth_bound import GrowthBoundMonitor
from .hidden_stats import HiddenStateStatistics
from .jacobian import JacobianSensitivity
from .layout import StabilityLayout
from .output_logits import OutputLogitStatistics
from .throughput import Throughput


class Instruments:
    """The paper's instruments as one configurable group (``instruments:`` in lnstab's configs).

    ``callbacks()`` builds :class:`StabilityLayout`, :class:`HiddenStateStatistics`, :class:`GrowthBoundMonitor`,
    :class:`GradientStatistics`, :class:`AttentionLogitStatistics`, :class:`OutputLogitStatistics` (all every
    ``every_n_steps``), :class:`JacobianSensitivity` (every ``jacobian_every_n_steps``) and
    :class:`DivergenceMonitor` (every ``divergence_every_n_steps``; its attention-collapse and logit-drift checks
    every ``every_n_steps``, on the attention and output instruments' views), with each callback's defaults for
    everything else. A variant config then changes one key
    (``instruments: {every_n_steps: 20}``) instead of restating a callback list (YAML lists replace, they do not
    merge). For other settings (``layer_pattern`` for a foreign model, …) set ``enabled: false`` and list the
    callbacks under ``trainer.callbacks``.

    Args:
        enabled: Build the instruments at all.
        every_n_steps: Cadence of the hidden-state statistics, growth bound and gradient statistics.
        jacobian_every_n_steps: Cadence of the Jacobian probe (``0``: no probe).
        jacobian_probe_size: Sequences in the Jacobian probe.
        jacobian_n_iter: Power iterations per spectral norm (the probe's cost on a CPU grows with it).
        divergence_every_n_steps: Cadence of the divergence checks (1: every step).
        divergence_policy: ``stop``, ``skip`` or ``continue`` (see :class:`DivergenceMonitor`).
        fatal_kinds: Event kinds the divergence policy acts on.
        grad_norm_threshold: Total gradient norm that counts as an explosion (``None``: off).
        loss_explosion_factor: Multiple of the run's first loss that counts as an explosion (``None``: off).
        throughput: Also log tokens/s, samples/s, FLOP/s and MFU (:class:`Throughput`, on the logging steps).
        attention: Log the attention-logit statistics and check for attention collapse.
        output_logits: Log the output-logit statistics (log Z) and check for logit drift.

    Raises:
        ConfigError: A bad argument (the message names it).

    Example::

        trainer = Trainer(callbacks=Instruments(every_n_steps=20).callbacks())
    """

    def __init__(
        self,
        enabled: bool = True,
        every_n_steps: int = 100,
        jacobian_every_n_steps: int = 1000,
        jacobian_probe_size: int = 2,
        jacobian_n_iter: int = 20,
        divergence_every_n_steps: int = 1,
        divergence_policy: str = "stop",
        fatal_kinds: list[str] | tuple[str, ...] = FATAL,
        grad_norm_threshold: float | None = None,
        loss_explosion_factor: float | None = None,
        throughput: bool = True,
        attention: bool = True,
        output_logits: bool = True,
    ) -> None:
        self.enabled = require.flag("instruments.enabled", enabled)
        self.every_n_steps = require.positive_int("instruments.every_n_steps", every_n_steps)
        self.jacobian_every_n_steps = require.integer("instruments.jacobian_every_n_steps", jacobian_every_n_steps, 0)
        self.jacobian_probe_size = require.positive_int("instruments.jacobian_probe_size", jacobian_probe_size)
        self.jacobian_n_iter = require.positive_int("instruments.jacobian_n_iter", jacobian_n_iter)
        self.divergence_every_n_steps = require.positive_int(
            "instruments.divergence_every_n_steps", divergence_every_n_steps
        )
        self.divergence_policy = require.choice("instruments.divergence_policy", divergence_policy, POLICIES)
        self.fatal_kinds = list(require.choices("instruments.fatal_kinds", fatal_kinds, KINDS))
        self.grad_norm_threshold = require.optional_number(
            "instruments.grad_norm_threshold", grad_norm_threshold, 0.0, low_open=True
        )
        self.loss_explosion_factor = require.optional_number(
            "instruments.loss_explosion_factor", loss_explosion_factor, 1.0, low_open=True
        )
        self.throughput = require.flag("instruments.throughput", throughput)
        self.attention = require.flag("instruments.attention", attention)
        self.output_logits = require.flag("instruments.output_logits", output_logits)

    def callbacks(self) -> list[Callback]:
        """The instrument callbacks (``[]`` when not ``enabled``)."""
        if not self.enabled:
            return []
        n = self.every_n_steps
        out: list[Callback] = [
            StabilityLayout(),
            HiddenStateStatistics(every_n_steps=n),
            GrowthBoundMonitor(every_n_steps=n),
            GradientStatistics(every_n_steps=n),
        ]
        if self.attention:
            out.append(AttentionLogitStatistics(every_n_steps=n))
        if self.output_logits:
            out.append(OutputLogitStatistics(every_n_steps=n))
        if self.jacobian_every_n_steps:
            out.append(JacobianSensitivity(every_n_steps=self.jacobian_every_n_steps,
                                           probe_size=self.jacobian_probe_size, n_iter=self.jacobian_n_iter))
        off = {} if self.attention else {"collapse_fraction": None, "attention_logit_threshold": None}
        off.update({} if self.output_logits else {"log_z_threshold": None})
        out.append(
            DivergenceMonitor(
                policy=self.divergence_policy,
                every_n_steps=self.divergence_every_n_steps,
                fatal_kinds=self.fatal_kinds,
                grad_norm_threshold=self.grad_norm_threshold,
                loss_explosion_factor=self.loss_explosion_factor,
                stats_every_n_steps=n if self.attention or self.output_logits else 0,
                **off,  # the checks of an instrument switched off; the monitor's default thresholds otherwise
            )
        )
        if self.throughput:
            out.append(Throughput())
        return out
