"""Every callback runs unchanged on lnstab's GPT, Hugging Face GPT-2 and nn.TransformerEncoder, and under DDP."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from fsdp_cpu import CPUDDPSpawnStrategy
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from support.callbacks import LitLM, gpt, lit, loader, tokens, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.data import DataLoader, DistributedSampler

from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
    RunCheckpoint,
    RunStatus,
    StabilityLayout,
    Throughput,
    stability_layout,
)
from lnstab.rundir import read_summary

EXPECTED_HIDDEN = {
    "gpt": ["embed", "L00_attn", "L00_mlp", "L01_attn", "L01_mlp", "final"],
    "hf": ["embed", "L00", "L01", "final"],
    "encoder": ["L00", "L01"],
}


def all_callbacks(every: int = 1) -> list:
    return [
        StabilityLayout(),
        HiddenStateStatistics(every_n_steps=every),
        GrowthBoundMonitor(every_n_steps=every),
        GradientStatistics(every_n_steps=every),
        JacobianSensitivity(every_n_steps=2, n_iter=3),
        DivergenceMonitor(),
        RunStatus(),
    ]


@pytest.mark.parametrize("kind", ["gpt", "hf", "encoder"])
def test_every_callback_runs_unchanged(tmp_path, kind):
    callbacks = all_callbacks()
    t = trainer(tmp_path, callbacks, max_steps=3, tensorboard=True)
    t.fit(lit(kind), loader())
    log_dir = tmp_path / "tb" / "version_0"
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    hidden = callbacks[1]
    assert hidden.tags == EXPECTED_HIDDEN[kind]
    assert {f"hidden/{s}/{tag}" for s in ("mean_abs", "var_entry", "var_data", "max_abs") for tag in hidden.tags} <= (
        scalars
    )
    assert {"grad/norm/L00", "grad/norm/L01", "weight/norm/L01", "grad/norm/total"} <= scalars
    assert {f"jacobian/{k}/L01" for k in ("residual", "sensitivity", "act_scale")} <= scalars
    assert [e.step for e in events.Scalars("jacobian/residual/L00")] == [0, 2]
    assert {"growth/linear_slope", "growth/linear_r2", "growth/exp_rate", "growth/exp_r2"} <= scalars
    assert ("bound/violations" in scalars) == (kind == "gpt")  # only lnstab's Peri-LN has the output norms
    assert all(math.isfinite(v) for v in callbacks[2].last.values())
    for key, value in callbacks[4].last.items():  # ‖I + J_f‖ ≥ ‖J_f‖ − 1 and both are positive
        assert value > 0, key
    assert callbacks[5].events == []
    assert read_summary(log_dir)["status"] == "completed"
    assert events.PluginTagToContent("custom_scalars")
    written = layout_pb2.Layout()  # Theorem 4's charts only where the bound is logged (they were empty elsewhere)
    written.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    categories = [c.title for c in written.category]
    assert ("Growth bound" in categories) == (kind == "gpt") and "Growth across depth" in categories
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in t.lightning_module.modules())


def layouts_in(log_dir) -> int:
    """How many custom-scalars layouts the TensorBoard run in ``log_dir`` holds."""
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    tag = "custom_scalars__config__"
    return len(events.Tensors(tag)) if tag in events.Tags()["tensors"] else 0


def test_each_tensorboard_run_of_a_reused_callbacks_list_gets_its_layout_once(tmp_path):
    """A seed loop: one callbacks list, a new trainer and TensorBoardLogger each fit (version_0, version_1). Before,
    the instance remembered it had added the layout, and only version_0 had one; a later fit into a run that has it
    (a resume in the same process) adds none."""
    callbacks = [StabilityLayout(), HiddenStateStatistics(every_n_steps=1)]
    for seed in (0, 1):
        torch.manual_seed(seed)
        trainer(tmp_path, callbacks, max_steps=2, tensorboard=True).fit(lit("gpt"), loader(8))
    assert [layouts_in(tmp_path / "tb" / f"version_{v}") for v in (0, 1)] == [1, 1]
    again = TensorBoardLogger(tmp_path, name="tb", version=1)
    trainer(tmp_path, callbacks, max_steps=2, logger=again).fit(lit("gpt"), loader(8))
    assert layouts_in(tmp_path / "tb" / "version_1") == 1


def test_fast_dev_run_measures_and_writes_no_file(tmp_path, monkeypatch):
    """Lightning suppresses logging and checkpointing under fast_dev_run (its logger a DummyLogger, so the run
    directory is default_root_dir, the current directory): lnstab's callbacks wrote summary.json, hidden_stats.json,
    divergence_events.jsonl and .lnstab.lock there, over a real run's. They measure all the same."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    callbacks = [*all_callbacks(), RunCheckpoint(save_last=True, every_n_train_steps=1)]
    hidden, growth, monitor = callbacks[1], callbacks[2], callbacks[5]
    module = lit("gpt", loss_scale_at={1: math.nan})  # step 1 diverges: an event, and the run stops
    trainer(tmp_path, callbacks, fast_dev_run=2, enable_checkpointing=True).fit(module, loader())
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["cwd"]
    assert hidden.steps == [0, 1] and growth.last and callbacks[3].last  # measured
    assert [e["kind"] for e in monitor.events][:1] == ["nonfinite_loss"] and monitor.diverged_step == 1


def test_layout_charts_each_statistic_per_layer():
    layout = stability_layout()
    chart = layout["Hidden states"]["hidden/mean_abs"]
    assert chart[0] == "Multiline"
    assert re.match(chart[1][0], "hidden/mean_abs/L07_attn") and not re.match(chart[1][0], "hidden/max_abs/L07")
    bound = layout["Growth bound"]["bound/ma: final mean |h| and its bound"][1][0]
    assert re.match(bound, "bound/ma_bound") and re.match(bound, "bound/ma_final")
    assert not re.match(bound, "bound/slack")
    per_layer, total = (layout["Gradients and weights"][title][1][0] for title in ("grad/norm", "grad/norm/total"))
    assert re.match(per_layer, "grad/norm/L07") and not re.match(per_layer, "grad/norm/total")
    assert re.match(total, "grad/norm/total") and not re.match(total, "grad/norm/L07")
    for prefixed in ("mlp/hidden/mean_abs/L07", "probe/mlp/hidden/mean_abs/L07"):  # metric_prefix: the same chart
        assert re.match(chart[1][0], prefixed) and not re.match(chart[1][0], prefixed.replace("mean_abs", "max_abs"))
    assert not re.match(chart[1][0], "xhidden/mean_abs/L07")


def test_an_evaluation_that_never_runs_has_no_charts():
    from lnstab.callbacks.layout import layout_sources
    from lnstab.evaluation.callback import FinalEvaluation

    assert stability_layout(layout_sources(FinalEvaluation(on_fit_end=False), None)).get("Evaluation")
    never = FinalEvaluation(on_fit_end=False, on_test_end=False)
    assert "Evaluation" not in stability_layout(layout_sources(never, None))


def test_layout_leaves_out_the_charts_of_instruments_not_present():
    layout = stability_layout({"HiddenStateStatistics"})
    assert list(layout) == ["Training", "Hidden states"]  # no empty charts for absent instruments
    assert "MFU" not in layout["Training"] and "loss (train, val, test)" in layout["Training"]
    assert "z-loss" not in layout["Training"] and "z-loss" in stability_layout({"z_loss"})["Training"]
    assert list(stability_layout()) == ["Training", "Hidden states", "Growth bound", "Growth across depth",
                                        "Gradients and weights", "Jacobian", "Attention logits", "Output logits",
                                        "Divergence", "Evaluation"]


class ShardedLM(LitLM):
    """Global batch 8 of a fixed sequence: one process takes all 8, each of 2 ranks takes every other sequence."""

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(tokens(16), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(tokens(16), batch_size=8 // world, sampler=sampler)


def fit_hidden(tmp_path, name: str, **kwargs) -> dict:
    """Train 3 steps on 16 sequences; return the HiddenStateStatistics series the run wrote."""
    from lightning.pytorch import Trainer

    callbacks = [
        HiddenStateStatistics(every_n_steps=1),
        GrowthBoundMonitor(every_n_steps=1),
        GradientStatistics(every_n_steps=1),
        DivergenceMonitor(),
        RunStatus(),
    ]
    t = Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name=name, version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=3,
        callbacks=callbacks,
        use_distributed_sampler=False,
        **kwargs,
    )
    torch.manual_seed(0)
    t.fit(ShardedLM(gpt()))
    return json.loads((tmp_path / name / "version_0" / "hidden_stats.json").read_text())


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_on_the_full_batch(tmp_path):
    torch.set_num_threads(1)
    single = fit_hidden(tmp_path, "single", devices=1)
    ddp = fit_hidden(tmp_path, "ddp", devices=2, strategy=CPUDDPSpawnStrategy())  # each rank: half of the same batch
    assert ddp["tags"] == single["tags"] and ddp["steps"] == single["steps"] == [0, 1, 2]
    for stat, by_tag in single["stats"].items():
        for tag, values in by_tag.items():
            assert ddp["stats"][stat][tag] == pytest.approx(values, rel=1e-5, abs=1e-7), (stat, tag)
    assert read_summary(tmp_path / "ddp" / "version_0")["status"] == "completed"


class SeenMetric(Callback):
    """Writes, per rank, what ``trainer.callback_metrics`` held of ``name`` after each training batch."""

    def __init__(self, out, name: str) -> None:
        self.out, self.name, self.seen = out, name, []

    def on_train_batch_end(self, trainer, *args) -> None:
        value = trainer.callback_metrics.get(self.name)
        self.seen.append(None if value is None else float(value))

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"seen{trainer.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_watching_throughput_under_ddp_saves_on_every_rank_alike(tmp_path):
    """Throughput measured on rank 0 only, so ModelCheckpoint(monitor="throughput/tokens_per_s") found the metric on
    rank 0 alone, which entered the checkpoint's collective while rank 1 skipped it: both ranks hung for ever. Rank
    0's rates now reach every rank's callback_metrics."""
    from lightning.pytorch import Trainer

    torch.set_num_threads(1)
    callbacks = [Throughput(every_n_steps=1), SeenMetric(tmp_path, "throughput/tokens_per_s"),
                 ModelCheckpoint(dirpath=tmp_path / "ck", monitor="throughput/tokens_per_s", mode="max",
                                 every_n_train_steps=1)]
    Trainer(accelerator="cpu", devices=2, strategy=CPUDDPSpawnStrategy(), logger=False, enable_progress_bar=False,
            enable_model_summary=False, max_steps=3, callbacks=callbacks, use_distributed_sampler=False,
            default_root_dir=tmp_path).fit(ShardedLM(gpt()))
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1] and len(seen[0]) == 3 and all(v is not None and v > 0 for v in seen[0]), seen
    assert len(list((tmp_path / "ck").glob("*.ckpt"))) == 1  # the best of the three, top 1
