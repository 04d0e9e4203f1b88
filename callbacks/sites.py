"""Where the instruments measure, for code outside them (``lnstab check``): the public face of the private modules.

The instruments find their sites (``_sites``: residual blocks, embedding, final norm), capture q, k and the output
logits per model family (``_captures``), read them in chunks (``_views``), share one tap per model (``_tap``) and tell
a repeated block's calls apart (``_unroll``). Those modules stay the implementation and may change; these names are
the ones other code may rely on. Nothing here imports Lightning, so ``lnstab check``'s parent process uses them too.
"""

from ._captures import HEAD_PATTERN, attention_sites, output_site
from ._sites import EMBED_PATTERN, FINAL_PATTERN, find_sites, first_tensor, log_metrics, probe_input
from ._tap import paused_taps
from ._unroll import per_call
from ._views import COLLAPSE_WEIGHT, DEFAULT_CHUNK_ELEMENTS, DEFAULT_CHUNK_ROWS

__all__ = [
    "COLLAPSE_WEIGHT",
    "DEFAULT_CHUNK_ELEMENTS",
    "DEFAULT_CHUNK_ROWS",
    "EMBED_PATTERN",
    "FINAL_PATTERN",
    "HEAD_PATTERN",
    "attention_sites",
    "find_sites",
    "first_tensor",
    "log_metrics",
    "output_site",
    "paused_taps",
    "per_call",
    "probe_input",
]
