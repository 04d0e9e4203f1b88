"""Throughput and MFU: rates from synchronised points on the logging steps only, FLOPs per batch, device peaks."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import Logger
from support.callbacks import lit, loader, trainer

from lnstab.callbacks import JacobianSensitivity, StepProgressBar, Throughput
from lnstab.callbacks import _aside as aside_module
from lnstab.callbacks import throughput as tp
from lnstab.datamodules.synthetic import SyntheticDataModule
from lnstab.flops import measured_training_flops, training_flops
from lnstab.model import GPTConfig
from lnstab.module import GPTModule


class Captured(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    name, version = "captured", 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


class FakeClock(pl.Callback):
    """Half a second per training batch, 100 s per validation batch: validation must not lower training rates."""

    def __init__(self, monitor: Throughput) -> None:
        self.now = 1000.0
        monitor._clock = lambda: self.now

    def on_train_batch_end(self, *args) -> None:
        self.now += 0.5

    def on_validation_batch_end(self, *args) -> None:
        self.now += 100.0


def test_rates_flops_and_mfu_on_the_logging_steps(tmp_path) -> None:
    monitor = Throughput(peak_flops=1e12)
    logger = Captured()
    module = GPTModule(preset="tiny", vocab_size=64, block_size=32, warmup_steps=2)
    data = SyntheticDataModule(block_size=32, batch_size=4, synthetic_vocab_size=64, train_tokens=10_000,
                               val_tokens=1_000, seed=0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, log_every_n_steps=2, val_check_interval=3,
                         limit_val_batches=2, num_sanity_val_steps=0, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[FakeClock(monitor), monitor],
                         default_root_dir=tmp_path)  # the run's summary.json goes there, not into the working directory
    trainer.fit(module, data)
    rows = [(step, m) for step, m in logger.rows if any(k.startswith("throughput/") for k in m)]
    assert [step for step, _ in rows] == [2, 4, 6]
    flops = training_flops(module.config, 4, 32)
    assert module.flops_per_batch == flops
    for _, m in rows:
        assert m["throughput/tokens_per_s"] == pytest.approx(4 * 32 / 0.5)  # validation's 200 s left out
        assert m["throughput/samples_per_s"] == pytest.approx(4 / 0.5)
        assert m["throughput/device/tokens_per_s"] == m["throughput/tokens_per_s"]
        assert m["throughput/device/flops_per_s"] == pytest.approx(flops / 0.5)
        assert m["throughput/mfu"] == pytest.approx(flops / 0.5 / 1e12)
    assert [("throughput/peak_flops" in m) for _, m in rows] == [True, False, False]
    # in callback_metrics too, as every instrument's metric (before: loggers only, so nothing could monitor them)
    assert float(trainer.callback_metrics["throughput/tokens_per_s"]) == pytest.approx(4 * 32 / 0.5)


def test_formula_flops_equal_lightnings_count_on_the_meta_device() -> None:
    for config, b, t in [(GPTConfig.preset("tiny", vocab_size=97, block_size=16), 3, 16),
                         (GPTConfig.preset("gpt2", pad_vocab_multiple=64, norm_placement="peri"), 2, 1024)]:
        assert training_flops(config, b, t) == measured_training_flops(config, b, t)


def test_peaks_lightnings_table_dense_h200_and_a_measured_cpu(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert tp.device_peak_flops(gpu, torch.bfloat16) == pytest.approx(989.4e12)  # Lightning's table
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert tp.device_peak_flops(gpu, torch.bfloat16) == pytest.approx(989.4e12)  # dense, not Lightning's sparse 2e15
    peak = tp.device_peak_flops(torch.device("cpu"), torch.float32)
    assert peak > 1e8 and tp.device_peak_flops(torch.device("cpu"), torch.float32) == peak  # measured once, cached
    assert tp.compute_dtype("bf16-mixed") == torch.bfloat16 and tp.compute_dtype("32-true") == torch.float32


def test_batch_shapes_and_bad_arguments() -> None:
    x = torch.zeros(4, 16, dtype=torch.long)
    assert tp.batch_size_and_tokens((x, x)) == tp.batch_size_and_tokens({"input_ids": x}) == (4, 64)
    with pytest.raises(TypeError, match="cannot count tokens"):
        tp.batch_size_and_tokens([1, 2])
    from transformers import BatchEncoding  # what Hugging Face's tokenizers and data collators return: a UserDict

    assert tp.batch_size_and_tokens(BatchEncoding({"input_ids": x, "labels": x[:, :3]})) == (4, 64)
    with pytest.raises(ValueError, match="every_n_steps=0 is not allowed"):
        Throughput(every_n_steps=0)
    with pytest.raises(ValueError, match="peak_flops=-1 is not allowed"):
        Throughput(peak_flops=-1)


def test_the_jacobian_probe_is_left_out_of_the_rates_and_said_on_the_bar(tmp_path, monkeypatch) -> None:
    # the probe made slow on a fake clock (75 s, 150 training steps of 0.5 s), the clock that aside() measures it with
    # too: the rate of the step it runs in must equal its neighbours' (before, that step read 1/151 of them), and the
    # bar says what runs meanwhile. No wall time is asserted (a 1.5 s sleep within a 4x band failed on a loaded CPU).
    shown: list[str] = []
    original = JacobianSensitivity._measure
    bar, monitor = StepProgressBar(), Throughput(every_n_steps=1)
    clock = FakeClock(monitor)
    monkeypatch.setattr(aside_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    def slow_measure(self, module):
        shown.append(bar.train_progress_bar.postfix)
        clock.now += 75.0
        return original(self, module)

    monkeypatch.setattr(JacobianSensitivity, "_measure", slow_measure)
    logger = Captured()
    run = trainer(tmp_path, [bar, clock, monitor, JacobianSensitivity(every_n_steps=5, n_iter=1)],
                  max_steps=9, enable_progress_bar=True, logger=logger)
    run.fit(lit("gpt"), loader(n=64))
    rates = {step: m["throughput/tokens_per_s"] for step, m in logger.rows if "throughput/tokens_per_s" in m}
    assert sorted(rates) == list(range(1, 10))
    per_batch = rates[1]  # one batch's tokens over 0.5 s
    assert rates == pytest.approx(dict.fromkeys(range(1, 10), per_batch))  # step 6 ran the probe (step 5's batch)
    assert shown == ["jacobian probe…"] * 2
    assert bar.train_progress_bar.postfix != "jacobian probe…"


def test_the_rich_bar_says_the_probe_runs(tmp_path, monkeypatch) -> None:
    bar, shown = RichProgressBar(), []
    original = JacobianSensitivity._measure

    def measure(self, module):
        shown.append(next(t.description for t in bar.progress.tasks if t.id == bar.train_progress_bar_id))
        return original(self, module)

    monkeypatch.setattr(JacobianSensitivity, "_measure", measure)
    trainer(tmp_path, [bar, JacobianSensitivity(every_n_steps=2, n_iter=1)], max_steps=3,
            enable_progress_bar=True).fit(lit("gpt"), loader())
    assert len(shown) == 2 and all(d.endswith("jacobian probe…") for d in shown), shown
