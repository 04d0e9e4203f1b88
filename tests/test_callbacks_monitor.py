"""The instruments' metrics reach ``trainer.callback_metrics``, so Lightning's EarlyStopping and ModelCheckpoint
use them."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from support.callbacks import lit, loader, trainer

from lnstab.callbacks import (
    AttentionLogitStatistics,
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
    OutputLogitStatistics,
)


class Series(pl.Callback):
    """After every training batch, the ``last`` metrics of ``instrument`` (its latest measurement), by step."""

    def __init__(self, instrument, name: str) -> None:
        self.instrument, self.name, self.values = instrument, name, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.name in self.instrument.last:
            self.values[trainer.global_step] = self.instrument.last[self.name]


def test_early_stopping_stops_on_a_hidden_statistic(tmp_path):
    hidden = HiddenStateStatistics(every_n_steps=1)
    name = "hidden/mean_abs/final"
    # any finite mean |x| is below the threshold: the first check (end of epoch 0) stops the run
    stop = EarlyStopping(monitor=name, mode="min", stopping_threshold=1e9, check_on_train_epoch_end=True)
    t = trainer(tmp_path, [hidden, stop], max_steps=-1, max_epochs=5)
    t.fit(lit("gpt"), loader(n=16, batch_size=4))  # 4 batches an epoch
    assert t.global_step == 4 and stop.stopped_epoch == 0
    assert t.callback_metrics[name].item() == pytest.approx(hidden.last[name], rel=1e-6)


def test_model_checkpoint_keeps_the_step_with_the_largest_attention_logit(tmp_path):
    attention = AttentionLogitStatistics(every_n_steps=1)
    name = "attn/max_logit/L01"
    series = Series(attention, name)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=name, mode="max", save_top_k=1, every_n_train_steps=1,
                           filename="{step}")
    t = trainer(tmp_path, [attention, series, best], max_steps=6, enable_checkpointing=True)
    t.fit(lit("gpt", lr=3e-2), loader(n=32, batch_size=4))  # a large learning rate: the logits move
    assert len(set(series.values.values())) > 1, "the largest logit did not move, so the test cannot tell"
    top_step = max(series.values, key=series.values.get)
    assert best.best_model_score.item() == pytest.approx(series.values[top_step], rel=1e-6)
    assert best.best_model_path.endswith(f"step={top_step}.ckpt")


def test_every_instrument_metric_is_a_callback_metric_at_its_latest_value(tmp_path):
    instruments = [
        HiddenStateStatistics(every_n_steps=2),
        GrowthBoundMonitor(every_n_steps=2),
        GradientStatistics(every_n_steps=2),
        JacobianSensitivity(every_n_steps=2, n_iter=2),
        AttentionLogitStatistics(every_n_steps=2),
        OutputLogitStatistics(every_n_steps=2),
    ]
    t = trainer(tmp_path, instruments, max_steps=4)  # measured on steps 0 and 2
    t.fit(lit("gpt"), loader(n=32))
    metrics = t.callback_metrics
    for instrument in instruments:
        assert instrument.last, type(instrument).__name__
        for name, value in instrument.last.items():
            assert name in metrics, name
            got = metrics[name].item()
            assert got == pytest.approx(value, rel=1e-6) or (math.isnan(got) and math.isnan(value)), name
    assert {"growth/linear_slope", "output/log_z_mean", "grad/norm/total", "jacobian/residual/L01"} <= set(metrics)


def test_divergence_events_reach_early_stopping(tmp_path):
    # the loss of step 12 is scaled by 1e6, a spike against the 12 before it; DivergenceMonitor only records it
    # (policy continue) and EarlyStopping, watching the event count, stops the run at the end of that epoch
    divergence = DivergenceMonitor(policy="continue")
    stop = EarlyStopping(monitor="divergence/events", mode="min", divergence_threshold=0.5,
                         check_on_train_epoch_end=True)
    t = trainer(tmp_path, [divergence, stop], max_steps=-1, max_epochs=3)
    t.fit(lit("gpt", loss_scale_at={12: 1e6}), loader(n=64, batch_size=4))  # 16 batches an epoch
    assert [(e["step"], e["kind"]) for e in divergence.events] == [(12, "loss_spike")]
    assert t.callback_metrics["divergence/events"].item() == 1.0
    assert t.global_step == 16 and stop.stopped_epoch == 0
