"""Attention-logit growth and entropy collapse, per layer: the largest logit, the mean and smallest entropy, the
fraction of one-hot rows."""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from lnstab import validation as require

from ._captures import attention_sites, qk_arguments
from ._sites import Site
from ._strategy import require_strategy
from ._tap_callback import MeasuringTapCallback
from ._views import COLLAPSE_WEIGHT, DEFAULT_CHUNK_ELEMENTS

STATS = ("attn_max_logit", "attn_entropy_mean", "attn_entropy_min", "attn_collapsed")


class AttentionLogitStatistics(MeasuringTapCallback):
    """Per self-attention layer, the statistics of its logits ``z = q·kᵀ/√d_h`` and weights ``p = softmax(z)``.

    Over the heads, the sequences of the batch and the causal positions (each query row's softmax over the keys it
    may see, keys ``0 … t`` for the query at position ``t``):

    * ``max_logit`` = max ``|z|`` over every visible (query, key) pair;
    * ``entropy_mean`` = mean over rows of ``H = −Σ_j p_j log p_j`` (nats), ``entropy_min`` = its minimum;
    * ``collapsed`` = fraction of rows whose largest weight exceeds ``collapse_weight`` (one-hot rows).

    Rows whose query sees fewer than ``min_keys`` keys (by default only position 0, whose single weight is 1 and
    entropy 0 whatever the model does) count in ``max_logit`` only.

    q and k are read where the attention product reads them, through the model's shared tap (one set of hooks per layer,
    however many instruments watch it; :mod:`lnstab.callbacks._captures` says where, per model family): lnstab's GPT
    (``attn.q_norm``/``attn.k_norm`` outputs, else ``c_attn``), Hugging Face GPT-2 (``c_attn``) and Llama, Gemma,
    Mistral, Mixtral, Qwen2, Qwen3, Gemma 2, Gemma 3, OLMo and OLMo 2 (``q_proj``/``k_proj``, OLMo 2's, Qwen3's and
    Gemma 3's ``q_norm``/``k_norm``, OLMo's clamped to its ``clip_qkv``, with the rotary embedding applied,
    grouped-query heads shared, sliding windows and Gemma 2's soft-cap as each family's attention function receives
    them), or the projections a user names with ``q_pattern``/``k_pattern``/``n_head`` (as they leave the projections:
    no rotary embedding or norm after them is seen). The training step's attention (SDPA, fused kernels) is left as it
    is: on measuring steps
    (``global_step % every_n_steps == 0``) the hooks form the logits again, one chunk of query rows at a time
    (at most ``chunk_elements`` float32 logits per chunk, in two such temporaries, and at least four chunks; keys
    after a chunk's last row are never formed), under ``no_grad`` with autocast off; on other steps they return at
    once. Values are pooled over the
    micro-batches of the step and reduced over ranks (max for ``max_logit`` and, negated, for ``entropy_min``;
    sums and counts for the means), then read with one host sync. Padding masks, sliding windows, cross-attention
    and KV caches are not taken into account.

    Cost on a measuring step, per layer and micro-batch: the logits once more (about ``5/8·B·n_head·T²·d_h``
    multiply-adds in four chunks, less in more), one ``exp`` and about eight cheap passes over them: on a CPU core
    about 1.3× the layer's SDPA forward (T = 1024, 12 heads of 64), nothing on other steps.

    Args:
        every_n_steps: Measure on optimizer steps ``0, N, 2N, …``.
        q_pattern: Regex of the q projection modules (with ``k_pattern`` and ``n_head``), instead of the automatic
            search; a numeric first group is the layer index, else the block index in the name (``h.3``, ``layers.3``).
        k_pattern: Regex of the k projection modules.
        n_head: q heads of every layer, for ``q_pattern`` (k heads follow from k's width).
        scale: Factor of ``q·kᵀ`` for ``q_pattern`` (``None``: ``1/√head_size``).
        chunk_elements: Logits per chunk of query rows (at least one row per chunk).
        min_keys: Rows that see fewer keys count in ``max_logit`` only (``1``: every row counts).
        collapse_weight: A row whose largest weight exceeds this is collapsed.
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics** (``Lxx`` is the block index, zero-padded):
        ``attn/max_logit/Lxx``, ``attn/entropy_mean/Lxx``, ``attn/entropy_min/Lxx``, ``attn/collapsed/Lxx``.

    Raises:
        ConfigError: A bad argument, a model where q and k cannot be found, or a strategy it cannot serve (one line
            naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[AttentionLogitStatistics(every_n_steps=100)])
    """

    stats = STATS

    def __init__(
        self,
        every_n_steps: int = 100,
        q_pattern: str | None = None,
        k_pattern: str | None = None,
        n_head: int | None = None,
        scale: float | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        min_keys: int = 2,
        collapse_weight: float = COLLAPSE_WEIGHT,
        metric_prefix: str | None = None,
    ) -> None:
        super().__init__()
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.q_pattern, self.k_pattern, self.n_head, self.scale = qk_arguments(q_pattern, k_pattern, n_head, scale)
        self.options = {
            "chunk_elements": require.positive_int("chunk_elements", chunk_elements),
            "min_keys": require.positive_int("min_keys", min_keys),
            "collapse_weight": require.number("collapse_weight", collapse_weight, 0.0, 1.0, low_open=True,
                                            high_open=True),
        }
        self.sites: list[Site] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, q_pattern=str(self.q_pattern))

    @property
    def tags(self) -> list[str]:
        """Layer tags in depth order."""
        return [s.tag for s in self.sites]

    def metric_name(self, stat: str, tag: str) -> str:
        return f"attn/{stat.removeprefix('attn_')}/{tag}"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__)
        self.sites = attention_sites(pl_module, self.options, self.q_pattern, self.k_pattern, self.n_head,
                                     self.scale, who=type(self).__name__)
        self.subscribe(pl_module, self.sites, [self.stats] * len(self.sites))
