"""Instruments under Lightning's FSDPStrategy (2 CPU processes, gloo, each Block its own unit, 2 micro-batches of 2 per
rank) equal one process on the global batch of 8: hidden statistics, bound and growth from γ, β shards, gradient and
weight norms summed over shards, the Jacobian and a forward/generate through ``unsharded`` on the full parameters."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from fsdp_cpu import CPUFSDPStrategy
from lightning.pytorch.loggers import CSVLogger
from support.callbacks import PROBE, STEPS, Recorder, ShardedSGD

from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
    RunStatus,
)
from lnstab.model import Block
from lnstab.rundir import read_summary, run_dir


def fit(tmp_path: Path, name: str, **kwargs) -> tuple[dict, dict]:
    accumulate = kwargs.pop("accumulate_grad_batches", 1)
    instruments = [
        HiddenStateStatistics(every_n_steps=1, log_heatmap=False),
        GrowthBoundMonitor(every_n_steps=1),
        GradientStatistics(every_n_steps=1),
        JacobianSensitivity(every_n_steps=2, n_iter=4, probe=PROBE),
    ]
    recorder = Recorder(str(tmp_path / f"{name}.json"), instruments)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name=name, version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=STEPS,
        callbacks=[*instruments, DivergenceMonitor(), RunStatus(), recorder],
        use_distributed_sampler=False,
        accumulate_grad_batches=accumulate,
        **kwargs,
    )
    torch.manual_seed(0)
    trainer.fit(ShardedSGD(accumulate))
    hidden = json.loads((tmp_path / name / "version_0" / "hidden_stats.json").read_text())
    assert read_summary(tmp_path / name / "version_0")["status"] == "completed"
    return hidden, json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process_on_the_full_batch(tmp_path):
    torch.set_num_threads(1)
    hidden, single = fit(tmp_path, "single", devices=1)
    strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    hidden_fsdp, fsdp = fit(tmp_path, "fsdp", devices=2, strategy=strategy, accumulate_grad_batches=2)

    assert hidden_fsdp["tags"] == hidden["tags"] and hidden_fsdp["steps"] == hidden["steps"] == [0, 1, 2]
    for stat, by_tag in hidden["stats"].items():
        for tag, values in by_tag.items():
            assert hidden_fsdp["stats"][stat][tag] == pytest.approx(values, rel=1e-5, abs=1e-7), (stat, tag)
    assert sorted(fsdp["steps"]) == sorted(single["steps"]) == ["0", "1", "2"]
    for step, expected in single["steps"].items():
        got = fsdp["steps"][step]
        assert set(got) == set(expected), step
        assert {"bound/ma_bound", "grad/norm/L01", "weight/norm/total", "growth/exp_rate"} <= set(expected)
        assert ("jacobian/residual/L01" in expected) == (step in ("0", "2"))
        for key, value in expected.items():
            tolerance = dict(abs=1e-5) if key.endswith("_r2") else dict(rel=2e-4 if "jacobian" in key else 2e-5)
            assert got[key] == pytest.approx(value, **tolerance), (step, key)
    assert fsdp["generated"] == single["generated"]
    assert fsdp["logits"] == pytest.approx(single["logits"], rel=1e-5, abs=1e-6)
    assert fsdp["param_sq"] == pytest.approx(single["param_sq"], rel=1e-6)  # full parameters, not one shard


class NaNOnRankOne(pl.Callback):
    """Rank 1's first micro-batch of step 1 turns NaN after ``h.1.resid_attn``; rank 0's activations stay finite."""

    def __init__(self) -> None:
        self.at = None

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:
            target = pl_module.model.transformer.h[1].resid_attn
            target.register_forward_hook(lambda m, a, out: out * float("nan") if self.at == (1, 0) else None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at = (trainer.global_step, batch_idx % 2)

    def on_train_end(self, trainer, pl_module):
        finite = DivergenceMonitor.params_finite(pl_module, trainer)  # every rank's shard, reduced
        if trainer.is_global_zero:
            (run_dir(trainer) / "finite.json").write_text(json.dumps(finite))


@pytest.mark.slow
def test_fsdp_ranks_agree_to_stop_on_a_nan_only_one_rank_saw(tmp_path):
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CPUFSDPStrategy(auto_wrap_policy={Block}),
        logger=CSVLogger(tmp_path, name="nan", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=STEPS,
        callbacks=[NaNOnRankOne(), DivergenceMonitor(policy="stop", fatal_kinds="nonfinite_activation"), RunStatus()],
        use_distributed_sampler=False,
        accumulate_grad_batches=2,
    )
    torch.manual_seed(0)
    trainer.fit(ShardedSGD(2))
    run = tmp_path / "nan" / "version_0"
    events = [json.loads(line) for line in (run / "divergence_events.jsonl").read_text().splitlines()]
    # rank 0's record: the NaN reached its gradient shard through the reduce-scatter (not fatal here), and it stopped
    # because rank 1's fatal activation was summed into the step's one collective
    assert [(e["step"], e["kind"]) for e in events] == [(1, "nonfinite_grad"), (1, "remote")]
    assert json.loads((run / "finite.json").read_text()) is True  # the NaN update was dropped on every shard
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["diverged_step"] == 1 and summary["final_step"] == 2
