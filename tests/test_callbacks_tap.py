"""The shared tap and the statistics registry: one hook per site whatever watches it, a shared primitive computed
once, a statistic added through the registry alone, state only on capture steps in the dtype it needs, no host sync
on steps that do not log, and strategies refused in one line."""

from __future__ import annotations

import json
from collections import Counter
from functools import cached_property

import lightning.pytorch as pl
import pytest
import torch
from support.callbacks import StepClock, SyncCounter, direct_stats, hook_counts, lit, loader, record_outputs, trainer

from lnstab.callbacks import (
    DivergenceMonitor,
    GradientStatistics,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    SiteView,
    Statistic,
    _stats,
    register_statistic,
    stability_layout,
)
from lnstab.callbacks._strategy import require_strategy, strategy_kind
from lnstab.errors import ConfigError

SITES = {
    "model.transformer.drop": "embed",
    **{f"model.transformer.h.{i}.resid_{k}": f"L{i:02d}_{k}" for i in range(2) for k in ("attn", "mlp")},
}


class HookSpy(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(hook_counts(pl_module))


def test_one_hook_per_site_however_many_instruments_watch(tmp_path):
    module = lit("gpt")
    spy = HookSpy()
    instruments = [HiddenStateStatistics(every_n_steps=1), GrowthBoundMonitor(every_n_steps=1), DivergenceMonitor()]
    trainer(tmp_path, [*instruments, spy], max_steps=2).fit(module, loader())
    expected = {**dict.fromkeys(SITES, 1), "model.transformer.ln_f": 1}  # 6 sites, 6 hooks (was 3 × 5 + 2)
    assert spy.seen == [expected, expected]
    assert hook_counts(module) == {}  # all removed in teardown
    assert instruments[0].last and instruments[1].last and instruments[2].events == []


def test_a_primitive_two_instruments_share_is_computed_once(tmp_path, monkeypatch):
    calls = Counter()
    original = SiteView.max_abs.func

    def counting(self):
        calls[self.x.shape] += 1
        return original(self)

    prop = cached_property(counting)
    prop.__set_name__(SiteView, "max_abs")
    monkeypatch.setattr(SiteView, "max_abs", prop)
    hidden, monitor = HiddenStateStatistics(every_n_steps=1), DivergenceMonitor()
    trainer(tmp_path, [hidden, monitor], max_steps=1).fit(lit("gpt"), loader())
    assert sum(calls.values()) == 6  # one per site and forward, though both instruments read max |x|
    assert monitor.events == [] and hidden.last["hidden/max_abs/L01_mlp"] > 0


@pytest.fixture
def rms_statistic():
    """A statistic that is not lnstab's: the RMS of the stream, registered as the only change."""
    stat = register_statistic(
        Statistic(
            "rms",
            "sum",
            measure=lambda v: torch.stack([v.flat.square().sum(), v.flat.new_full((), v.flat.numel())]),
            finish=lambda s: (s[0] / s[1]).sqrt(),
            doc="root mean square of every entry",
            default=True,
        )
    )
    yield stat
    _stats.unregister("rms")


def test_a_new_statistic_through_the_registry_alone(tmp_path, rms_statistic):
    module = lit("gpt", lr=0.0)
    clock = StepClock()
    store, remove = record_outputs(module, r"transformer\.(drop|h\.\d+\.resid_(attn|mlp))$", clock)
    callback = HiddenStateStatistics(every_n_steps=1)  # default statistics now include "rms"
    t = trainer(tmp_path, [clock, callback], max_steps=2, accumulate_grad_batches=2)
    t.fit(module, loader(batch_size=2))
    remove()
    assert callback.stats == ("mean_abs", "var_entry", "var_data", "max_abs", "rms")
    data = loader(batch_size=2).dataset.tensors[0]
    for step in range(2):
        for name, tag in SITES.items():
            # lr=0: the two micro-batches of a step are one forward on the four sequences they hold
            x = torch.cat([store[(step, name)], record_once(module, name, data[4 * step + 2 : 4 * step + 4])])
            assert callback.values["rms"][tag][step] == pytest.approx(x.double().square().mean().sqrt().item(), 1e-6)
            assert callback.values["var_data"][tag][step] == pytest.approx(direct_stats(x)["var_data"], 1e-5)
    series = json.loads((tmp_path / "csv" / "version_0" / "hidden_stats.json").read_text())
    assert series["stats"]["rms"]["L01_mlp"] == callback.values["rms"]["L01_mlp"]
    assert "hidden/rms" in stability_layout()["Hidden states"]


def record_once(module, name: str, x: torch.Tensor) -> torch.Tensor:
    target = dict(module.named_modules())[name]
    out = {}
    handle = target.register_forward_hook(lambda m, a, o: out.setdefault("x", o.detach().clone()))
    with torch.no_grad():
        module(x)
    handle.remove()
    return out["x"]


class StateSpy(pl.Callback):
    """What the hidden-state subscription holds once a step's micro-batches have all run."""

    def __init__(self, hidden: HiddenStateStatistics) -> None:
        self.hidden, self.by_step = hidden, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pooled = self.hidden.subscription.pooled
        tensors = []
        for per_site in pooled:
            for value in (per_site or {}).values():
                tensors += [value.mean, value.m2] if isinstance(value, _stats.Moments) else [value]
        self.by_step[trainer.global_step] = (pooled, [(t.dtype, t.numel()) for t in tensors])


def test_state_exists_only_on_capture_steps_and_vectors_are_float32(tmp_path):
    hidden = HiddenStateStatistics(every_n_steps=2)
    spy = StateSpy(hidden)
    trainer(tmp_path, [hidden, spy], max_steps=3, accumulate_grad_batches=2).fit(lit("gpt"), loader(batch_size=2))
    entries = 16 * 64  # T·d
    assert all(p is None for p in spy.by_step[1][0])  # nothing allocated on a step that does not log
    for step in (0, 2):
        sizes = spy.by_step[step][1]
        assert len(sizes) == 6 * 5  # per site: 2 sums, a max, the moments' mean vector and Σ M2
        assert [(d, n) for d, n in sizes if n >= entries] == [(torch.float32, entries)] * 6  # one T·d vector per site
        assert all(n <= 2 for d, n in sizes if d == torch.float64)


def test_no_host_sync_on_steps_that_do_not_log(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    callbacks = [
        counter,
        HiddenStateStatistics(every_n_steps=3, log_heatmap=False),
        GrowthBoundMonitor(every_n_steps=3),
        GradientStatistics(every_n_steps=3),
        DivergenceMonitor(),
    ]
    trainer(tmp_path, callbacks, max_steps=6, accumulate_grad_batches=2).fit(lit("gpt"), loader(n=32, batch_size=2))
    per_step = {step: {f: n for (s, f), n in counter.counts.items() if s == step} for step in range(6)}
    logging = {"hidden_stats.py": 1, "growth_bound.py": 1, "grad_stats.py": 1, "divergence.py": 1}
    assert per_step[0] == per_step[3] == logging
    for step in (1, 2, 4, 5):  # DivergenceMonitor's one decision per step, nothing else
        assert per_step[step] == {"divergence.py": 1}, step
    assert {f: n for (s, f), n in counter.counts.items() if s == "end"} == {"divergence.py": 1}  # the final check


class UnservedStrategy:
    pass


def test_unserved_strategies_are_refused_in_one_line():
    stub = type("T", (), {"strategy": UnservedStrategy(), "world_size": 1})()
    assert strategy_kind(None) == "single" and strategy_kind(stub) == "other"
    for callback in (HiddenStateStatistics(), GrowthBoundMonitor(), GradientStatistics(), DivergenceMonitor()):
        with pytest.raises(ConfigError) as info:
            callback.setup(stub, lit("gpt"), "fit")
        message = str(info.value)
        assert message.startswith(f"strategy=UnservedStrategy is not allowed with {type(callback).__name__}")
        assert "FSDPStrategy" in message and "\n" not in message
    from lightning.pytorch.strategies import FSDPStrategy

    from lnstab.model import Block

    fsdp = type("T", (), {"strategy": FSDPStrategy(use_orig_params=False), "world_size": 1})()
    with pytest.raises(ConfigError, match=r"use_orig_params=False\) is not allowed with GradientStatistics"):
        require_strategy(fsdp, "GradientStatistics", reads_parameters=True)
    assert require_strategy(fsdp, "HiddenStateStatistics") == "fsdp"  # activations only: served
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block})
    hybrid = type("T", (), {"strategy": strategy, "world_size": 1})()
    with pytest.raises(ConfigError, match="sharding_strategy=HYBRID_SHARD"):
        require_strategy(hybrid, "GrowthBoundMonitor", reads_parameters=True)
