"""One stress run of the check: a Lightning fit of any token-ids → logits model with lnstab's instruments attached.
Every subject (the checked model and its references) is trained by the same :class:`StressModule` on the same cached
batches, so two subjects differ only in their architecture."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lnstab.callbacks import (
    AttentionLogitStatistics,
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    OutputLogitStatistics,
    RunStatus,
    StabilityLayout,
)
from lnstab.check.probes import BranchProbe
from lnstab.check.runspec import Optimisation, RunResult, Sites, logits_of
from lnstab.loss import z_loss_term
from lnstab.model import GPT
from lnstab.module import decay_groups, warmup_cosine

# A stress run has diverged on a non-finite loss, gradient, weight or activation, or on a loss above this multiple of
# its first (~ln V), whether or not fp32 overflowed on this CPU: part of what "diverged" means (docs/check/README.md),
# not a card threshold.
LOSS_EXPLOSION_FACTOR = 10.0


@contextlib.contextmanager
def event_writer_errors() -> Iterator[list[OSError]]:
    """Holds what TensorBoard's event-writer thread raises (an ``OSError``: a full disk) instead of letting the
    thread print a traceback; the writer raises it again in the fit's own thread at its next write, and the caller
    raises it once, naming the run's directory."""
    held: list[OSError] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        writer = type(args.thread).__module__.startswith("tensorboard") if args.thread is not None else False
        if writer and args.exc_type is not None and issubclass(args.exc_type, OSError):
            held.append(args.exc_value)  # type: ignore[arg-type]
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield held
    finally:
        threading.excepthook = previous


class StressModule(pl.LightningModule):
    """Next-token loss of ``model`` (token ids ``(B, T)`` → logits ``(B, T, V)``) under :class:`Optimisation`, in train
    mode, on docs/check/README.md's objective: lnstab's GPT on its own (``model(idx, targets)``), any other (or any
    given ``z_loss``) on the cross-entropy of :func:`logits_of` plus ``z_loss·mean (log Z)²``; AdamW and schedule as
    :class:`lnstab.module.GPTModule`. The cross-entropy of every step is kept in :attr:`losses`.

    Args:
        model: The network to train; its modules are reachable as ``model.<name>`` (hooks find them by suffix).
        learning_rate: Peak learning rate.
    """

    def __init__(self, model: nn.Module, learning_rate: float, optimisation: Optimisation,
                 z_loss: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.learning_rate = learning_rate
        self.optimisation = optimisation
        self.z_loss = z_loss
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(idx))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        if isinstance(self.model, GPT) and not self.z_loss:
            parts = self.model(x, y, loss_parts=True)  # chunked head: no (B, T, V) logits
            loss, ce = parts.loss, parts.cross_entropy
        else:
            logits = self(x).float()  # (B, T, V)
            flat = logits.reshape(-1, logits.size(-1))  # (B·T, V)
            loss = ce = F.cross_entropy(flat, y.reshape(-1))
            if self.z_loss:
                loss = ce + z_loss_term(flat, self.z_loss)
        self.losses.append(ce.item())
        self.log("train/loss", ce)
        return loss

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        opt, peak = self.optimisation, self.learning_rate
        optimizer = torch.optim.AdamW(decay_groups(self.model, opt.weight_decay), lr=peak, betas=opt.betas,
                                      eps=opt.eps, foreach=True)
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine(
            optimizer, peak=peak, min_lr=peak * opt.min_lr_ratio, warmup_steps=opt.warmup_steps, decay_steps=opt.steps)}


class Recorder(pl.Callback):
    """Keeps every evaluation of the instruments' ``.last`` dicts by step (placed after them in the callback list)."""

    def __init__(self, instruments: list[Any]) -> None:
        self.instruments = instruments
        self.seen: list[int] = [id(i.last) for i in instruments]
        self.by_step: dict[int, dict[str, float]] = {}

    def _collect(self, step: int) -> None:
        for k, inst in enumerate(self.instruments):
            if id(inst.last) != self.seen[k] and inst.last:
                self.seen[k] = id(inst.last)
                self.by_step.setdefault(step, {}).update(inst.last)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._collect(trainer.global_step)  # the Jacobian probe measures in its on_train_batch_start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self._collect(trainer.global_step - 1)  # growth and gradient statistics of the step that just ended


def batches(tokens: torch.Tensor, seed: int, batch_size: int) -> DataLoader:
    """The cached windows ``tokens`` ``(N, T + 1)`` in a seeded order, as ``(x, y)`` batches."""
    order = torch.randperm(tokens.size(0), generator=torch.Generator().manual_seed(seed))
    data = tokens[order]
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size, shuffle=False, drop_last=True)


@contextlib.contextmanager
def denormals_flushed(on: bool = True) -> Iterator[None]:
    """Denormal floats flushed to zero on this thread (the CPU's FTZ/DAZ) while a stress run trains, then not: a
    speed-up at high rates that is part of the protocol (docs/check/README.md, benchmarks/README.md). Only the calling
    thread's setting changes, so ``--threads`` above 1 per worker flushes in its first thread only."""
    flushed = on and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def stress_run(
    subject: str,
    model: nn.Module,
    sites: Sites,
    tokens: torch.Tensor,
    *,
    lr: float,
    seed: int,
    batch_size: int,
    optimisation: Optimisation,
    measure_every: int,
    jacobian_iters: int,
    probe_size: int,
    log_root: Path,
    accelerator: str = "cpu",
    probe_init: bool = True,
    z_loss: float = 0.0,
) -> RunResult:
    """Train ``model`` for ``optimisation.steps`` updates at ``lr`` with every instrument attached.

    The hidden states, attention logits and output logits are measured every ``measure_every`` steps from step 0
    (initialisation) to step ``optimisation.steps`` (after the last update), the block Jacobians after training and,
    with ``probe_init``, at initialisation (:class:`~lnstab.check.probes.BranchProbe`); TensorBoard logs, the
    hidden-state series, divergence events and ``summary.json`` go to ``log_root/<subject>/lr<lr>_seed<seed>/``.
    ``z_loss`` is :class:`StressModule`'s.
    """
    started = time.perf_counter()
    hidden = HiddenStateStatistics(
        every_n_steps=measure_every,
        layer_pattern=sites.hidden_pattern,
        embed_pattern=sites.embed_pattern,
        final_pattern=sites.final_pattern,
        log_heatmap=False,
        unroll_repeats=True,  # a block looped in one forward: each call a layer of its own
    )
    growth = GrowthBoundMonitor(
        every_n_steps=measure_every,
        layer_pattern=sites.hidden_pattern,
        embed_pattern=sites.embed_pattern or r"(?!)",  # none: X_0 is the first layer's input
        final_pattern=sites.final_pattern,
        unroll_repeats=True,  # each call of a looped block a layer, each call of its output norms an update
        **({} if sites.norm_pattern is None else {"norm_pattern": sites.norm_pattern}),
    )
    qk = dict(zip(("q_pattern", "k_pattern", "n_head"), sites.qk, strict=True)) if sites.qk else {}
    head = {"head_pattern": sites.head_pattern} if sites.head_pattern else {}
    instruments: list[Any] = [growth]
    if sites.attention:
        instruments.append(AttentionLogitStatistics(every_n_steps=measure_every, **qk))
    if sites.logits:
        instruments.append(OutputLogitStatistics(every_n_steps=measure_every, **head))
    if sites.param_pattern is not None:
        instruments.append(GradientStatistics(every_n_steps=1, layer_pattern=sites.param_pattern))
    callbacks: list[pl.Callback] = [StabilityLayout(), hidden, *instruments]
    if sites.block_pattern is not None:
        steps = (0, optimisation.steps) if probe_init else (optimisation.steps,)
        jac = BranchProbe(sites.block_pattern, steps, probe_size=probe_size, n_iter=jacobian_iters)
        callbacks.insert(0, jac)  # before the instruments start measuring the step
        instruments.append(jac)
    monitor = DivergenceMonitor(
        policy="stop", layer_pattern=sites.hidden_pattern, loss_explosion_factor=LOSS_EXPLOSION_FACTOR,
        stats_every_n_steps=measure_every if (sites.attention or sites.logits) else 0,
        **({} if sites.attention else {"collapse_fraction": None, "attention_logit_threshold": None}),
        **({} if sites.logits else {"log_z_threshold": None}),
        **head,
        **qk,
    )
    status = RunStatus(signals=(), save_on_interrupt=False)  # summary.json status only; Ctrl-C ends the whole check
    recorder = Recorder(instruments)
    callbacks += [monitor, status, recorder]
    logger = TensorBoardLogger(save_dir=str(log_root), name=subject, version=f"lr{lr:g}_seed{seed}",
                               default_hp_metric=False)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        precision="32-true",  # explicit: the verdicts must not depend on which CPU kind runs the check
        logger=logger,
        callbacks=callbacks,
        max_steps=optimisation.steps + 1,
        gradient_clip_val=optimisation.grad_clip or None,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=False,
    )
    module = StressModule(model, lr, optimisation, z_loss)
    with event_writer_errors() as held, denormals_flushed(accelerator == "cpu"):
        try:
            trainer.fit(module, train_dataloaders=batches(tokens, seed, batch_size))
            logger.experiment.flush()
        except OSError:
            if not held:  # not the event writer's: its own message
                raise
    if held:  # the events could not be written (a full disk): the run's files are incomplete, so no verdict
        raise OSError(held[0].errno, held[0].strerror, str(Path(logger.log_dir)))
    diverged = monitor.diverged_step is not None or not all(math.isfinite(v) for v in module.losses)
    return RunResult(
        subject=subject,
        lr=lr,
        seed=seed,
        log_dir=str(logger.log_dir),
        losses=module.losses,
        diverged=diverged,
        diverged_step=monitor.diverged_step,
        events=list(monitor.events),
        hidden_tags=list(hidden.tags),
        hidden_steps=list(hidden.steps),
        hidden={s: {t: list(v) for t, v in by_tag.items()} for s, by_tag in hidden.values.items()},
        metrics=dict(recorder.by_step),
        wall_s=time.perf_counter() - started,
        repeated=dict(Counter(s.name for s in hidden.sites if s.call is not None)),  # a site per call
        bound_unchecked=growth.unchecked or "",
    )
