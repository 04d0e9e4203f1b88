"""The Lightning training module: next-token loss, AdamW with decoupled decay on matrices, warmup + cosine."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lnstab.callbacks.run_status import trained_steps
from lnstab.evaluation.core import safe_exp
from lnstab.flops import training_flops
from lnstab.model import GPT
from lnstab.moduleargs import checked_config
from lnstab.rundir import update_summary


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup from ``max_lr/warmup_steps`` to ``max_lr``, then cosine to ``min_lr`` at ``decay_steps``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def warmup_cosine(optimizer: torch.optim.Optimizer, *, peak: float, min_lr: float, warmup_steps: int,
                  decay_steps: int) -> dict[str, Any]:
    """:func:`lr_at` (at least one warmup step) as Lightning's per-step scheduler entry, a multiple of ``peak``."""
    warmup = max(1, warmup_steps)

    def scale(step: int) -> float:
        lr = lr_at(step, max_lr=peak, min_lr=min_lr, warmup_steps=warmup, decay_steps=decay_steps)
        return lr / peak if peak > 0 else 0.0

    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, scale), "interval": "step"}


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: every trainable ≥ 2-D weight (matrices, embeddings) decays by ``weight_decay``; biases and norm
    gains do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class GPTModule(pl.LightningModule):
    """A GPT-2-family language model under any norm placement, trained on next-token prediction.

    Args:
        preset: Shape preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``tiny``, ``mini``, ``small``,
            ``deep-narrow``); the fields below that are ``None`` keep the preset's value.
        norm_placement: ``pre``, ``peri``, ``post``, ``output``, ``none`` or ``deepnorm``.
        norm_type: ``layernorm``, ``rmsnorm`` or ``dyt``.
        residual_scale: Δt > 0, the residual step size.
        block_size: Context length (linked to the data's block size by the CLI).
        n_layer, n_head, n_embd, vocab_size, pad_vocab_multiple, bias, dropout: Overrides of the preset.
        qk_norm, z_loss, dyt_alpha_init, residual_gate, layerscale_init, tie_embeddings, init: The model options
            of :class:`lnstab.model.GPTConfig` (all off by default): query/key norms, the z-loss coefficient, DyT's
            initial α, ``none``/``rezero``/``layerscale`` gates, LayerScale's initial λ (``None``: CaiT's rule),
            untied input and output embeddings (``False``), and ``gpt2`` or ``xavier`` initialisation.
        learning_rate: Peak learning rate after warmup.
        min_lr: Learning rate at the end of the cosine decay.
        warmup_steps: Linear warmup steps.
        lr_decay_steps: Step at which the cosine reaches ``min_lr``; ``None`` uses the trainer's total steps.
        weight_decay: AdamW decay λ on ≥ 2-D weights only (``0`` is the paper's "WD off").
        weight_decay_mode: ``coupled`` (PyTorch's AdamW: ``θ ← θ − η_t·Δ − η_t·λ·θ``, the decay scaled by the
            learning rate) or ``independent`` (Loshchilov & Hutter's original form, Wortsman et al. 2023's
            "independent" decay: ``θ ← θ − η_t·Δ − s_t·λ·θ``, ``s_t = η_t/η_max`` the schedule's multiplier, so the
            decay follows the schedule but not the peak rate). ``independent`` is AdamW with the decaying group's
            ``weight_decay`` set to ``λ/η_max`` (AdamW multiplies it by ``η_t = s_t·η_max``).
        betas: AdamW betas.
        eps: AdamW epsilon.
        compile: Compile the model's forward with ``torch.compile`` (module names, hence hooks, are unchanged).

    **Logged metrics**: ``train/loss``, ``train/lr``, ``train/tokens`` (seen so far, all ranks) and, with
    ``z_loss > 0``, ``train/z_loss``, on the Trainer's logging steps only (``log_every_n_steps``; no host-device
    synchronisation on the other steps), ``val/loss``, ``val/ppl`` (``exp(val/loss)``), ``test/loss``, ``test/ppl``.
    ``train/loss``, ``val/loss`` and ``test/loss`` are the cross-entropy alone, so they compare across runs with and
    without z-loss; the objective that is minimised is ``train/loss + train/z_loss`` (the z-loss term
    ``z_loss·mean (log Z)²``). Throughput and MFU come from :class:`lnstab.callbacks.Throughput`, which reads
    :attr:`flops_per_batch`.
    """

    def __init__(
        self,
        preset: str = "gpt2",
        norm_placement: str = "pre",
        norm_type: str = "layernorm",
        residual_scale: float = 1.0,
        block_size: int = 1024,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        vocab_size: int | None = None,
        pad_vocab_multiple: int | None = None,
        bias: bool | None = None,
        dropout: float | None = None,
        qk_norm: bool = False,
        z_loss: float = 0.0,
        dyt_alpha_init: float = 0.5,
        residual_gate: str = "none",
        layerscale_init: float | None = None,
        tie_embeddings: bool = True,
        init: str = "gpt2",
        learning_rate: float = 6e-4,
        min_lr: float = 6e-5,
        warmup_steps: int = 2000,
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.1,
        weight_decay_mode: str = "coupled",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        compile: bool = False,
    ) -> None:
        super().__init__()
        config = checked_config(locals())
        self.save_hyperparameters()
        self.config = config
        self.model = GPT(self.config)
        # nan_strategy="disable": a NaN batch makes the mean NaN; the default would drop it with a warning, and a
        # divergence study must never average a NaN away.
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.test_loss = MeanMetric(nan_strategy="disable")
        self.loaded_step: int | None = None  # global step of the checkpoint these weights came from
        self.tokens_seen = 0
        self.flops_per_batch: int | None = None  # training FLOPs of one batch, set by the first training batch

    @override
    def configure_model(self) -> None:
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.model.compile()  # in place: parameter and module names (hence hook names) stay as they are
            self._compiled = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``, or with ``targets`` the training objective (the mean next-token cross-entropy, plus
        the z-loss term when ``z_loss > 0``) without whole-batch logits."""
        return self.model(idx, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32 over all positions, from logits (``self(x, y)`` skips the logits)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def _logging_step(self) -> bool:
        """Whether the Trainer writes logs after this training step (its own rule: every ``log_every_n_steps``)."""
        n = self.trainer.log_every_n_steps
        return n > 0 and ((self.trainer.global_step + 1) % n == 0 or self.trainer.should_stop)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        parts = self.model(x, y, loss_parts=True)
        self.tokens_seen += y.numel() * self.trainer.world_size
        if self.flops_per_batch is None:
            self.flops_per_batch = training_flops(self.config, *x.shape)
        if self._logging_step():
            # Reading a device tensor waits for the device, so only on the steps that write logs; and as CPU tensors,
            # because Lightning re-reads the last progress-bar value after every batch, logged or not.
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            ce, z = torch.stack([parts.cross_entropy, parts.z_loss]).cpu()  # one read for both
            self.log("train/loss", ce, prog_bar=True)
            self.log_dict({"train/tokens": torch.tensor(float(self.tokens_seen)), "train/lr": torch.tensor(lr)})
            if self.config.z_loss > 0:
                self.log("train/z_loss", z)
        return parts.loss

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], metric: MeanMetric) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y, loss_parts=True).cross_entropy  # the cross-entropy, with or without z-loss
        metric.update(loss, weight=y.numel())
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, self.val_loss)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, self.test_loss)

    def _log_eval(self, prefix: str, metric: MeanMetric) -> float:
        loss = metric.compute()  # token-weighted mean over every batch of every rank
        metric.reset()
        # Every rank holds this same value already; a max over ranks leaves it as it is, bit for bit, where
        # Lightning's default (no sync) made it ask for sync_dist=True on every run with a distributed strategy
        same = {"sync_dist": True, "reduce_fx": "max", "logger": False}
        values = {f"{prefix}/loss": loss, f"{prefix}/ppl": torch.exp(loss)}
        self.log(f"{prefix}/loss", loss, prog_bar=True, **same)
        self.log(f"{prefix}/ppl", values[f"{prefix}/ppl"], **same)
        # The loggers get them at the step of the weights they score, as summary.json and every instrument do:
        # Lightning's own step for a validation inside a fit is one behind (it counts the step after validating)
        if not self.trainer.sanity_checking:
            step = trained_steps(self.trainer, self)
            for logger in self.trainer.loggers:
                logger.log_metrics({k: v.item() for k, v in values.items()}, step=step)
        return loss.item()

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self._log_eval("val", self.val_loss)
        if not self.trainer.sanity_checking:  # the run's summary.json keeps the latest validation result
            step = trained_steps(self.trainer, self)
            update_summary(self.trainer, val={"loss": loss, "ppl": safe_exp(loss), "step": step})

    @override
    def on_test_epoch_end(self) -> None:
        self._log_eval("test", self.test_loss)

    @override
    def on_validation_start(self) -> None:
        self._log_at_loaded_step()

    @override
    def on_test_start(self) -> None:
        self._log_at_loaded_step()

    def _log_at_loaded_step(self) -> None:
        """Outside a fit (``lnstab validate``/``test``) Lightning logs at the fit loop's step count, 0 in a fresh
        trainer: set it to the checkpoint's step, so that test/loss and val/loss sit beside the run's training
        curve in TensorBoard at the step of the weights they score."""
        trainer = self.trainer
        if trainer.state.fn != TrainerFn.FITTING and self.loaded_step is not None:
            trainer.fit_loop.epoch_loop._batches_that_stepped = self.loaded_step

    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW groups (:func:`decay_groups`): the decaying group's ``weight_decay`` is λ (``coupled``) or λ/η_max
        (``independent``: AdamW's step then decays by ``η_t·λ/η_max = s_t·λ``)."""
        hp = self.hparams
        wd = hp.weight_decay
        if hp.weight_decay_mode == "independent":
            wd = wd / hp.learning_rate if wd > 0 else 0.0
        return decay_groups(self.model, wd)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        # Fused AdamW (one kernel for every parameter) is the fastest; Lightning's mixed-precision plugin refuses to
        # clip gradients for an optimizer that unscales them itself (fused does), so with clipping under 16/bf16-mixed
        # the multi-tensor foreach implementation is used. 32-true clips with fused.
        clipping = bool(self._trainer is not None and self.trainer.gradient_clip_val)
        mixed = self._trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision)
        kind = {"foreach": True} if clipping and mixed else {"fused": True}
        optimizer = torch.optim.AdamW(
            self.parameter_groups(), lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps, **kind
        )
        decay_steps = hp.lr_decay_steps
        if decay_steps is None:
            total = self.trainer.estimated_stepping_batches
            decay_steps = int(total) if math.isfinite(total) else hp.warmup_steps + 1
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine(
            optimizer, peak=hp.learning_rate, min_lr=hp.min_lr, warmup_steps=hp.warmup_steps, decay_steps=decay_steps)}

    @override
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the global norm; under FSDP through the sharded root's ``clip_grad_norm_`` (Lightning's FSDP
        precision plugin refuses norm clipping, since the per-shard ``torch.nn.utils.clip_grad_norm_`` is wrong)."""
        clips = gradient_clip_val is not None and gradient_clip_val > 0  # <= 0: none, as Lightning reads it
        if clips and gradient_clip_algorithm in (None, "norm") and isinstance(self.trainer.strategy, FSDPStrategy):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        self.loaded_step = int(checkpoint.get("global_step", 0))
