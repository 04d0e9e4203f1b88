"""The instabilities that end large runs, per configuration: attention-logit growth and output-logit drift.

From the scalars :class:`lnstab.callbacks.AttentionLogitStatistics` and :class:`lnstab.callbacks.OutputLogitStatistics`
log (TensorBoard), per run: the largest attention logit over every layer and measuring step, the smallest attention
entropy, the largest fraction of collapsed rows in a layer, the mean log Z at the last measuring step and the largest
output logit; then mean ± std over the configuration's runs that logged them (a diverged run's values are those
before it diverged; the divergence table says which).
"""

from __future__ import annotations

import math

from lnstab.report.collect import RunRecord
from lnstab.report.tables import Table, _last_finite, _metric_table

LOGIT_METRICS = ("attn_max_logit", "attn_entropy_min", "attn_collapsed", "log_z_last", "output_max_logit")


def _over_layers(run: RunRecord, prefix: str, reduce: type[max] | type[min]) -> float | None:
    values = [v for tag, points in run.scalars().items() if tag.startswith(prefix + "/")
              for _, v in points if math.isfinite(v)]
    return float(reduce(values)) if values else None


def logit_metrics(run: RunRecord) -> dict[str, float]:
    """The run's values of :data:`LOGIT_METRICS` (only those it logged)."""
    out = {
        "attn_max_logit": _over_layers(run, "attn/max_logit", max),
        "attn_entropy_min": _over_layers(run, "attn/entropy_min", min),
        "attn_collapsed": _over_layers(run, "attn/collapsed", max),
        "log_z_last": _last_finite([v for _, v in run.series("output/log_z_mean")]),
        "output_max_logit": max((v for _, v in run.series("output/max_logit") if math.isfinite(v)), default=None),
    }
    return {k: v for k, v in out.items() if v is not None}


def logit_table(records: list[RunRecord]) -> Table:
    """Attention max logit, smallest entropy, collapsed fraction, last mean log Z, largest output logit."""
    table, _ = _metric_table(records, LOGIT_METRICS, logit_metrics)
    return table
