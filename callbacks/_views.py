"""Views of one micro-batch that are not a residual-stream tensor: an attention layer's q and k, the output logits.

Each view computes its primitives once, on first use (however many registered statistics read them), in chunks so
that memory stays bounded, with autocast off and nothing recorded for autograd (the tap calls them under
``no_grad``). Neither is ever built on a step that does not measure.

* :class:`AttentionView`: the causal attention logits ``z = q·kᵀ·scale`` and weights ``softmax(z)`` of every head,
  one chunk of query rows at a time: a chunk of ``c`` rows holds ``B·n_head·c·e`` float32 values (``e`` = keys the
  chunk's last row may see), at most ``chunk_elements`` of them (one row at least; four chunks at least), in two
  temporaries (the logits, turned into ``exp(z − max)`` in place, and the visible logits).
* :class:`LogitView`: log Z = logsumexp of each token's logits and the largest logit, ``chunk_rows`` tokens at a
  time, either from the final hidden state and the head weight (an extra head product) or from logits the model
  already computed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import cached_property

import torch

from ._stats import Moments, SiteView

COLLAPSE_WEIGHT = 0.99  # a row whose largest weight exceeds this is collapsed (one-hot up to 1 %)
# 256 Ki float32 logits (1 MiB) per chunk: on a CPU core, B·n_head·T = 24k (T = 1024) ran fastest with about this
# many (10 rows a chunk) among 2^14 … 2^22; at 4k (lnstab's mini preset, T = 128) four chunks of 32 rows did.
DEFAULT_CHUNK_ELEMENTS = 1 << 18
DEFAULT_CHUNK_ROWS = 512  # tokens per chunk of the output head, as lnstab.loss
# exp(x) for x below about −87.3 is a subnormal float32 or 0, which the CPU's vector exp computes some 15× slower
# (measured: −88 against −80), and hidden keys (−inf) 2.5× slower: arguments are clamped here first, so a weight under
# e^−80 ≈ 1.8e−35 counts as that, which moves a sum of at most 10^6 such weights (≥ 1) by under 2e−29.
EXP_FLOOR = -80.0


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@dataclass
class AttentionSummary:
    """One layer's attention in one micro-batch (device tensors; ``rows`` is known from the shapes)."""

    max_logit: torch.Tensor  # 0-dim float32: max |z| over visible (query, key) pairs
    entropy_sum: torch.Tensor  # 0-dim float64: Σ over counted rows of −Σ_j p_j log p_j
    neg_entropy_max: torch.Tensor  # 0-dim float32: max over counted rows of −entropy (NaN when no row counts)
    collapsed: torch.Tensor  # 0-dim float64: counted rows whose largest weight exceeds the collapse weight
    rows: int  # counted rows: B·n_head·(T − min_keys + 1)

    @property
    def rows_tensor(self) -> torch.Tensor:
        return torch.full((), float(self.rows), dtype=torch.float64, device=self.entropy_sum.device)


class AttentionView(SiteView):
    """q ``(B, n_head, T, hs)`` and k ``(B, n_kv, T, hs)`` of one self-attention call, causal unless ``causal`` is
    false (``n_kv`` divides ``n_head``: grouped-query attention, k head ``h // (n_head / n_kv)`` serves q head
    ``h``).

    Args:
        q, k: Queries and keys exactly as the attention product sees them (after any norm or rotary embedding).
        scale: The factor of ``q·kᵀ`` (``1/√hs`` for SDPA's default).
        chunk_elements: Logits per chunk of query rows (one row at least).
        min_keys: Rows whose query sees fewer keys (the first ``min_keys − 1`` positions) count in ``max_logit``
            only: position 0 sees one key, so its entropy is 0 and its weight 1 whatever the model does.
        collapse_weight: A row is collapsed when its largest weight exceeds this.
        softcap: Soft-capping of the logits before the softmax, ``softcap·tanh(z / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``): the entropy and collapse statistics are of the capped logits, as the softmax
            sees them; ``max_logit`` stays the uncapped largest ``|z|``, the growth that the cap hides.
        window: Sliding-window attention (Gemma 2's ``sliding_window`` layers): query ``i`` sees keys
            ``i − window < j ≤ i`` only, as Hugging Face's mask; ``None``: every earlier key.
        causal: Query ``i`` sees keys ``j ≤ i`` (``True``) or every key of the sequence (``False``: an encoder's
            attention, ``nn.TransformerEncoder`` without a mask; ``window`` then does not apply).
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                 min_keys: int = 2, collapse_weight: float = COLLAPSE_WEIGHT, softcap: float | None = None,
                 window: int | None = None, causal: bool = True) -> None:
        super().__init__(q)
        self.q, self.k, self.scale = q, k, float(scale)
        self.chunk_elements, self.min_keys, self.collapse_weight = chunk_elements, min_keys, collapse_weight
        self.softcap = float(softcap) if softcap else None
        self.window = int(window) if window else None
        self.causal = bool(causal)

    @cached_property
    def attention(self) -> AttentionSummary:
        q, k = self.q, self.k
        B, H, T, hs = q.shape
        kv = k.size(1)
        if H % kv or k.shape[0] != B or k.shape[2:] != (T, hs):
            raise ValueError(f"k of shape {tuple(k.shape)} does not pair with q of shape {tuple(q.shape)}")
        device = q.device
        q = q.reshape(B, kv, H // kv, T, hs)  # (B, n_kv, group, T, hs)
        k = k.float().contiguous()[:, :, None]  # (B, n_kv, 1, T, hs): each k head serves its group of q heads
        # At least four chunks: a chunk's rows see the keys up to its last row, so more chunks form fewer of the
        # logits a causal mask hides (5/8 of T² in four chunks, against all of it in one).
        rows_per_chunk = max(1, min(self.chunk_elements // (B * H * T), -(-T // 4)))
        # the first query row that counts in the entropy and collapse statistics (without a causal mask every row
        # sees all T keys)
        first = self.min_keys - 1 if self.causal else (0 if T >= self.min_keys else T)
        max_logit = torch.zeros((), device=device)
        entropy_sum = torch.zeros((), dtype=torch.float64, device=device)
        collapsed = torch.zeros((), dtype=torch.float64, device=device)
        neg_entropy_max = None
        with _no_autocast(device):
            q = q.float() * self.scale  # (B, n_kv, group, T, hs): the scale folded into q, not into every logit
            for start in range(0, T, rows_per_chunk):
                end = min(T, start + rows_per_chunk)  # rows [start, end) see keys [0, end) (causal) or [0, T)
                seen = end if self.causal else T
                z = torch.matmul(q[..., start:end, :], k[..., :seen, :].transpose(-1, -2))  # (…, c, e)
                keys = torch.arange(seen, device=device)[None, :]
                queries = torch.arange(start, end, device=device)[:, None]
                hidden = keys > queries if self.causal else keys < 0  # (c, e): keys after the query (causal)
                if self.window is not None and self.causal:
                    hidden |= keys <= queries - self.window  # and keys that left the query's window
                zc = z.masked_fill(hidden, 0.0)  # (B, n_kv, group, c, e): the visible logits, 0 elsewhere
                low, high = torch.aminmax(zc)
                max_logit = torch.maximum(max_logit, torch.maximum(high, low.neg()))  # NaN-propagating
                skip = max(0, first - start)  # leading rows of this chunk that do not count
                if skip >= end - start:
                    continue
                z, zc = z[..., skip:, :], zc[..., skip:, :]  # the rows that count
                if self.softcap is not None:  # the softmax sees the capped logits
                    z = z.div_(self.softcap).tanh_().mul_(self.softcap)
                    zc.copy_(z).masked_fill_(hidden[skip:], 0.0)  # in place: still two temporaries
                top = z.masked_fill_(hidden[skip:], -math.inf).amax(dim=-1, keepdim=True)  # (…, c', 1): row max
                e = z.sub_(top).clamp_(min=EXP_FLOOR).exp_()  # exp(z − max): 1 at the row's largest weight
                total = e.sum(dim=-1)  # (…, c'): the softmax denominator, so the largest weight is 1 / total
                zc.sub_(top)  # z − max at visible keys (finite elsewhere, where e is 0)
                # H = −Σ p log p = log Σ e − Σ e·(z − max) / Σ e, with p = e / Σ e: no log per entry
                entropy = total.log() - e.mul_(zc).sum(dim=-1) / total  # (B, n_kv, group, c')
                del e, z, zc
                entropy_sum += entropy.sum(dtype=torch.float64)
                neg = entropy.neg().amax()
                neg_entropy_max = neg if neg_entropy_max is None else torch.maximum(neg_entropy_max, neg)
                collapsed += (total < 1.0 / self.collapse_weight).sum(dtype=torch.float64)
        if neg_entropy_max is None:
            neg_entropy_max = torch.full((), math.nan, device=device)
        return AttentionSummary(max_logit, entropy_sum, neg_entropy_max, collapsed, B * H * max(0, T - first))


@dataclass
class LogitSummary:
    """The output logits of one micro-batch: per-token log Z ``(N,)`` float32, the largest logit, ``N``."""

    log_z: torch.Tensor
    max_logit: torch.Tensor
    tokens: int

    @property
    def count(self) -> torch.Tensor:
        return torch.full((), float(self.tokens), dtype=torch.float64, device=self.log_z.device)

    @property
    def log_z_moments(self) -> Moments:
        mean = self.log_z.double().mean()
        return Moments(float(self.tokens), mean.float().reshape(1), (self.log_z.double() - mean).square().sum())


class LogitView(SiteView):
    """Output logits of one micro-batch: from the final hidden state ``x`` ``(..., C)`` and the head (``weight``
    ``(V_padded, C)``, optional ``bias``), or, without ``weight``, from logits ``x`` ``(..., V)`` themselves.

    Args:
        x: Final hidden states (after the final norm), or the logits.
        weight, bias: The head; ``None``: ``x`` already holds logits.
        vocab_size: Columns that are real tokens (``None``: all); padded columns never count.
        chunk_rows: Tokens per chunk: a chunk holds ``chunk_rows × V`` float32 logits.
    """

    def __init__(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 vocab_size: int | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> None:
        super().__init__(x)
        self.weight, self.bias, self.vocab_size, self.chunk_rows = weight, bias, vocab_size, chunk_rows

    @cached_property
    def logits(self) -> LogitSummary:
        x = self.x.reshape(-1, self.x.size(-1))  # (N, C) or (N, V)
        vocab = self.vocab_size
        weight = self.weight[:vocab] if self.weight is not None else None  # (V, C): the real tokens' rows
        bias = self.bias[:vocab] if self.bias is not None else None
        log_z, top = [], None
        for start in range(0, x.size(0), self.chunk_rows):
            rows = x[start : start + self.chunk_rows]  # (m, C) or (m, V)
            if weight is not None:  # the head's product in the dtype training uses (autocast's, where it is on)
                logits = torch.nn.functional.linear(rows, weight, bias).float()  # (m, V)
            else:
                logits = rows[:, :vocab].float()  # (m, V)
            row_max = logits.amax(dim=-1)  # (m,)
            shifted = (logits - row_max[:, None]).clamp_(min=EXP_FLOOR)  # (m, V)
            log_z.append(row_max + shifted.exp_().sum(dim=-1).log_())  # (m,): logsumexp
            chunk_top = row_max.amax()
            top = chunk_top if top is None else torch.maximum(top, chunk_top)
        if top is None:
            top = torch.full((), math.nan, device=x.device)
        return LogitSummary(torch.cat(log_z) if log_z else x.new_zeros(0, dtype=torch.float32), top, x.size(0))
