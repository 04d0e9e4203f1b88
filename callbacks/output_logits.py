"""Output-logit drift: the log-partition log Z = logsumexp(logits) over tokens, and the largest logit."""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from lnstab import validation as require

from ._captures import HEAD_PATTERN, output_site
from ._sites import FINAL_PATTERN, Site
from ._strategy import require_strategy
from ._tap_callback import MeasuringTapCallback
from ._views import DEFAULT_CHUNK_ROWS

STATS = ("output_log_z_mean", "output_log_z_std", "output_max_logit")
SOURCES = ("auto", "final_hidden", "head_output")


class OutputLogitStatistics(MeasuringTapCallback):
    """The mean and standard deviation over tokens of log Z = logsumexp of each token's logits, and the largest logit.

    PaLM's z-loss keeps log Z near 0; without it log Z can drift far from 0 (output-logit divergence, reproduced at
    small scale by Wortsman et al. 2023). Measured on optimizer steps ``0, N, 2N, …`` (``every_n_steps``) through the
    model's shared tap, pooled over the micro-batches of the step (sums for the mean, Chan's moments for the standard
    deviation, max) and over ranks, read with one host sync; on other steps the hook returns at once. Whole-batch
    logits are never formed: ``chunk_rows`` tokens at a time, under ``no_grad``.

    Where the logits come from (``source``):

    * ``auto``: lnstab's GPT computes its training loss with a chunked head and never forms logits, so the output of
      ``transformer.ln_f`` is multiplied by ``lm_head.weight`` (its real-vocabulary rows): an extra head product on
      measuring steps only (``B·T·V·C`` multiply-adds per micro-batch, the head's forward once more). Any other model:
      the output of the module matching ``head_pattern`` (Hugging Face's ``lm_head``), which it computes anyway.
    * ``final_hidden``: the output of the module matching ``final_pattern`` times the weight (and bias) of the one
      matching ``head_pattern``.
    * ``head_output``: the output of the module matching ``head_pattern``, ``(..., V)``.

    Args:
        every_n_steps: Measure on optimizer steps ``0, N, 2N, …``.
        source: ``auto``, ``final_hidden`` or ``head_output`` (above).
        final_pattern: Regex of the final norm, for ``final_hidden``.
        head_pattern: Regex of the output head (one module: a pattern that matches several is refused at setup).
        vocab_size: Logit columns that are real tokens (``None``: lnstab's ``config.vocab_size``, else all); more than
            the head's weight has rows is refused at setup.
        chunk_rows: Tokens per chunk (a chunk holds ``chunk_rows × V`` float32 logits).
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics**:
        ``output/log_z_mean``, ``output/log_z_std``, ``output/max_logit``.

    Raises:
        ConfigError: A bad argument, a model whose output head cannot be found, or a strategy it cannot serve (one
            line naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[OutputLogitStatistics(every_n_steps=100)])
    """

    stats = STATS

    def __init__(
        self,
        every_n_steps: int = 100,
        source: str = "auto",
        final_pattern: str = FINAL_PATTERN,
        head_pattern: str = HEAD_PATTERN,
        vocab_size: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        metric_prefix: str | None = None,
    ) -> None:
        super().__init__()
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.source = require.choice("source", source, SOURCES)
        self.final_pattern = require.regex("final_pattern", final_pattern, optional=False)
        self.head_pattern = require.regex("head_pattern", head_pattern, optional=False)
        self.vocab_size = None if vocab_size is None else require.positive_int("vocab_size", vocab_size)
        self.chunk_rows = require.positive_int("chunk_rows", chunk_rows)
        self.sites: list[Site] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, source=self.source)

    def metric_name(self, stat: str, tag: str) -> str:
        return f"output/{stat.removeprefix('output_')}"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__)
        site = output_site(pl_module, self.source, self.final_pattern, self.head_pattern, self.vocab_size,
                           self.chunk_rows, who=type(self).__name__)
        self.sites = [site]
        self.subscribe(pl_module, self.sites, [self.stats])
