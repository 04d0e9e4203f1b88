"""Step-time overhead of lnstab's instruments against none, measured in the same run (CPU is fine).

One fit of a GPT (preset ``mini``, Peri-LN, batch 8 × 128 by default) in which the configurations take turns step by
step (round-robin: step ``k`` runs configuration ``k % 4``), so drifts in machine load hit all of them alike. Every
instrument registers its hooks once (as in real use); on the other configurations' steps they are no-ops, which is
exactly what a non-logging step costs. A step is timed from ``on_train_batch_start`` to ``on_train_batch_end``
(forward, backward, optimizer step, instrument hooks and their host syncs); warm-up steps are dropped. Printed:
the median step time per configuration, its ratio to none, and the cost amortised over a cadence of 50 steps
(``(49·none + 1·logging step) / 50·none``), plus the cost of one JacobianSensitivity measurement. Goals: ≤ 2 %
with everything at every 50 steps, ≤ 15 % for HiddenStateStatistics at every step. No assertions.

    python benchmarks/bench_callbacks.py [--preset mini] [--batch 8] [--seq 128] [--steps 96]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
)
from lnstab.model import GPT, GPTConfig


class Lit(pl.LightningModule):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Gate(pl.Callback):
    """Runs ``callbacks`` (hooks registered once, in ``setup``) only on the steps this gate is open."""

    def __init__(self, callbacks: list[pl.Callback]) -> None:
        self.callbacks, self.open = callbacks, False

    def setup(self, trainer, pl_module, stage):
        for c in self.callbacks:
            c.setup(trainer, pl_module, stage)

    def teardown(self, trainer, pl_module, stage):
        for c in self.callbacks:
            c.teardown(trainer, pl_module, stage)

    def on_train_batch_start(self, *args):
        if self.open:
            for c in self.callbacks:
                c.on_train_batch_start(*args)

    def on_before_backward(self, *args):
        if self.open:
            for c in self.callbacks:
                c.on_before_backward(*args)

    def on_before_optimizer_step(self, *args):
        if self.open:
            for c in self.callbacks:
                c.on_before_optimizer_step(*args)

    def on_train_batch_end(self, *args):
        if self.open:
            for c in self.callbacks:
                c.on_train_batch_end(*args)


class RoundRobin(pl.Callback):
    """Opens one gate per step in turn (gate ``step % k``) and times the step from here to :class:`StepEnd`."""

    def __init__(self, gates: dict[str, Gate | None]) -> None:
        self.names, self.gates = list(gates), list(gates.values())
        self.times: dict[str, list[float]] = {name: [] for name in gates}
        self.current, self.t0 = 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.current = trainer.global_step % len(self.gates)
        for k, gate in enumerate(self.gates):
            if gate is not None:
                gate.open = k == self.current
        self.t0 = time.perf_counter()

    def stop(self, trainer) -> None:
        self.times[self.names[self.current]].append(time.perf_counter() - self.t0)


class StepEnd(pl.Callback):
    def __init__(self, clock: RoundRobin) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.stop(trainer)


def configurations() -> dict[str, Callable[[], list]]:
    return {
        "none": lambda: [],
        "hidden@1": lambda: [HiddenStateStatistics(every_n_steps=1, log_heatmap=False)],
        "divergence@1": lambda: [DivergenceMonitor()],
        "all@1": lambda: [
            HiddenStateStatistics(every_n_steps=1, log_heatmap=False),
            GrowthBoundMonitor(every_n_steps=1),
            GradientStatistics(every_n_steps=1),
            DivergenceMonitor(),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    config = GPTConfig.preset(args.preset, vocab_size=args.vocab, block_size=args.seq, norm_placement="peri")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (args.batch * (args.steps + args.warmup), args.seq), generator=g)
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=args.batch)
    gates = {name: (Gate(make()) if name != "none" else None) for name, make in configurations().items()}
    clock = RoundRobin(gates)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.steps + args.warmup,
            logger=pl.loggers.CSVLogger(tmp),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[clock, *[g for g in gates.values() if g is not None], StepEnd(clock)],
        )
        trainer.fit(Lit(config), data)
        module = Lit(config)
        jacobian = JacobianSensitivity(probe_size=1, n_iter=10, probe=x[:1])
        jacobian.setup(None, module, "fit")
        jacobian.measure(module)
        t0 = time.perf_counter()
        jacobian.measure(module)
        jacobian_s = time.perf_counter() - t0
    skip = args.warmup // len(gates)
    med = {name: statistics.median(values[skip:]) for name, values in clock.times.items()}
    base = med["none"]
    print(
        f"preset={args.preset} batch={args.batch}x{args.seq} vocab={args.vocab}, {args.steps} steps round-robin over "
        f"{len(gates)} configurations, threads={torch.get_num_threads()} (total {time.perf_counter() - start:.0f} s)"
    )
    print(f"{'configuration':<16}{'median step ms':>16}{'ratio to none':>15}{'@50 amortised':>15}")
    for name, value in med.items():
        amortised = (base + (value - base) / 50) / base  # 49 no-op steps (hooks off) + 1 logging step
        print(f"{name:<16}{1000 * value:>16.1f}{value / base:>15.3f}{amortised:>15.3f}")
    print(
        f"JacobianSensitivity.measure (probe 1x{args.seq}, 10 iterations): {1000 * jacobian_s:.0f} ms = "
        f"{jacobian_s / base:.1f} steps; amortised every 1000 steps: {1 + jacobian_s / base / 1000:.4f}"
    )


if __name__ == "__main__":
    main()
