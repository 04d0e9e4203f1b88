"""The Lightning loop's cost: ``lnstab fit``'s steps (GPTModule + Trainer, no instruments) against a bare torch loop.

Both train a copy of the same model on the same synthetic data with the same optimizer (the module's own
``configure_optimizers``: fused AdamW and the warmup + cosine LambdaLR), gradient clipping at 1.0, precision ``auto``
(32-true on a CPU without native bf16). The Trainer is ``lnstab fit``'s LNStabTrainer, with a TensorBoard logger, its
step progress bar and lnstab's Throughput callback. The bare
loop takes its steps inside the Trainer's ``on_train_batch_end``, one after each Lightning step, so the two alternate
step by step and drift in machine speed hits both alike: a Lightning step is the time from the hook's exit after one
step to its entry after the next (everything Lightning does per step, the bare step left out). Medians and the
ratio Lightning / bare (goal <= 1.05) are printed.

    python benchmarks/bench_loop.py                      # the quickstart's shape: 4 x 64, context 128, batch 8
    python benchmarks/bench_loop.py --preset small --block 256 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from bench_model import machine_line
from lightning.pytorch.loggers import TensorBoardLogger

from lnstab.callbacks import Throughput
from lnstab.datamodules.synthetic import SyntheticDataModule
from lnstab.module import GPTModule
from lnstab.trainer import LNStabTrainer


class BareLoop(pl.Callback):
    """A plain torch training loop over its own copy of the model, one step per Lightning step; times both."""

    def __init__(self, module: GPTModule, data: SyntheticDataModule, warmup: int, clock: Callable[[], float]) -> None:
        self.model = GPTModule(**module.hparams).model  # same seed, same init as the Lightning module's model
        self.model.load_state_dict(module.model.state_dict())
        self.data, self.warmup, self.clock = data, warmup, clock
        self.bare: list[float] = []
        self.lightning: list[float] = []
        self._exit: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: GPTModule) -> None:
        optimizers = GPTModule.configure_optimizers(_Shim(self.model, pl_module))
        self.opt, self.sched = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
        self.batches = iter(self.data.train_dataloader())

    def _bare_step(self) -> None:
        x, y = next(self.batches)
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: GPTModule, outputs, batch, batch_idx: int) -> None:
        now = self.clock()  # a Lightning step: from this hook's exit last step to its entry now
        if self._exit is not None and batch_idx > self.warmup:
            self.lightning.append(now - self._exit)
        t0 = self.clock()
        self._bare_step()
        if batch_idx >= self.warmup:
            self.bare.append(self.clock() - t0)
        self._exit = self.clock()


class _Shim:
    """What ``GPTModule.configure_optimizers`` reads, for the bare loop's copy of the model (no Trainer attached)."""

    def __init__(self, model: torch.nn.Module, module: GPTModule) -> None:
        self.model, self.hparams, self.trainer, self._trainer = model, module.hparams, module.trainer, module.trainer

    def parameter_groups(self):
        return GPTModule.parameter_groups(self)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--width", type=int, default=64, help="n_embd (the quickstart's 64)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    pl.seed_everything(0, verbose=False)
    module = GPTModule(preset=args.preset, n_embd=args.width, block_size=args.block, pad_vocab_multiple=64,
                       norm_placement="peri", warmup_steps=10,
                       lr_decay_steps=args.steps + args.warmup, learning_rate=3e-3, min_lr=3e-4)
    data = SyntheticDataModule(block_size=args.block, batch_size=args.batch, synthetic_vocab_size=1024,
                               train_tokens=(args.steps + args.warmup + 2) * 2 * args.batch * (args.block + 1),
                               val_tokens=4 * args.batch * (args.block + 1), seed=0)
    data.setup("fit")
    bare = BareLoop(module, data, args.warmup, clock)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = LNStabTrainer(
            accelerator="cpu", devices=1, precision="auto", max_steps=args.steps + args.warmup,
            gradient_clip_val=1.0, log_every_n_steps=10, logger=TensorBoardLogger(tmp, name="bench"),
            callbacks=[bare, Throughput()], enable_checkpointing=False, limit_val_batches=0,
            num_sanity_val_steps=0, enable_model_summary=False,
        )
        trainer.fit(module, data)
    lit, raw = statistics.median(bare.lightning), statistics.median(bare.bare)
    print(f"machine: {machine_line(torch.device('cpu'))}")
    print(f"shape: {args.preset} {args.width} wide, context {args.block}, batch {args.batch}; "
          f"{len(bare.lightning)} steps after {args.warmup} warm-up, {args.clock} clock")
    print(f"Lightning (GPTModule + Trainer) {lit * 1e3:8.1f} ms/step  min-max {min(bare.lightning) * 1e3:.0f}-"
          f"{max(bare.lightning) * 1e3:.0f}")
    print(f"bare torch loop                 {raw * 1e3:8.1f} ms/step  min-max {min(bare.bare) * 1e3:.0f}-"
          f"{max(bare.bare) * 1e3:.0f}")
    print(f"Lightning / bare: {lit / raw:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
