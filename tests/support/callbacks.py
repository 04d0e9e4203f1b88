"""Tiny LightningModules and helpers shared by the tests of lnstab.callbacks.

Three models, none from lnstab.module: lnstab's GPT, Hugging Face GPT-2 and torch.nn.TransformerEncoder, each in a
minimal LightningModule that trains on random tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lnstab.model import GPT, GPTConfig

VOCAB, SEQ = 100, 16


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
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


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
