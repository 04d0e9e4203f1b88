"""Next-token loss of a language-model head without the whole batch's logits: the head and the loss in row chunks.

At GPT-2's vocabulary the head dominates a small model's step: for 8 × 256 tokens the fp32 logits alone are
8·256·50304·4 B = 412 MB, and the usual path (``logits = head(x)``; slice the padded columns; ``cross_entropy``) makes
four or five tensors of that size per step (logits, the slice's copy, log-softmax, its gradient, the padded gradient).
:func:`lm_head_loss` computes the same mean cross-entropy one chunk of rows at a time and, while the chunk's logits
are at hand, also the gradients with respect to the hidden states and the head weight (``softmax − one_hot``, the
derivative of cross-entropy), so the backward pass only scales two stored gradients. Peak memory of the head falls
from ``O(B·T·V)`` to ``O(chunk·V)``, and the matrix products are the three of the usual path (no recomputation).

Numbers are the usual path's within fp32 rounding (tests compare logits, loss and gradients).

**z-loss** (PaLM, Chowdhery et al. 2022, §5 "Training setup": an auxiliary ``1e-4·log²Z`` that keeps the softmax
normaliser log Z near 0, for stability): with a coefficient ``c > 0`` the objective is ``CE + c·mean_tokens (log Z)²``,
``log Z`` the log-sum-exp of a token's (real) logits. It is formed in the same chunked pass: each chunk's ``log Z`` is
already at hand for the cross-entropy, and its gradient only rescales each row's softmax, ``d/dlogits =
(softmax·(1 + 2c·log Z) − one_hot) / N``, so it costs a few operations per row and no extra memory.
:func:`lm_head_losses` returns the objective with its two parts (the cross-entropy and the z-loss term, detached) for
logging.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lnstab import validation as require
from lnstab.errors import ConfigError, LNStabError

# Rows per chunk: 512 rows of 50257 fp32 logits are 103 MB. On a 1-thread AVX2 core, head + loss of 2048 rows took
# the same time with 256, 512 or 1024-row chunks (benchmarks/bench_loss.py); fewer rows make thinner products.
DEFAULT_CHUNK_ROWS = 512


class HeadLoss(NamedTuple):
    """The head loss and its parts, fp32 scalars on the hidden states' device (reading them is a host sync).

    Attributes:
        loss: The training objective ``cross_entropy + z_loss``; the only differentiable one.
        cross_entropy: Mean next-token cross-entropy (detached).
        z_loss: The z-loss term ``c·mean (log Z)²`` (detached; 0 when ``c = 0``).
    """

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    z_loss: torch.Tensor


def z_loss_coefficient(value: float, field: str = "z_loss", *, error: type[LNStabError] = ConfigError) -> float:
    """PaLM's z-loss coefficient ``c``, checked alike wherever it is given (``GPTConfig.z_loss``, ``lnstab check
    --z-loss``, :func:`lm_head_losses`): a finite number ``>= 0``, else ``error`` in one line naming ``field``."""
    return require.number(field, value, 0.0, error=error)


def z_loss_term(logits: torch.Tensor, coefficient: float) -> torch.Tensor:
    """The z-loss term ``c·mean (log Z)²`` of whole logits ``(N, V)`` (``log Z``: each row's log-sum-exp); the
    chunked head forms the same term a chunk at a time (:func:`lm_head_losses`)."""
    return coefficient * torch.logsumexp(logits, dim=-1).square().mean()


def reference_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, z_loss: float = 0.0
) -> torch.Tensor:
    """The usual path, for tests and benchmarks: whole-batch logits, padded columns sliced off, fp32 cross-entropy,
    plus ``z_loss·mean (logsumexp logits)²`` when ``z_loss > 0``."""
    logits = F.linear(hidden, weight)[..., :vocab_size].reshape(-1, vocab_size).float()  # (N, V)
    loss = F.cross_entropy(logits, targets.reshape(-1))
    return loss + z_loss_term(logits, z_loss) if z_loss else loss


def lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The objective of :func:`lm_head_losses` alone: the mean cross-entropy (plus the z-loss term if ``z_loss``)."""
    return lm_head_losses(hidden, weight, targets, vocab_size, chunk_rows, z_loss=z_loss).loss


def lm_head_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    *,
    z_loss: float = 0.0,
) -> HeadLoss:
    """Mean cross-entropy of ``hidden @ weight[:vocab_size].T`` against ``targets`` (and the z-loss), in row chunks.

    The cross-entropy equals ``F.cross_entropy(F.linear(hidden, weight)[..., :vocab_size].float().flatten(0, -2),
    targets.flatten())`` within fp32 rounding, and the objective ``reference_lm_loss(..., z_loss)``, in value and in
    gradients with respect to ``hidden`` and ``weight``.

    Under ``torch.autocast`` the products run in the autocast dtype (as ``F.linear`` would) while the softmax, the
    loss, ``log Z`` and the accumulation of the weight's gradient stay in fp32.

    Args:
        hidden: Final hidden states ``(..., C)`` (after the final norm).
        weight: Head weight ``(V_padded, C)`` (tied to the token embedding in GPT-2).
        targets: Token ids ``(...)`` in ``[0, vocab_size)``.
        vocab_size: Columns that are real tokens; the padded rows of ``weight`` beyond it are ignored (their gradient
            is zero). ``None``: every row of ``weight``.
        chunk_rows: Rows of ``hidden`` per chunk; memory of the head is ``chunk_rows × V_padded`` fp32 values.
        z_loss: Coefficient ``c ≥ 0`` of ``c·mean (log Z)²`` in the objective (PaLM: 1e-4); 0 leaves it out.

    Returns:
        A :class:`HeadLoss`: the objective (differentiable), the cross-entropy and the z-loss term (both detached).

    Raises:
        ValueError: ``chunk_rows < 1``, ``vocab_size`` larger than the weight's rows, or a ``z_loss`` that is
            negative or not finite.
    """
    vocab_size = weight.size(0) if vocab_size is None else vocab_size
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} is not allowed; it must be >= 1")
    if not 1 <= vocab_size <= weight.size(0):
        raise ValueError(f"vocab_size={vocab_size!r} is not allowed; it must be in [1, {weight.size(0)}]")
    z_loss_coefficient(z_loss)
    device_type = hidden.device.type
    # Under autocast the products run in the autocast dtype, as F.linear's would.
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    loss, parts = _ChunkedHeadLoss.apply(hidden.reshape(-1, hidden.size(-1)), weight, targets.reshape(-1), vocab_size,
                                         chunk_rows, float(z_loss))
    return HeadLoss(loss, parts[0], parts[1])


class _ChunkedHeadLoss(torch.autograd.Function):
    """Loss and both gradients in one pass over row chunks; backward scales the stored gradients.

    Returns ``(objective, [cross_entropy, z_term])``; only the objective is differentiable. The two parts are one
    stacked tensor, never a tensor of their own: ``mark_non_differentiable`` is keyed on the tensor object, and under
    ``torch.compile`` (torch 2.13) Inductor folds ``ce + 0·Σ0`` (no z-loss) into ``ce`` itself, so marking ``ce``
    marked the objective too and the compiled training step had no gradient at all.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab: int, chunk: int,
                z_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.size(0)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None  # (N, C)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None  # (V_padded, C)
        w_real = w[:vocab]  # (V, C): a contiguous view, the padded rows never enter the products
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        total_z = torch.zeros((), dtype=torch.float32, device=h.device)  # Σ (log Z)² over rows
        buf = torch.empty(min(chunk, n), vocab, dtype=torch.float32, device=h.device)  # one chunk's logits, reused
        off = torch.autocast(h.device.type, enabled=False) if torch.amp.is_autocast_available(h.device.type) else None
        with off or contextlib.nullcontext():
            for start in range(0, n, chunk):
                hc, tc = h[start : start + chunk], t[start : start + chunk]  # (m, C), (m,)
                logits = buf[: hc.size(0)]  # (m, V)
                if h.dtype == torch.float32:
                    torch.mm(hc, w_real.T, out=logits)
                else:
                    logits.copy_(hc @ w_real.T)
                top = logits.amax(dim=1, keepdim=True)  # (m, 1)
                target = logits.gather(1, tc[:, None])  # (m, 1)
                exp = logits.sub_(top).exp_()  # (m, V) in place of the logits
                sums = exp.sum(dim=1, keepdim=True)  # (m, 1)
                log_z = top + sums.log()  # (m, 1)
                total += (log_z - target).sum()  # log-sum-exp minus the target's logit
                if z_coef:
                    total_z += log_z.square().sum()
                if not (need_h or need_w):
                    continue
                # softmax / N (times 1 + 2c·log Z with the z-loss): d(mean loss)/d(logits), less one_hot / N below
                scale = (1.0 + 2.0 * z_coef * log_z) / (n * sums) if z_coef else 1.0 / (n * sums)  # (m, 1)
                dlogits = exp.mul_(scale)
                dlogits.scatter_add_(1, tc[:, None], torch.full_like(target, -1.0 / n))
                dlogits = dlogits.to(h.dtype)
                if need_h:
                    torch.mm(dlogits, w_real, out=grad_h[start : start + chunk])  # (m, C)
                if need_w:
                    gw = grad_w[:vocab]  # (V, C); addmm with out= (not addmm_) so FLOP counters see it
                    if dlogits.dtype == torch.float32:
                        torch.addmm(gw, dlogits.T, hc, out=gw)
                    else:
                        gw += (dlogits.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w.dtype
        ce, z_term = total / n, total_z * (z_coef / n)
        parts = torch.stack([ce, z_term])  # (2,)
        ctx.mark_non_differentiable(parts)
        return ce + z_term, parts

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_parts: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.w_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None
