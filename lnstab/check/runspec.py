"""What a stress run of the check is given and gives back, in plain torch: the parent process, which never trains nor
imports Lightning, reads the :class:`RunResult` its workers send back (pickled by this module's name).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lnstab.errors import LNStabError, first_line


@dataclass(frozen=True)
class Optimisation:
    """The stress run's optimiser settings (shared by every subject and rung of the ladder).

    Attributes:
        steps: Optimizer updates per run; the hidden states and Jacobians are measured once more after the last.
        warmup_steps: Linear warmup to the rung's learning rate, then cosine to ``min_lr_ratio`` of it at ``steps``.
        min_lr_ratio: End of the cosine as a fraction of the peak learning rate.
        weight_decay: AdamW decoupled decay on ≥ 2-D weights.
        betas: AdamW betas.
        eps: AdamW epsilon.
        grad_clip: Gradient-norm clipping (``0`` for none).
    """

    steps: int = 30
    warmup_steps: int = 3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0


def logits_of(out: Any) -> Any:
    """The logits in a model's output: the tensor itself, the first item of a tuple or list (``(logits, aux_loss)``),
    or ``logits`` of a dict or of an object that has it (a Hugging Face ``ModelOutput``); else ``out`` unchanged."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out:
        return out[0]
    if isinstance(out, dict):
        return out.get("logits", out)
    return getattr(out, "logits", out)


def probe_forward(model: nn.Module, ids: torch.Tensor, label: str, train: bool = False, vocabulary: str = "") -> Any:
    """The logits of ``model`` (:func:`logits_of`; eval mode, or train mode with ``train``; no grad) for ``ids``, or
    a one-line error naming ``label`` when its forward fails or ends the process (``sys.exit``, ``os._exit``); one
    that fails on the values of ``ids`` where it runs on zeros of their shape (an embedding with fewer rows than the
    ids need) says so, and then ``vocabulary``: what to do."""
    try:
        with exits_caught(), torch.no_grad():
            return logits_of(model.train(train)(ids))
    except SystemExit as exc:  # would end the check with the model's status (0: 'nothing fails') before any run
        raise LNStabError(f"{label} ended the process ({exit_call(exc)}) on token ids of shape {tuple(ids.shape)}, "
                          "before any training; lnstab check needs a forward that returns its logits") from None
    except Exception as exc:
        failure = f"({type(exc).__name__}: {first_line(exc)[:300]})"
        short = ids_past_embedding(model, ids, train) if isinstance(exc, IndexError) else None
        if short is not None:
            raise LNStabError(f"{label} has too small a vocabulary for the protocol's token ids: they run from 0 to "
                              f"{int(ids.max())}, but {short} {failure}{'; ' if vocabulary else ''}{vocabulary}"
                              ) from None
        hint = (f"; if its context is shorter than {ids.shape[-1]} tokens, give a smaller --seq-len"
                if isinstance(exc, IndexError) else "")  # a position embedding indexed past its end
        raise LNStabError(f"{label} failed on token ids of shape {tuple(ids.shape)} {failure}{hint}") from None


def ids_past_embedding(model: nn.Module, ids: torch.Tensor, train: bool) -> str | None:
    """Where ``model``, whose forward raised an ``IndexError`` on ``ids``, takes fewer token ids than they hold: its
    ``nn.Embedding`` indexed past its rows (``its embedding 'embed' has 100 rows``), or its forward where no such
    embedding is seen; ``None`` when it fails on zeros of the same shape too (the length, not the ids, is at fault)."""
    past: list[str] = []

    def seen(name: str, module: nn.Embedding, args: Any) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.numel() and not x.is_floating_point() and (
                int(x.max()) >= module.num_embeddings):
            past.append(f"its embedding {name!r} has {module.num_embeddings} rows")

    for x in (torch.zeros_like(ids), ids):
        try:
            with exits_caught(), torch.no_grad(), contextlib.ExitStack() as hooks:
                for name, module in model.named_modules():
                    if isinstance(module, nn.Embedding):
                        hooks.enter_context(module.register_forward_pre_hook(
                            lambda m, a, name=name: seen(name, m, a)))
                model.train(train)(x)
        except (Exception, SystemExit):
            if x is not ids:  # zeros fail too: not the ids' values
                return None
            return past[0] if past else "its forward indexes past the end of a table with them"
    return None  # the ids went through this time: no verdict on them


@dataclass(frozen=True)
class Sites:
    """Where the instruments look in one model (regexes searched in module/parameter names; see lnstab.callbacks).

    Attributes:
        hidden_pattern: Residual-stream sites (half-steps or blocks); the first group, if any, is the layer index
            (without groups the matches are numbered in module order).
        embed_pattern: The module whose output is X_0 (``None``: the first block's input).
        final_pattern: The module whose input is X_D (``None``: the last block's output).
        block_pattern: Whole blocks for the Jacobian probe, first group the layer index.
        param_pattern: Parameters of one block, first group the layer index (``None``: no per-layer gradients).
        norm_pattern: Output norms of Theorem 4, one per residual update (``None``: none; a model's own
            ``output_norms()`` wins, as in :class:`~lnstab.callbacks.GrowthBoundMonitor`).
        head_pattern: The output head whose output is the logits (``None``: ``lm_head``, or lnstab's chunked head).
        attention: Whether the attention-logit instrument finds q and k (the families docs/check/README.md lists,
            or the projections named by ``qk``).
        logits: Whether the output-logit instrument finds the logits.
        qk: ``(q_pattern, k_pattern, n_head)`` of a model whose attention is not recognised (``None``: automatic).
    """

    hidden_pattern: str
    embed_pattern: str | None = None
    final_pattern: str | None = None
    block_pattern: str | None = None
    param_pattern: str | None = None
    norm_pattern: str | None = None
    head_pattern: str | None = None
    attention: bool = True
    logits: bool = True
    qk: tuple[str, str, int] | None = None


@dataclass
class RunResult:
    """What one stress run measured (plain numbers, JSON-ready)."""

    subject: str
    lr: float
    seed: int
    log_dir: str
    losses: list[float]
    diverged: bool
    diverged_step: int | None
    events: list[dict[str, Any]]
    hidden_tags: list[str]
    hidden_steps: list[int]
    hidden: dict[str, dict[str, list[float]]]
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    repeated: dict[str, int] = field(default_factory=dict)  # block module -> calls in one forward, when above 1
    bound_unchecked: str = ""  # why output norms that were located did not get Theorem 4's bound checked
    cached: bool = False  # reused from an earlier card's identical run (lnstab.check.cache), not trained again


class ModelExit(SystemExit):
    """``os._exit`` called while a model was built or trained, raised instead (:func:`exits_caught`)."""


@contextlib.contextmanager
def exits_caught() -> Iterator[None]:
    """Within: ``os._exit(n)`` raises :class:`ModelExit` instead of ending the process, so that a model (or its
    factory) that ends the process leaves the check alive to say so; with ``sys.exit`` (a :class:`SystemExit`), the
    caller's ``except SystemExit`` sees both. A model that kills its process otherwise (a signal) still ends it: in a
    worker, the parent reads that as a failed run; in the check's own process, the exit status is the signal's."""
    real = os._exit

    def refused(code: int) -> None:
        raise ModelExit(code)

    os._exit = refused
    try:
        yield
    finally:
        os._exit = real


def exit_call(exc: SystemExit) -> str:
    """How a model ended the process: ``sys.exit(0)`` or ``os._exit(0)``."""
    call = "os._exit" if isinstance(exc, ModelExit) else "sys.exit"
    return f"{call}({'' if exc.code is None else repr(exc.code)})"
