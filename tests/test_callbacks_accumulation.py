"""Instruments under gradient accumulation: 4 micro-batches of 2 give the statistics of 1 batch of 8, each instrument
logs once per optimizer step, and a NaN or an overflow in the first micro-batch is caught at its step and layer."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from support.callbacks import SGDLM, ListLogger, LitLM, ParamWatch, gpt, loader, trainer, unchanged

from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    JacobianSensitivity,
)
from lnstab.callbacks._tap import Subscription

PREFIXES = ("hidden/", "bound/", "growth/", "grad/", "jacobian/")


def fit(tmp_path, name: str, batch_size: int, accumulate: int, steps: int = 3, wrap=None) -> ListLogger:
    logger = ListLogger(tmp_path / name)
    callbacks = [
        HiddenStateStatistics(every_n_steps=1, log_heatmap=False, series_file=None),
        GrowthBoundMonitor(every_n_steps=1),
        GradientStatistics(every_n_steps=1),
        JacobianSensitivity(every_n_steps=2, n_iter=3, probe=torch.arange(12)[None] % 100),
        DivergenceMonitor(),
    ]
    torch.manual_seed(0)
    t = trainer(tmp_path / name, callbacks, max_steps=steps, accumulate_grad_batches=accumulate, logger=logger)
    module = SGDLM(gpt())
    if wrap is not None:
        wrap(module.model)
    t.fit(module, loader(n=8 * steps, batch_size=batch_size))
    assert callbacks[-1].events == []
    return logger


def by_step(logger: ListLogger) -> tuple[dict[int, dict[str, float]], Counter]:
    merged: dict[int, dict[str, float]] = {}
    calls: Counter = Counter()
    for step, metrics in logger.rows:
        for prefix in PREFIXES:
            if any(k.startswith(prefix) for k in metrics):
                calls[(step, prefix)] += 1
        merged.setdefault(step, {}).update({k: v for k, v in metrics.items() if k.startswith(PREFIXES)})
    return merged, calls


def test_four_micro_batches_equal_one_batch_and_log_once_per_step(tmp_path):
    single, calls_single = by_step(fit(tmp_path, "single", batch_size=8, accumulate=1))
    micro, calls_micro = by_step(fit(tmp_path, "micro", batch_size=2, accumulate=4))
    expected_calls = {(s, p): 1 for s in range(3) for p in PREFIXES if p != "jacobian/"}
    expected_calls.update({(0, "jacobian/"): 1, (2, "jacobian/"): 1})
    assert calls_micro == calls_single == Counter(expected_calls)  # once per optimizer step, not per micro-batch
    assert sorted(micro) == sorted(single) == [0, 1, 2]
    for step in range(3):
        assert set(micro[step]) == set(single[step])
        assert {"bound/ma_bound", "growth/exp_rate", "grad/norm/L01", "hidden/var_data/L01_mlp"} <= set(single[step])
        for key, value in single[step].items():
            if key == "bound/violations":
                assert micro[step][key] == value == 0
            elif key.startswith(("growth/linear_r2", "growth/exp_r2")):
                assert micro[step][key] == pytest.approx(value, abs=1e-5), (step, key)
            else:
                assert micro[step][key] == pytest.approx(value, rel=2e-5, abs=1e-7), (step, key)


class MicroClock(pl.Callback):
    def __init__(self, accumulate: int) -> None:
        self.accumulate, self.step, self.micro = accumulate, -1, -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step, self.micro = trainer.global_step, batch_idx % self.accumulate


def test_nan_in_the_first_micro_batch_is_caught_at_its_step_and_layer(tmp_path):
    module, clock, watch = LitLM(gpt()), MicroClock(2), ParamWatch()
    target = module.model.transformer.h[1].resid_attn
    target.register_forward_hook(lambda m, a, out: out * float("nan") if (clock.step, clock.micro) == (3, 0) else None)
    monitor = DivergenceMonitor(policy="stop")
    t = trainer(tmp_path, [clock, watch, monitor], max_steps=10, accumulate_grad_batches=2)
    t.fit(module, loader(n=64, batch_size=2))
    kinds = {e["kind"]: e for e in monitor.events}
    assert {"nonfinite_loss", "nonfinite_activation", "nonfinite_grad"} <= set(kinds)
    assert all(e["step"] == 3 for e in monitor.events)
    assert kinds["nonfinite_activation"]["layer"] == "L01_attn"
    assert t.global_step == 4 and monitor.diverged_step == 3
    assert unchanged(watch, 3)  # the update was dropped although micro-batch 1 was clean
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_overflow_in_the_first_micro_batch_is_caught_at_its_step_and_layer(tmp_path):
    module, clock = LitLM(gpt()), MicroClock(2)
    target = module.model.transformer.h[0].resid_mlp
    target.register_forward_hook(lambda m, a, out: out * 1e30 if (clock.step, clock.micro) == (1, 0) else None)
    monitor = DivergenceMonitor(policy="skip", overflow_fraction=1e-10)
    trainer(tmp_path, [clock, monitor], max_steps=3, accumulate_grad_batches=2).fit(module, loader(batch_size=2))
    overflow = [(e["step"], e["layer"]) for e in monitor.events if e["kind"] == "activation_overflow"]
    assert overflow == [(1, "L00_mlp")]


def test_jacobian_measures_once_per_optimizer_step(tmp_path):
    callback = JacobianSensitivity(every_n_steps=2, n_iter=2)
    measured = []
    original = callback.measure
    callback.measure = lambda module, trainer=None: (measured.append(trainer.global_step), original(module, trainer))[1]
    trainer(tmp_path, [callback], max_steps=4, accumulate_grad_batches=3).fit(LitLM(gpt()), loader(n=24, batch_size=2))
    assert measured == [0, 2]


def test_activation_checkpointing_recompute_is_not_counted_again(tmp_path, monkeypatch):
    """Checkpointed blocks run their forward again inside backward; the instruments must see each micro-batch once,
    so every statistic and every count equals the run without checkpointing (same weights, same data)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from lnstab.model import Block

    recomputed: list[bool] = []

    def checkpoint_blocks(model: torch.nn.Module) -> None:  # as FSDP's activation_checkpointing_policy={Block} does
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        in_backward = lambda *_: recomputed.append(torch._C._current_graph_task_id() != -1)  # noqa: E731
        model.transformer.h[0].resid_attn.register_forward_hook(in_backward)

    captures: Counter = Counter()
    add = Subscription.add
    monkeypatch.setattr(Subscription, "add", lambda sub, i, view: (captures.update([run]), add(sub, i, view))[1])
    run = "plain"
    plain = by_step(fit(tmp_path, "plain", batch_size=4, accumulate=2))
    run = "checkpointed"
    wrapped = by_step(fit(tmp_path, "checkpointed", batch_size=4, accumulate=2, wrap=checkpoint_blocks))
    assert any(recomputed), "no block was recomputed in backward: the test would check nothing"
    assert captures["checkpointed"] == captures["plain"] > 0  # every site captured once per micro-batch
    assert wrapped[1] == plain[1]  # each instrument logged once per optimizer step
    for step, metrics in plain[0].items():
        assert set(wrapped[0][step]) == set(metrics)
        for key, value in metrics.items():
            assert wrapped[0][step][key] == pytest.approx(value, rel=2e-5, abs=1e-7), (step, key)
