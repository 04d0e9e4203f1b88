"""Training throughput and model FLOP utilisation, timed between device synchronisations on the logging steps."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput as _Window
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lnstab import validation as require

from ._aside import aside_seconds
from ._sites import offer_to_callbacks

# Dense bf16/fp16 tensor-core peaks for GPUs that Lightning's table misses or lists with sparsity (H200: the same
# Hopper silicon as the H100 SXM, 989 TFLOP/s dense; Lightning's "h200 sxm1" entry is the 2:4-sparse figure and its
# name parsing does not match "NVIDIA H200"). fp32 uses TF32 unless float32_matmul_precision is "highest".
DENSE_PEAKS: dict[str, dict[Any, float]] = {
    "h200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, "tfloat32": 494.7e12, torch.float32: 66.9e12},
}


@functools.lru_cache(maxsize=8)
def cpu_matmul_peak(dtype: torch.dtype = torch.float32, threads: int | None = None, size: int = 1024) -> float:
    """FLOP/s of the best of a few ``size × size`` matrix products on this CPU (cached per process and threads).

    The CPU has no table of peaks, so MFU on a CPU is measured against what a large, well-shaped product reaches here.
    """
    del threads  # part of the cache key only: the peak depends on torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    a @ b  # warm-up (oneDNN primitive creation)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one device in ``dtype``: Lightning's table (and :data:`DENSE_PEAKS`) on GPUs, measured on CPUs."""
    if device.type == "cpu":
        return cpu_matmul_peak(dtype, torch.get_num_threads())
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for chip, peaks in DENSE_PEAKS.items():
            if chip in name:
                key = dtype
                if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
                    key = "tfloat32"
                return peaks.get(key)
    peak = get_available_flops(device, dtype)
    return float(peak) if peak else None


def compute_dtype(precision: str | int) -> torch.dtype:
    """The dtype matrix products run in under a Lightning precision value (``"bf16-mixed"`` → bf16, ...)."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


def batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Samples and tokens of a batch: the first tensor of ``(x, y)``, a mapping (``input_ids`` first; a dict or Hugging
    Face's ``BatchEncoding``) or a tensor."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids", next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"cannot count tokens of a batch of type {type(batch).__name__}; expected a tensor, (x, y) "
                        "or a dict with input_ids")
    return batch.size(0), batch.numel()


class Throughput(Callback):
    """Tokens/s, samples/s, FLOP/s and MFU of training in TensorBoard, on any device.

    Built on Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` (the rolling window behind its
    ``ThroughputMonitor``) and its table of device peaks, with two differences from ``ThroughputMonitor``: the device is
    synchronised only on the steps that log (``ThroughputMonitor`` synchronises after every batch, which stalls a GPU
    that the host would otherwise keep fed), so a rate is the work between two synchronised points divided by the time
    between them, which includes all the work in between; and it needs no callable arguments, so it is set from YAML.

    FLOPs come from the LightningModule's ``flops_per_batch`` attribute (training FLOPs of one batch on one device,
    as for ``ThroughputMonitor``; :class:`lnstab.module.GPTModule` sets it from :func:`lnstab.flops.training_flops`);
    without it, FLOP/s and MFU are not logged. The peak is Lightning's table for GPUs (dense figures for the H200),
    or a measured matrix-product peak on a CPU (:func:`cpu_matmul_peak`), in the precision plugin's compute dtype.
    Validation time between two logging steps is left out of the training rates, and so is the time of work that
    instruments do between steps (:class:`JacobianSensitivity`'s probe).

    Args:
        every_n_steps: Log every this many optimizer steps; ``None`` uses the Trainer's ``log_every_n_steps``.
        window: Logging intervals the rates average over (``1``: since the previous logging step).
        peak_flops: Peak FLOP/s of one device, overriding the table / measurement (e.g. for an unlisted GPU).

    **Logged metrics** (at ``trainer.global_step``, measured on rank 0 and in every rank's ``callback_metrics``):
        ``throughput/tokens_per_s``, ``throughput/samples_per_s`` (all devices), ``throughput/device/tokens_per_s``,
        ``throughput/device/flops_per_s`` (model FLOPs, matmuls only), ``throughput/mfu`` (device FLOP/s over the
        device peak, 0-1), ``throughput/peak_flops`` (the peak used, once).

    Raises:
        ConfigError: ``every_n_steps`` or ``window`` not a positive integer, ``peak_flops`` not a positive number.

    Example::

        trainer = Trainer(logger=TensorBoardLogger("runs"), log_every_n_steps=10, callbacks=[Throughput()])
    """

    def __init__(self, every_n_steps: int | None = None, window: int = 1, peak_flops: float | None = None) -> None:
        super().__init__()
        self.every_n_steps = None if every_n_steps is None else require.positive_int("every_n_steps", every_n_steps)
        self.window = require.positive_int("window", window)
        self.peak_flops = require.optional_number("peak_flops", peak_flops, 0.0, low_open=True)
        self._device = torch.device("cpu")
        self._clock = time.perf_counter
        self._reset()

    def _reset(self) -> None:
        self._rates: _Window | None = None
        self._t0 = self._paused = self._val_started = self._aside0 = 0.0
        self._batches = self._samples = self._tokens = self._batches_logged = 0
        self._last_step = -1
        self._peak_logged = False

    def _sync_time(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return self._clock()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device
        if stage != "fit" or not trainer.is_global_zero:
            return
        if self.peak_flops is None:
            dtype = compute_dtype(trainer.precision)
            self.peak_flops = device_peak_flops(self._device, dtype)
            if self.peak_flops is None:
                rank_zero_warn(f"Throughput: no peak FLOP/s known for {self._device}; set peak_flops to log MFU")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._last_step = trainer.global_step  # on every rank: each decides alike when the next logging step is
        if trainer.is_global_zero:
            self._rates = _Window(available_flops=self.peak_flops, world_size=trainer.world_size,
                                  window_size=self.window + 1)
            self._t0 = self._sync_time()
            self._aside0 = aside_seconds(trainer)
            self._rates.update(time=1e-9, batches=0, samples=0, lengths=0, flops=0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rates is None and trainer.world_size == 1:
            return
        step, every = trainer.global_step, self.every_n_steps or trainer.log_every_n_steps
        logs = not (step == self._last_step or every < 1 or step % every)  # the same on every rank
        metrics: dict[str, float] | None = None
        if self._rates is not None:
            samples, tokens = batch_size_and_tokens(batch)
            self._batches, self._samples = self._batches + 1, self._samples + samples
            self._tokens += tokens
            if logs:  # no synchronisation on the steps that do not log (and once per optimizer step with accumulation)
                elapsed = self._sync_time() - self._t0 - self._paused - (aside_seconds(trainer) - self._aside0)
                flops_per_batch = getattr(pl_module, "flops_per_batch", None)
                flops = (None if flops_per_batch is None
                         else int(flops_per_batch) * (self._batches - self._batches_logged))
                self._batches_logged = self._batches
                self._rates.update(time=elapsed, batches=self._batches, samples=self._samples, lengths=self._tokens,
                                   flops=flops)
                metrics = self._metrics(trainer, self._rates.compute())
        if not logs:
            return
        self._last_step = step
        if trainer.world_size > 1:  # rank 0's rates on every rank, so a callback watching one decides alike on all
            metrics = trainer.strategy.broadcast(metrics, src=0)  # (else ModelCheckpoint's collective waits for ever)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        offer_to_callbacks(trainer, metrics)  # ModelCheckpoint/EarlyStopping can watch them, as every instrument's

    def _metrics(self, trainer: pl.Trainer, rates: dict[str, float]) -> dict[str, float]:
        world = trainer.world_size
        metrics: dict[str, float] = {}
        if "device/items_per_sec" in rates:
            metrics["throughput/device/tokens_per_s"] = rates["device/items_per_sec"]
            metrics["throughput/tokens_per_s"] = rates["device/items_per_sec"] * world
            metrics["throughput/samples_per_s"] = rates["device/samples_per_sec"] * world
        if "device/flops_per_sec" in rates:
            metrics["throughput/device/flops_per_s"] = rates["device/flops_per_sec"]
            if "device/mfu" in rates:
                metrics["throughput/mfu"] = rates["device/mfu"]
        if self.peak_flops and not self._peak_logged:
            metrics["throughput/peak_flops"] = float(self.peak_flops)
            self._peak_logged = True
        return metrics

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rates is not None and not trainer.sanity_checking:
            self._val_started = self._sync_time()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rates is not None and not trainer.sanity_checking and self._val_started:
            self._paused += self._sync_time() - self._val_started
            self._val_started = 0.0

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rates = None
