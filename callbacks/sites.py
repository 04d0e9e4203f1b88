"""Where the instruments measure, for code outside them (``lnstab check``): the public face of the private modules
(``_sites``, ``_captures``, ``_views``, ``_tap``, ``_unroll``: ARCHITECTURE.md), which stay the implementation and may
change. Nothing here imports Lightning, so ``lnstab check``'s parent process uses them too."""

from ._captures import HEAD_PATTERN, attention_sites, output_site
from ._sites import (
    BLOCK_PATTERN,
    EMBED_PATTERN,
    FINAL_PATTERN,
    LNSTAB_RESIDUALS,
    OUTPUT_NORMS,
    PARAM_LAYER_PATTERN,
    find_sites,
    first_tensor,
    log_metrics,
    probe_input,
)
from ._tap import paused_taps
from ._unroll import per_call
from ._views import COLLAPSE_WEIGHT, DEFAULT_CHUNK_ELEMENTS, DEFAULT_CHUNK_ROWS

__all__ = [
    "BLOCK_PATTERN",
    "COLLAPSE_WEIGHT",
    "DEFAULT_CHUNK_ELEMENTS",
    "DEFAULT_CHUNK_ROWS",
    "EMBED_PATTERN",
    "FINAL_PATTERN",
    "HEAD_PATTERN",
    "LNSTAB_RESIDUALS",
    "OUTPUT_NORMS",
    "PARAM_LAYER_PATTERN",
    "attention_sites",
    "find_sites",
    "first_tensor",
    "log_metrics",
    "output_site",
    "paused_taps",
    "per_call",
    "probe_input",
]
