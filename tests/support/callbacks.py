"""Tiny LightningModules and helpers shared by the tests of lnstab.callbacks.

Three models, none from lnstab.module: lnstab's GPT, Hugging Face GPT-2 and torch.nn.TransformerEncoder, each in a
minimal LightningModule that trains on random tokens; and what several callback tests share: a logger that keeps
every logged value, plain and sharded SGD, recorders of parameters and hook calls, the attention statistics computed
directly.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lnstab.callbacks import _stats, unsharded
from lnstab.model import GPT, GPTConfig

VOCAB, SEQ = 100, 16
GLOBAL_BATCH, STEPS = 8, 3
PROBE = (torch.arange(12)[None] * 7) % 100
NAMES = ("max_logit", "entropy_mean", "entropy_min", "collapsed")


class LitLM(pl.LightningModule):
    """Next-token loss on ``(x, y)`` batches; ``self.model(x)`` returns logits ``(B, T, V)``."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, loss_scale_at: dict[int, float] | None = None) -> None:
        super().__init__()
        self.model, self.lr, self.loss_scale_at = model, lr, loss_scale_at or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        return loss * self.loss_scale_at.get(self.global_step, 1.0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class HFWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False)
        config.bos_token_id = config.eos_token_id = 0
        self.hf = GPT2LMHeadModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits


class EncoderLM(nn.Module):
    """``nn.TransformerEncoder``; ``batch_first=False`` (torch's default) runs it on ``(T, B, d)``; ``final_norm``:
    with torch's final ``LayerNorm`` (``encoder.norm``)."""

    def __init__(self, batch_first: bool = True, final_norm: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=batch_first)
        norm = nn.LayerNorm(32) if final_norm else None
        self.encoder = nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.head(self.encoder(self.embed(x)))
        return self.head(self.encoder(self.embed(x).transpose(0, 1)).transpose(0, 1))


def gpt(placement: str = "peri", **overrides) -> GPT:
    config = GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=32, norm_placement=placement, **overrides)
    return GPT(config)


def lit(kind: str = "gpt", **kwargs) -> LitLM:
    torch.manual_seed(0)
    model = {"gpt": lambda: gpt(**kwargs.pop("gpt", {})), "hf": HFWrapper, "encoder": EncoderLM}[kind]()
    return LitLM(model, **kwargs)


def tokens(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


def loader(n: int = 16, batch_size: int = 4, seed: int = 0) -> DataLoader:
    return DataLoader(tokens(n, seed), batch_size=batch_size, shuffle=False)


def trainer(tmp_path, callbacks: list, max_steps: int = 4, tensorboard: bool = False, **kwargs) -> pl.Trainer:
    logger = TensorBoardLogger(tmp_path, name="tb") if tensorboard else CSVLogger(tmp_path, name="csv")
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=max_steps,
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**options, **kwargs})


class StepClock(pl.Callback):
    """Holds the current ``global_step`` so that test hooks know which step they run in."""

    def __init__(self) -> None:
        self.step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step


def record_outputs(
    root: nn.Module, pattern: str, clock: StepClock, use_input: bool = False
) -> tuple[dict[tuple[int, str], torch.Tensor], Callable[[], None]]:
    """Keep a copy of every output (or first input) of modules matching ``pattern``, keyed ``(step, name)``."""
    store: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def keep(name: str, x: torch.Tensor) -> None:  # returns None: the hooks never replace inputs or outputs
        store.setdefault((clock.step, name), x.detach().clone())

    for name, module in root.named_modules():
        if re.search(pattern, name):
            if use_input:
                handles.append(module.register_forward_pre_hook(lambda m, a, name=name: keep(name, a[0])))
            else:
                handles.append(
                    module.register_forward_hook(
                        lambda m, a, o, name=name: keep(name, o[0] if isinstance(o, tuple) else o)
                    )
                )
    return store, lambda: [h.remove() for h in handles]


def direct_stats(x: torch.Tensor) -> dict[str, float]:
    """The four statistics of HiddenStateStatistics computed straight from one ``(B, ...)`` tensor."""
    x = x.double()
    flat = x.reshape(x.shape[0], -1)
    return {
        "mean_abs": flat.abs().mean().item(),
        "var_entry": flat.var(dim=1, unbiased=False).mean().item(),
        "var_data": flat.var(dim=0, unbiased=False).mean().item(),
        "max_abs": flat.abs().max().item(),
    }


class ListLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``; the run directory is ``save_dir``."""

    def __init__(self, save_dir) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []
        self._save_dir = str(save_dir)

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


class SGDLM(LitLM):
    """Plain SGD: an update is linear in the gradient, so summing micro-batch gradients changes only rounding."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ManualLM(LitLM):
    """Manual optimisation: one ``manual_backward`` a ``training_step``, then ``optimizers`` AdamWs (the parameters
    split in order) stepped one after the other; the loss of batch ``nan_batch`` is NaN."""

    def __init__(self, model: nn.Module, optimizers: int = 2, nan_batch: int | None = None) -> None:
        super().__init__(model)
        self.automatic_optimization = False
        self.n_optimizers, self.nan_batch = optimizers, nan_batch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        if batch_idx == self.nan_batch:
            loss = loss * math.nan
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return loss.detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        params = list(self.parameters())
        k = math.ceil(len(params) / self.n_optimizers)
        return [torch.optim.AdamW(params[i : i + k], lr=self.lr) for i in range(0, len(params), k)]


class ShardedSGD(LitLM):
    """Global batch 8 of fixed sequences split over ranks and micro-batches; SGD (updates linear in the gradient)."""

    def __init__(self, accumulate: int) -> None:
        super().__init__(gpt(residual_scale=0.5))
        self.accumulate = accumulate

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        data = tokens(GLOBAL_BATCH * STEPS)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // world // self.accumulate, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Recorder(pl.Callback):
    """Every instrument's ``last`` after each optimizer step, and the model's output through ``unsharded`` at the end,
    written as JSON by rank 0."""

    def __init__(self, path: str, instruments: list) -> None:
        self.path, self.instruments, self.rows, self.started = path, instruments, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.started:  # the step's last micro-batch
            for instrument in self.instruments:
                self.rows.setdefault(str(self.started), {}).update(instrument.last)
                instrument.last = {}

    def on_train_end(self, trainer, pl_module):
        with unsharded(trainer, pl_module) as module, torch.no_grad():
            logits = module(PROBE).double()
            generated = module.model.generate(PROBE[:, :4], max_new_tokens=6, greedy=True)
            params = sum(p.double().square().sum().item() for p in module.parameters())
        if trainer.is_global_zero:
            result = {"steps": self.rows, "logits": logits.flatten()[:50].tolist(), "generated": generated.tolist(),
                      "param_sq": params, "logit_sum": logits.sum().item()}
            Path(self.path).write_text(json.dumps(result))


def hook_counts(module: torch.nn.Module) -> dict[str, int]:
    return {
        name: len(m._forward_hooks) + len(m._forward_pre_hooks)
        for name, m in module.named_modules()
        if m._forward_hooks or m._forward_pre_hooks
    }


class SyncCounter(pl.Callback):
    """Counts host syncs (``tolist``, ``item``, ``bool``, ``float``, ``int`` of a tensor) made by lnstab's instruments,
    per optimizer step."""

    def __init__(self, monkeypatch) -> None:
        self.step, self.counts = -1, Counter()
        root = os.path.dirname(os.path.abspath(_stats.__file__))
        for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
            original = getattr(torch.Tensor, name)

            def wrapper(tensor, *args, _original=original, _name=name):
                import sys

                frame = sys._getframe(1)
                if frame.f_code.co_filename.startswith(root):
                    self.counts[(self.step, os.path.basename(frame.f_code.co_filename))] += 1
                return _original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, wrapper)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        self.step = "end"


def direct(qs: list[torch.Tensor], ks: list[torch.Tensor], scale: float, min_keys: int = 2,
           softcap: float | None = None, window: int | None = None) -> dict[str, float]:
    """The four statistics from the materialised float64 attention of micro-batches ``(q, k)`` pooled together;
    q ``(B, H, T, hs)``, k ``(B, H_kv, T, hs)`` (each k head repeated for its group of q heads, as Llama does); with
    ``softcap`` the softmax of ``softcap·tanh(z / softcap)`` (the largest logit uncapped), with ``window`` keys
    ``i − window < j ≤ i`` only (Gemma 2)."""
    q = torch.cat(qs).double()
    k = torch.cat(ks).double()
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # (B, H, T, hs)
    T = q.size(2)
    z = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        visible &= ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    capped = softcap * torch.tanh(z / softcap) if softcap else z
    p = capped.masked_fill(~visible, -math.inf).softmax(dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(dim=-1)[..., min_keys - 1 :]  # (B, H, T')
    collapsed = (p.amax(dim=-1)[..., min_keys - 1 :] > 0.99).double()
    return {"max_logit": z[..., visible].abs().max().item(), "entropy_mean": entropy.mean().item(),
            "entropy_min": entropy.min().item(), "collapsed": collapsed.mean().item()}


def assert_close(got: dict[str, float], expected: dict[str, float], layer: str, context=None) -> None:
    for name in NAMES:
        assert got[f"attn/{name}/{layer}"] == pytest.approx(expected[name], rel=1e-5, abs=1e-5), (context, name)


def fit_fixed(tmp_path, module: LitLM, callbacks: list, steps: int = 2, batch_size: int = 2, accumulate: int = 2):
    """``steps`` optimizer steps at lr 0 (the weights never change) of ``batch_size × accumulate`` sequences."""
    logger = ListLogger(tmp_path)
    module.lr = 0.0
    t = trainer(tmp_path, callbacks, max_steps=steps, accumulate_grad_batches=accumulate, logger=logger)
    t.fit(module, loader(n=batch_size * accumulate * steps, batch_size=batch_size))
    return logged(logger), tokens(batch_size * accumulate * steps).tensors[0]


class MaxNumel(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any operation inside the block allocated (views of existing tensors do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        shared = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:  # not a view
                self.largest = max(self.largest, t.numel())
        return out


class ParamWatch(pl.Callback):
    """Copies of the weights before and after each step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]


def unchanged(watch: ParamWatch, step: int) -> bool:
    return all(torch.equal(a, b) for a, b in zip(watch.before[step], watch.after[step], strict=True))


def logged(logger: ListLogger) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, metrics in logger.rows:
        out.setdefault(step, {}).update({k: v for k, v in metrics.items() if k.startswith(("attn/", "output/"))})
    return {s: m for s, m in out.items() if m}
