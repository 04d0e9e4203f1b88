"""Overhead of lnstab's instruments against none, measured in the same run (CPU is fine; ``--accelerator cuda`` too).

Two measurements, each printing ratios against a reference measured in the same invocation (no assertions):

1. **Per step** (the stress case): one fit of a GPT (preset ``mini``, Peri-LN, batch 8 × 128 by default) in which the
   configurations take turns step by step (round-robin: step ``k`` runs configuration ``k % 4``), so drifts in machine
   load hit all of them alike. Every instrument registers its hooks once (as in real use); on the other
   configurations' steps they are no-ops, which is exactly what a non-logging step costs. A step is timed from
   ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step, instrument hooks and their
   host syncs); warm-up steps are dropped. Printed: the median step time per configuration and its ratio to none.
   Goals: ``hidden@1`` (HiddenStateStatistics at every step) ≤ 1.15×; ``logits@1`` (AttentionLogitStatistics and
   OutputLogitStatistics at every step: the attention logits re-formed in chunks, an extra head product) ≤ 1.15×.
2. **Whole run** at the paper's cadence (``base.yaml``: hidden states, bound and gradients every 100 steps,
   DivergenceMonitor every step; with ``--with-jacobian`` also JacobianSensitivity every 1000 steps, i.e. once at
   step 0 of a run shorter than that, which overstates its share — part 1 prints its amortised cost): complete
   ``Trainer.fit`` calls of ``--run-steps`` steps, timed from ``fit`` to its return, configurations interleaved and
   their order alternated over ``--repeats`` rounds. Printed: median wall time per configuration, the ratio of
   medians, the median of the per-round ratios to none, and the ratio of the fastest fits' CPU times (other tenants
   only ever add time, so the minimum is the least disturbed figure). Goals: ``paper`` ≤ 1.02×, and
   ``paper+logits`` (the same with the attention and output-logit instruments every 100 steps and DivergenceMonitor's
   collapse/drift checks on those steps, as the ``Instruments`` group builds them) ≤ 1.02×.

Beside wall time both print the process CPU time (all threads) and its ratio: on a shared machine whose other tenants
take the cores away at random, CPU time is the steadier measure of what the instruments add (on a GPU, read wall).

    python benchmarks/bench_callbacks.py [--preset mini] [--batch 8] [--seq 128] [--steps 96] \
        [--run-steps 300] [--repeats 5] [--threads N] [--with-jacobian] [--skip-per-step] [--skip-run]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from bench_model import machine_line
from torch.utils.data import DataLoader, TensorDataset

from lnstab.callbacks import (
    AttentionLogitStatistics,
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
    OutputLogitStatistics,
    StabilityLayout,
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
        self.cpu: dict[str, list[float]] = {name: [] for name in gates}
        self.current, self.t0, self.c0 = 0, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.current = trainer.global_step % len(self.gates)
        for k, gate in enumerate(self.gates):
            if gate is not None:
                gate.open = k == self.current
        synchronize()
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self, trainer) -> None:
        synchronize()
        self.times[self.names[self.current]].append(time.perf_counter() - self.t0)
        self.cpu[self.names[self.current]].append(time.process_time() - self.c0)


class StepEnd(pl.Callback):
    def __init__(self, clock: RoundRobin) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.stop(trainer)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def per_step_configurations() -> dict[str, Callable[[], list]]:
    return {
        "none": lambda: [],
        "hidden@1": lambda: [HiddenStateStatistics(every_n_steps=1, log_heatmap=False)],
        "divergence@1": lambda: [DivergenceMonitor()],
        "logits@1": lambda: [AttentionLogitStatistics(every_n_steps=1), OutputLogitStatistics(every_n_steps=1)],
        "all@1": lambda: [
            HiddenStateStatistics(every_n_steps=1, log_heatmap=False),
            GrowthBoundMonitor(every_n_steps=1),
            GradientStatistics(every_n_steps=1),
            DivergenceMonitor(),
        ],
    }


def paper_configurations(probe: torch.Tensor, with_jacobian: bool = False) -> dict[str, Callable[[], list]]:
    def paper() -> list:
        return [
            StabilityLayout(),
            HiddenStateStatistics(every_n_steps=100),
            GrowthBoundMonitor(every_n_steps=100),
            GradientStatistics(every_n_steps=100),
            DivergenceMonitor(policy="stop", every_n_steps=1),
        ]

    def paper_logits() -> list:
        return [
            *paper()[:-1],
            AttentionLogitStatistics(every_n_steps=100),
            OutputLogitStatistics(every_n_steps=100),
            DivergenceMonitor(policy="stop", every_n_steps=1, stats_every_n_steps=100),
        ]

    configs = {"none": lambda: [], "paper": paper, "paper+logits": paper_logits}
    if with_jacobian:
        jacobian = dict(every_n_steps=1000, probe_size=2, probe=probe)
        configs["paper+jacobian"] = lambda: [*paper(), JacobianSensitivity(**jacobian)]
    return configs


def make_trainer(args, tmp: str, steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=steps,
        logger=pl.loggers.CSVLogger(tmp),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def per_step(args, config: GPTConfig, x: torch.Tensor) -> None:
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=args.batch)
    gates = {name: (Gate(make()) if name != "none" else None) for name, make in per_step_configurations().items()}
    clock = RoundRobin(gates)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        callbacks = [clock, *[g for g in gates.values() if g is not None], StepEnd(clock)]
        make_trainer(args, tmp, args.steps + args.warmup, callbacks).fit(Lit(config), data)
        module = Lit(config).to(args.accelerator)
        jacobian = JacobianSensitivity(probe_size=1, n_iter=10, probe=x[:1])
        jacobian.setup(None, module, "fit")
        jacobian.measure(module)
        synchronize()
        t0 = time.perf_counter()
        jacobian.measure(module)
        jacobian_s = time.perf_counter() - t0
    skip = args.warmup // len(gates)
    med = {name: statistics.median(values[skip:]) for name, values in clock.times.items()}
    cpu = {name: statistics.median(values[skip:]) for name, values in clock.cpu.items()}
    base = med["none"]
    print(f"\n1. per step: {args.steps} steps round-robin over {len(gates)} configurations "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"{'configuration':<16}{'median step ms':>16}{'ratio to none':>15}{'CPU ms':>10}{'CPU ratio':>11}")
    for name, value in med.items():
        print(f"{name:<16}{1000 * value:>16.1f}{value / base:>15.3f}{1000 * cpu[name]:>10.1f}"
              f"{cpu[name] / cpu['none']:>11.3f}")
    print(f"JacobianSensitivity.measure (probe 1x{args.seq}, 10 iterations): {1000 * jacobian_s:.0f} ms = "
          f"{jacobian_s / base:.1f} steps; amortised every 1000 steps: {1 + jacobian_s / base / 1000:.4f}")


def whole_run(args, config: GPTConfig, x: torch.Tensor) -> None:
    configs = paper_configurations(x[:2], args.with_jacobian)
    walls: dict[str, list[float]] = {name: [] for name in configs}
    cpus: dict[str, list[float]] = {name: [] for name in configs}
    start = time.perf_counter()
    n = args.batch * args.run_steps
    data = DataLoader(TensorDataset(x[:n], torch.roll(x[:n], -1, 1)), batch_size=args.batch)
    for r in range(args.repeats + 1):  # round 0 warms caches up and is dropped
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = make_trainer(args, tmp, args.run_steps, configs[name]())
                module = Lit(config)
                synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                trainer.fit(module, data)
                synchronize()
                if r:
                    walls[name].append(time.perf_counter() - t0)
                    cpus[name].append(time.process_time() - c0)
    print(f"\n2. whole run: {args.run_steps} steps per fit, {args.repeats} interleaved rounds "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"{'configuration':<16}{'median fit s':>14}{'ratio of medians':>18}{'median ratio':>14}"
          f"{'CPU s':>8}{'CPU ratio':>11}{'CPU min ratio':>15}")
    for name in configs:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        paired = statistics.median(a / b for a, b in zip(walls[name], walls["none"], strict=True))
        ratio = wall / statistics.median(walls["none"])
        print(f"{name:<16}{wall:>14.2f}{ratio:>18.3f}{paired:>14.3f}{cpu:>8.1f}"
              f"{cpu / statistics.median(cpus['none']):>11.3f}{min(cpus[name]) / min(cpus['none']):>15.3f}")
    if "paper+logits" in configs:
        added = statistics.median(a / b for a, b in zip(walls["paper+logits"], walls["paper"], strict=True))
        print(f"paper+logits against paper: median ratio {added:.3f}, CPU min ratio "
              f"{min(cpus['paper+logits']) / min(cpus['paper']):.3f} (what the new instruments add)")
    print("CPU min ratio: fastest fit against fastest fit; other tenants only ever add time, so the minimum is the "
          "least disturbed figure")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--run-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--with-jacobian", action="store_true", help="add paper+jacobian to the whole-run timing")
    parser.add_argument("--skip-per-step", action="store_true")
    parser.add_argument("--skip-run", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    config = GPTConfig.preset(args.preset, vocab_size=args.vocab, block_size=args.seq, norm_placement="peri")
    g = torch.Generator().manual_seed(0)
    rows = args.batch * max(args.steps + args.warmup, args.run_steps)
    x = torch.randint(0, config.vocab_size, (rows, args.seq), generator=g)
    device = torch.device("cuda" if args.accelerator in ("gpu", "cuda") else "cpu")
    print(f"machine: {machine_line(device)} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"preset={args.preset} batch={args.batch}x{args.seq} vocab={args.vocab} {args.accelerator} {args.precision}")
    if not args.skip_per_step:
        per_step(args, config, x)
    if not args.skip_run:
        whole_run(args, config, x)


if __name__ == "__main__":
    main()
