"""Step-time overhead of lnstab's instruments against none, measured in the same run (CPU is fine).

Every configuration trains the same GPT (preset ``mini`` by default, batch 8 × 128) for ``--steps`` steps; the
configurations are interleaved over ``--rounds`` rounds so that drifts in machine load hit all of them alike. The
time of each step is taken between ``on_train_batch_start`` and ``on_train_batch_end`` (forward, backward,
optimizer and every instrument's hooks); the first ``--warmup`` steps of each fit are dropped. Printed: the median
step-time ratio against the run without instruments, and the mean ratio (which includes the logging steps, i.e. the
amortised cost). Goals: ≤ 2 % with everything at every 50 steps, ≤ 15 % for HiddenStateStatistics at every step.

    python benchmarks/bench_callbacks.py [--preset mini] [--batch 4] [--seq 64] [--steps 12] [--rounds 2]
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
from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
)
from torch.utils.data import DataLoader, TensorDataset

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


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)


def configurations() -> dict[str, Callable[[], list]]:
    def everything(n: int) -> list:
        return [
            HiddenStateStatistics(every_n_steps=n, log_heatmap=False),
            GrowthBoundMonitor(every_n_steps=n),
            GradientStatistics(every_n_steps=n),
            DivergenceMonitor(),  # always every step
        ]

    return {
        "none": lambda: [],
        "hidden@1": lambda: [HiddenStateStatistics(every_n_steps=1, log_heatmap=False)],
        "hidden@50": lambda: [HiddenStateStatistics(every_n_steps=50, log_heatmap=False)],
        "divergence@1": lambda: [DivergenceMonitor()],
        "all@1": lambda: everything(1),
        "all@50": lambda: everything(50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    config = GPTConfig.preset(args.preset, vocab_size=args.vocab, block_size=args.seq, norm_placement="peri")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (args.batch * args.steps, args.seq), generator=g)
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=args.batch)
    configs = configurations()
    times: dict[str, list[float]] = {name: [] for name in configs}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, make in configs.items():
                timer = StepTimer()
                trainer = pl.Trainer(
                    accelerator="cpu",
                    devices=1,
                    max_steps=args.steps,
                    logger=pl.loggers.CSVLogger(tmp),
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    enable_checkpointing=False,
                    callbacks=[timer, *make()],
                )
                trainer.fit(Lit(config), data)
                times[name] += timer.times[args.warmup :]
                print(
                    f"  round done: {name:<14} median {1000 * statistics.median(timer.times[args.warmup :]):.0f} ms",
                    flush=True,
                )
        module = Lit(config)
        jacobian = JacobianSensitivity(probe_size=1, n_iter=10, probe=x[:1])
        jacobian.setup(None, module, "fit")
        jacobian.measure(module)
        t0 = time.perf_counter()
        for _ in range(3):
            jacobian.measure(module)
        jacobian_s = (time.perf_counter() - t0) / 3
    med = {name: statistics.median(values) for name, values in times.items()}
    base = med["none"]
    print(
        f"preset={args.preset} batch={args.batch}x{args.seq} vocab={args.vocab} steps={args.steps}x{args.rounds} "
        f"rounds, threads={torch.get_num_threads()} (total {time.perf_counter() - start:.0f} s)"
    )
    print(f"{'configuration':<16}{'median step ms':>16}{'ratio to none':>15}")
    for name, value in med.items():
        print(f"{name:<16}{1000 * value:>16.1f}{value / base:>15.3f}")
    print("amortised over 50 steps (49 no-op steps + 1 logging step, from the medians above):")
    for what in ("hidden", "all"):
        amortised = med[f"{what}@50"] + (med[f"{what}@1"] - med[f"{what}@50"]) / 50
        print(f"  {what + '@50':<14}{amortised / base:>15.3f}")
    print(
        f"JacobianSensitivity.measure (probe 1x{args.seq}, 10 iterations): {1000 * jacobian_s:.0f} ms = "
        f"{jacobian_s / base:.1f} steps; amortised every 1000 steps: {1 + jacobian_s / base / 1000:.4f}"
    )


if __name__ == "__main__":
    main()
