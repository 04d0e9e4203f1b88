"""A small GPTModule and data for the LightningModule tests, a callback recording what each step reads, and the
bytes autograd saves for a backward pass."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lnstab.datamodules.synthetic import SyntheticDataModule
from lnstab.model import GPT
from lnstab.module import GPTModule

VOCAB = 64


def small_module(**overrides) -> GPTModule:
    kwargs = dict(preset="tiny", vocab_size=VOCAB, block_size=32, learning_rate=3e-3, min_lr=3e-4, warmup_steps=5)
    kwargs.update(overrides)
    return GPTModule(**kwargs)


def small_data(seed: int = 0) -> SyntheticDataModule:
    return SyntheticDataModule(
        block_size=32, batch_size=8, synthetic_vocab_size=VOCAB, train_tokens=20_000, val_tokens=2_000, seed=seed
    )


class StepOfRead(pl.Callback):
    """The storage of every tensor read to the host (``item``, ``tolist``, ``bool``, ``float`` …), by training step.

    Reads of the optimizer's step counters are left out, by identity: torch's non-capturable AdamW keeps each
    parameter's ``step`` on the CPU whatever the parameter's device (so reading it never waits for a device) and its
    foreach implementation, which ``bf16-mixed`` with clipping uses, reads it with ``item()`` every step. They are
    counted apart, in ``step_counter_reads``, and must be CPU tensors.
    """

    def __init__(self, monkeypatch) -> None:
        self.step: int | None = None
        self.reads: dict[int | None, set[int]] = {}
        self.step_counter_reads = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _is_step_counter(self, tensor: torch.Tensor) -> bool:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                if state.get("step") is tensor:
                    assert tensor.device.type == "cpu", "a step counter on a device would synchronise it"
                    return True
        return False

    def _counted(self, fn):
        def read(tensor, *args, **kwargs):
            if self._is_step_counter(tensor):
                self.step_counter_reads += 1
            else:
                self.reads.setdefault(self.step, set()).add(tensor.untyped_storage().data_ptr())
            return fn(tensor, *args, **kwargs)

        return read

    def on_train_start(self, trainer, pl_module) -> None:
        self.optimizers = list(trainer.optimizers)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step  # reads until the next batch starts belong to this step (logging included)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.step = None


def saved_bytes(model: GPT, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass of ``model(x, x)``, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(storages.values())
