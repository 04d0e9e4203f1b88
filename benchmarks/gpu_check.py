"""Phases of benchmarks/gpu_check.sh: throughput and MFU of the shipped configs on one GPU, measured through Lightning.

Every phase builds the Trainer and GPTModule from the shipped YAML (``experiments/base.yaml``, ``fsdp.yaml``, the
experiment file) on lnstab's synthetic token stream (no data download), reads tokens/s and MFU from
:class:`lnstab.callbacks.Throughput`, prints one line per figure and writes them as JSON to ``--out`` (if given).

    python benchmarks/gpu_check.py step          # 124M bf16-mixed, eager and compiled; host reads on quiet steps
    python benchmarks/gpu_check.py instruments   # the paper's instruments against none, whole runs timed
    python benchmarks/gpu_check.py fsdp          # a few steps of the 1.5B FSDP config on this GPU; peak memory
    python benchmarks/gpu_check.py step --dry-run   # tiny shapes on the CPU: checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.loggers import Logger

from lnstab.callbacks import Instruments, Throughput
from lnstab.datamodules.synthetic import SyntheticDataModule
from lnstab.memory import estimate_memory
from lnstab.module import GPTModule
from lnstab.trainer import LNStabTrainer

ROOT = Path(__file__).resolve().parent.parent


class Captured(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    name, version = "gpu_check", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def series(self, key: str, after_step: int = 0) -> list[float]:
        return [m[key] for step, m in self.rows if key in m and (step or 0) > after_step]


class HostReads(pl.Callback):
    """Counts synchronising CUDA calls (``torch.cuda.set_sync_debug_mode``) on training steps that do not log."""

    def __init__(self) -> None:
        self.quiet_steps_with_syncs: list[int] = []
        self._context: Any = None
        self._caught: list = []
        self._step = -1

    def _close(self) -> None:
        if self._context is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._context.__exit__(None, None, None)
            if any("synchroniz" in str(w.message) for w in self._caught):
                self.quiet_steps_with_syncs.append(self._step)
            self._context = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._close()  # a step's window runs from its batch start to the next one (Lightning's batch end included)
        quiet = (trainer.global_step + 1) % trainer.log_every_n_steps != 0
        if torch.cuda.is_available() and quiet and trainer.global_step > 2:
            self._step, self._context = trainer.global_step, warnings.catch_warnings(record=True)
            self._caught = self._context.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._close()


def load_yaml(name: str) -> dict:
    """An experiment file with its ``extends`` chain merged (later keys win, dicts merged, lists replaced)."""
    data = yaml.safe_load((ROOT / "experiments" / name).read_text())
    base = load_yaml(data.pop("extends")) if "extends" in data else {}

    def merge(a: dict, b: dict) -> dict:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}

    return merge(base, data)


def instantiate(spec: dict) -> Any:
    """``{class_path, init_args}`` as in the YAML; a list of class paths among the arguments becomes classes."""
    module, _, name = spec["class_path"].rpartition(".")
    args = dict(spec.get("init_args") or {})
    for key, value in args.items():
        if isinstance(value, list) and value and all(isinstance(v, str) and "." in v for v in value):
            args[key] = {getattr(importlib.import_module(v.rpartition(".")[0]), v.rpartition(".")[2]) for v in value}
    return getattr(importlib.import_module(module), name)(**args)


def build(config: dict, args: argparse.Namespace, steps: int, instruments: bool, **model_overrides: Any):
    """Trainer, module and data as ``lnstab fit`` builds them from a merged config (precision ``auto``, the
    ``instruments:`` group, the strategy block), on synthetic tokens; a tiny CPU run with ``--dry-run``."""
    model_args = {**config["model"], **model_overrides}
    batch = config["data"]["init_args"].get("batch_size", 8)
    trainer_cfg = config["trainer"]
    precision, accelerator, strategy = trainer_cfg.get("precision", "auto"), "gpu", trainer_cfg.get("strategy")
    if args.dry_run:
        model_args.update(preset="tiny", block_size=64)  # compile as configured: the dry run compiles too
        precision, accelerator, batch = "32-true", "cpu", 2
    if isinstance(strategy, dict):
        strategy = "auto" if args.dry_run else instantiate(strategy)  # Lightning's FSDPStrategy needs a GPU
    else:
        strategy = "auto"  # DDP's configuration, on one device
    callbacks = Instruments(**config.get("instruments", {})).callbacks() if instruments else []
    logger = Captured()
    module = GPTModule(**model_args)
    seq, accumulate = module.config.block_size, trainer_cfg.get("accumulate_grad_batches", 1)
    data = SyntheticDataModule(block_size=seq, batch_size=batch, synthetic_vocab_size=module.config.vocab_size,
                               train_tokens=(steps * accumulate + 2) * batch * (seq + 1), val_tokens=4 * (seq + 1),
                               seed=0)
    trainer = LNStabTrainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=steps,
        gradient_clip_val=trainer_cfg["gradient_clip_val"], log_every_n_steps=min(10, max(1, steps // 3)),
        logger=logger,
        accumulate_grad_batches=accumulate, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, Throughput()],
        default_root_dir=tempfile.mkdtemp(prefix="gpu_check_"),  # the run's summary.json, not in the repository
    )
    return trainer, module, data, logger


def report(figures: dict, args: argparse.Namespace, phase: str) -> None:
    for key, value in figures.items():
        print(f"{phase}: {key} = {value:.4g}" if isinstance(value, float) else f"{phase}: {key} = {value}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gpu_check_{phase}.json").write_text(json.dumps(figures, indent=1))


def phase_step(args: argparse.Namespace) -> None:
    """124M (gpt2_pre_dt1.yaml) in bf16-mixed at the config's per-GPU batch: tokens/s and MFU, eager and compiled."""
    config, figures = load_yaml("gpt2_pre_dt1.yaml"), {}
    steps = 6 if args.dry_run else args.steps
    for compiled in (False, True):
        label = "compiled" if compiled else "eager"
        trainer, module, data, logger = build(config, args, steps, instruments=False, compile=compiled)
        reads = HostReads()
        trainer.callbacks.append(reads)
        t0 = time.perf_counter()
        trainer.fit(module, data)
        figures[f"{label}_fit_seconds"] = time.perf_counter() - t0
        warm = steps // 3  # compile and allocator warm-up left out
        tps = logger.series("throughput/tokens_per_s", warm) or logger.series("throughput/tokens_per_s")
        mfu = logger.series("throughput/mfu", warm) or logger.series("throughput/mfu") or [float("nan")]
        figures[f"{label}_tokens_per_s"] = statistics.median(tps)
        figures[f"{label}_mfu"] = statistics.median(mfu)
        figures[f"{label}_quiet_steps_with_host_syncs"] = len(reads.quiet_steps_with_syncs)
    figures["compile_speedup"] = figures["compiled_tokens_per_s"] / figures["eager_tokens_per_s"]
    report(figures, args, "step")


def phase_instruments(args: argparse.Namespace) -> None:
    """Whole runs with the paper's instruments (base.yaml's ``instruments:``) against none, one compiled module,
    A-B-A. With 200 steps the Jacobian probe (every 1000) does not run; bench_callbacks.py amortises it."""
    config = load_yaml("gpt2_peri_dt1.yaml")
    steps = 6 if args.dry_run else args.instrument_steps
    seconds: dict[str, list[float]] = {"none": [], "instruments": []}
    module = None
    for label in ("none", "instruments", "none"):
        trainer, fresh, data, _ = build(config, args, steps, instruments=label == "instruments")
        module = module or fresh  # one module: compiled once, trained on across the runs
        t0 = time.perf_counter()
        trainer.fit(module, data)
        seconds[label].append(time.perf_counter() - t0)
    none = statistics.mean(seconds["none"])
    report({"none_seconds": none, "instruments_seconds": seconds["instruments"][0],
            "overhead": seconds["instruments"][0] / none, "steps_per_run": steps}, args, "instruments")


def phase_fsdp(args: argparse.Namespace) -> None:
    """A few optimizer steps of a 1.5B FSDP experiment on this GPU (or the largest preset that fits)."""
    name = "gpt2-xl_pre_dt1.yaml" if args.preset == "gpt2-xl" else "gpt2-large_pre_dt1.yaml"
    config = load_yaml(name)
    steps = 2 if args.dry_run else args.fsdp_steps
    trainer, module, data, logger = build(config, args, steps, instruments=False)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(module, data)
    figures: dict[str, Any] = {"config": name, "steps": steps, "fit_seconds": time.perf_counter() - t0}
    tps = logger.series("throughput/tokens_per_s")
    figures["tokens_per_s"] = tps[-1] if tps else float("nan")
    figures["mfu"] = (logger.series("throughput/mfu") or [float("nan")])[-1]
    if torch.cuda.is_available():
        batch = config["data"]["init_args"]["batch_size"]
        estimate = estimate_memory(module.config, batch, strategy="fsdp", world_size=1)
        figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        figures["estimated_gib"] = estimate.total / 2**30
    report(figures, args, "fsdp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["step", "instruments", "fsdp"])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; checks the script only")
    ap.add_argument("--out", default=None, help="folder for gpu_check_<phase>.json")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per throughput run")
    ap.add_argument("--instrument-steps", type=int, default=200, help="steps per whole run of the instruments phase")
    ap.add_argument("--fsdp-steps", type=int, default=5)
    ap.add_argument("--preset", default="gpt2-xl", choices=["gpt2-xl", "gpt2-large"])
    args = ap.parse_args()
    torch.set_float32_matmul_precision("high")
    {"step": phase_step, "instruments": phase_instruments, "fsdp": phase_fsdp}[args.phase](args)


if __name__ == "__main__":
    main()
