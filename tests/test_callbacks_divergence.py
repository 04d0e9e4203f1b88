"""DivergenceMonitor: a NaN injected at a known step and layer is reported there, and each policy acts."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from support.callbacks import (
    SEQ,
    VOCAB,
    LitLM,
    ManualLM,
    ParamWatch,
    StepClock,
    gpt,
    lit,
    loader,
    trainer,
    unchanged,
)

from lnstab.callbacks import (
    DivergenceMonitor,
    HiddenStateStatistics,
    NonFiniteCheckpointError,
    RunCheckpoint,
    RunStatus,
    StepProgressBar,
)
from lnstab.rundir import read_events, read_hidden_series, read_summary

NAN_STEP = 3


def inject_nan(module, clock: StepClock, layer: int = 1, step: int = NAN_STEP) -> None:
    """Make ``h.<layer>.resid_attn`` return NaN on one step (registered before the monitor's hooks)."""
    target = module.model.transformer.h[layer].resid_attn
    target.register_forward_hook(lambda m, a, out: out * float("nan") if clock.step == step else None)


def run_dir(tmp_path):
    return tmp_path / "csv" / "version_0"


def test_stop_reports_step_and_layer_and_stops(tmp_path, caplog):
    module, clock, watch = lit("gpt"), StepClock(), ParamWatch()
    inject_nan(module, clock)
    monitor = DivergenceMonitor(policy="stop")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    t = trainer(tmp_path, [clock, watch, monitor, checkpoint, RunStatus()], max_steps=10, enable_checkpointing=True)
    t.fit(module, loader(n=64))
    kinds = {e["kind"]: e for e in monitor.events}
    assert {"nonfinite_loss", "nonfinite_activation", "nonfinite_grad"} <= set(kinds)
    assert all(e["step"] == NAN_STEP for e in monitor.events)
    assert kinds["nonfinite_activation"]["layer"] == "L01_attn"  # the first site that went non-finite
    assert t.global_step == NAN_STEP + 1  # stopped on the step it happened
    assert unchanged(watch, NAN_STEP)  # the NaN update was dropped
    summary = read_summary(run_dir(tmp_path))
    assert summary["status"] == "diverged" and summary["diverged_step"] == NAN_STEP
    assert summary["divergence_events"] == len(monitor.events)
    lines = (run_dir(tmp_path) / "divergence_events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == [e["kind"] for e in monitor.events]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DivergenceMonitor: the run diverged")]
    assert said == [f"DivergenceMonitor: the run diverged at step {NAN_STEP} ({', '.join(dict.fromkeys(kinds))}) "
                    f"and ended at step {NAN_STEP + 1}; {len(monitor.events)} events in "
                    f"{run_dir(tmp_path) / 'divergence_events.jsonl'}"]  # Lightning itself says nothing


def test_the_divergence_line_starts_a_line_of_its_own_below_the_progress_bar(tmp_path, terminal):
    """Said once the bar has closed its line (at the end of the fit): said as training ended, it was glued to the
    bar's last line (lnstab fit's: endless data, so no epoch end closes the bar first)."""

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield from loader(n=64, batch_size=1).dataset

    module, clock = lit("gpt"), StepClock()
    inject_nan(module, clock)
    trainer(tmp_path, [clock, DivergenceMonitor(policy="stop"), RunStatus(), StepProgressBar()], max_steps=10,
            enable_progress_bar=True).fit(module, torch.utils.data.DataLoader(Endless(), batch_size=4))
    shown = terminal()
    assert any(line.startswith(f"DivergenceMonitor: the run diverged at step {NAN_STEP} ") for line in shown), shown


def strict_json(text: str):
    """``json.loads`` that refuses the bare NaN / Infinity which Python writes by default and strict JSON lacks."""
    def refuse(constant: str):
        raise ValueError(f"bare {constant} in a JSON file")
    return json.loads(text, parse_constant=refuse)


def test_a_diverged_run_writes_strict_json_that_reads_back_as_non_finite_floats(tmp_path):
    """The events and the hidden-state series of a run whose activations went NaN hold no bare NaN (jq, JavaScript
    and most JSON readers refuse it); lnstab's readers give the tagged values back as floats."""
    module, clock = lit("gpt"), StepClock()
    inject_nan(module, clock)
    t = trainer(tmp_path, [clock, HiddenStateStatistics(every_n_steps=1), DivergenceMonitor(policy="continue"),
                           RunStatus()], max_steps=6)
    t.fit(module, loader(n=64))
    directory = run_dir(tmp_path)
    for line in (directory / "divergence_events.jsonl").read_text().splitlines():
        strict_json(line)
    strict_json((directory / "hidden_stats.json").read_text())
    values = {e["kind"]: e["value"] for e in read_events(directory)}
    assert isinstance(values["nonfinite_loss"], float) and math.isnan(values["nonfinite_loss"])
    series = read_hidden_series(directory)
    at = series["steps"].index(NAN_STEP)
    after_attn = series["stats"]["mean_abs"]["L01_attn"]
    assert math.isnan(after_attn[at]) and all(math.isfinite(v) for v in after_attn[:at])


def test_skip_drops_only_that_update_and_continues(tmp_path):
    module, clock, watch = lit("gpt"), StepClock(), ParamWatch()
    inject_nan(module, clock)
    monitor = DivergenceMonitor(policy="skip")
    t = trainer(tmp_path, [clock, watch, monitor, RunStatus()], max_steps=6)
    t.fit(module, loader(n=64))
    assert t.global_step == 6
    assert unchanged(watch, NAN_STEP)
    assert not unchanged(watch, NAN_STEP - 1) and not unchanged(watch, NAN_STEP + 1)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert {e["step"] for e in monitor.events} == {NAN_STEP}
    assert read_summary(run_dir(tmp_path))["status"] == "completed"


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_with_manual_optimisation_a_dropped_update_is_dropped_for_every_optimizer_of_the_step(tmp_path, policy):
    """Two optimizers stepped in one training_step, a NaN loss on batch 2: neither applies it, and the events are
    those of one optimizer (the decision, taken at the first optimizer's step, dropped its update only: the second
    applied the NaN gradient, and a skipped batch ended a diverged run)."""
    events, status = {}, {}
    for n in (1, 2):
        torch.manual_seed(0)
        module, monitor = ManualLM(gpt(), optimizers=n, nan_batch=2), DivergenceMonitor(policy=policy)
        t = trainer(tmp_path / str(n), [monitor, RunStatus()], max_steps=-1, max_epochs=1)
        t.fit(module, loader(n=24))
        assert all(torch.isfinite(p).all() for p in module.parameters()), n
        assert t.global_step == n * (6 if policy == "skip" else 3)  # each optimizer's step counts
        events[n] = [(e["step"] // n, e["kind"]) for e in monitor.events]  # per training step
        status[n] = read_summary(tmp_path / str(n) / "csv" / "version_0")["status"]
    assert events[2] == events[1] == [(2, "nonfinite_loss"), (2, "nonfinite_grad")]
    assert status[2] == status[1] == ("completed" if policy == "skip" else "diverged")


def test_continue_stops_once_the_weights_are_nonfinite_and_keeps_the_last_good_checkpoint(tmp_path):
    module, clock = lit("gpt"), StepClock()
    inject_nan(module, clock)
    monitor = DivergenceMonitor(policy="continue")
    checkpoint = RunCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    t = trainer(tmp_path, [clock, monitor, checkpoint, RunStatus()], max_steps=6, enable_checkpointing=True)
    t.fit(module, loader(n=64))  # ends cleanly: a diverged run is a result
    kinds = [(e["step"], e["kind"]) for e in monitor.events]
    assert (NAN_STEP, "nonfinite_loss") in kinds and (NAN_STEP, "nonfinite_param") in kinds
    assert t.global_step == NAN_STEP + 1  # no later update can repair non-finite weights
    assert checkpoint.skipped_nonfinite >= 1
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == NAN_STEP  # the last good checkpoint, not overwritten
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    summary = read_summary(run_dir(tmp_path))
    assert summary["status"] == "diverged" and summary["diverged_step"] == NAN_STEP


def test_a_plain_model_checkpoint_is_refused_nonfinite_weights(tmp_path):
    module, clock = lit("gpt"), StepClock()
    inject_nan(module, clock)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    t = trainer(tmp_path, [clock, DivergenceMonitor(policy="continue"), checkpoint, RunStatus()], max_steps=6,
                enable_checkpointing=True)
    with pytest.raises(NonFiniteCheckpointError, match=f"step {NAN_STEP + 1}"):
        t.fit(module, loader(n=64))
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == NAN_STEP
    assert read_summary(run_dir(tmp_path))["status"] == "failed"


def test_loss_spike_and_grad_explosion(tmp_path):
    module = lit("gpt", loss_scale_at={14: 50.0}, lr=1e-4)
    monitor = DivergenceMonitor(policy="continue", window=10, spike_k=6.0, grad_norm_threshold=1e3)
    trainer(tmp_path, [monitor], max_steps=16).fit(module, loader(n=64))
    kinds = [(e["step"], e["kind"]) for e in monitor.events]
    assert (14, "loss_spike") in kinds
    assert all(step == 14 for step, _ in kinds)
    tiny = DivergenceMonitor(policy="skip", grad_norm_threshold=1e-9)
    watch = ParamWatch()
    trainer(tmp_path / "b", [watch, tiny], max_steps=2).fit(lit("gpt"), loader())
    assert [e["kind"] for e in tiny.events] == ["grad_explosion", "grad_explosion"]
    assert unchanged(watch, 0) and unchanged(watch, 1)


def test_a_loss_that_blows_up_without_overflowing_is_an_explosion_only_when_asked(tmp_path):
    """fp32 holds a loss of 1e11 (no LN at lr 0.3 reached it, finite, on an AVX-512 CPU and inf on an AVX2 one)."""
    runs = {}
    for name, scale, factor in (("blown", 20.0, 10.0), ("under", 5.0, 10.0), ("off", 20.0, None)):
        watch, monitor = ParamWatch(), DivergenceMonitor(policy="stop", loss_explosion_factor=factor)
        t = trainer(tmp_path / name, [watch, monitor, RunStatus()], max_steps=8)
        t.fit(lit("gpt", loss_scale_at={5: scale}, lr=1e-4), loader(n=64))
        runs[name] = (t, watch, monitor)
    t, watch, monitor = runs["blown"]
    assert [(e["step"], e["kind"]) for e in monitor.events] == [(5, "loss_explosion")]
    assert monitor.events[0]["value"] > 10 * monitor.first_loss > 0
    assert t.global_step == 6 and unchanged(watch, 5)  # stopped on that step, its update dropped
    assert read_summary(run_dir(tmp_path / "blown"))["diverged_step"] == 5
    for name in ("under", "off"):  # x5 is under the factor; without a factor nothing is an explosion
        t, _, monitor = runs[name]
        assert monitor.events == [] and t.global_step == 8, name
    restored = DivergenceMonitor(loss_explosion_factor=10.0)
    restored.load_state_dict(runs["blown"][2].state_dict())
    assert restored.first_loss == runs["blown"][2].first_loss  # a resumed run keeps its reference


def test_activation_overflow_risk(tmp_path):
    module = lit("gpt")
    module.model.transformer.h[0].resid_mlp.register_forward_hook(lambda m, a, out: out * 1e37)
    monitor = DivergenceMonitor(policy="continue", overflow_fraction=0.01, track_activations=True)
    trainer(tmp_path, [monitor], max_steps=1).fit(module, loader())
    overflow = [e for e in monitor.events if e["kind"] == "activation_overflow"]
    assert overflow and overflow[0]["layer"] == "L00_mlp" and overflow[0]["step"] == 0


def test_clean_run_completes_and_state_round_trips(tmp_path, caplog):
    monitor = DivergenceMonitor()
    trainer(tmp_path, [monitor, RunStatus()], max_steps=3).fit(lit("gpt"), loader())
    assert monitor.events == [] and "diverged" not in caplog.text
    assert read_summary(run_dir(tmp_path))["status"] == "completed"
    restored = DivergenceMonitor()
    monitor.events.append({"step": 1, "kind": "loss_spike", "value": 9.0, "layer": None})
    restored.load_state_dict(monitor.state_dict())
    assert restored.events == monitor.events and list(restored.losses) == list(monitor.losses)
    assert len(restored.losses) == 3


def test_a_batch_the_training_step_skips_by_returning_none_is_no_divergence(tmp_path, caplog):
    """Lightning skips the backward of a ``training_step`` that returns ``None`` (its documented way to skip a batch)
    and still steps the optimizer: the monitor, which never saw that step's loss, recorded it as a NaN
    (``nonfinite_loss``), and the default policy stopped a healthy run as diverged."""

    class Skipping(LitLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 1 else loss

    torch.manual_seed(0)
    monitor = DivergenceMonitor(policy="stop")
    t = trainer(tmp_path, [monitor, RunStatus()], max_steps=4)
    t.fit(Skipping(gpt()), loader())
    assert monitor.events == [] and "diverged" not in caplog.text
    assert t.global_step == 4 and read_summary(run_dir(tmp_path))["status"] == "completed"
    assert len(monitor.losses) == 3 and all(math.isfinite(v) and v > 0 for v in monitor.losses)  # no loss for step 1


def test_under_a_grad_scaler_an_overflow_it_skips_is_no_divergence_and_losses_are_unscaled(tmp_path, caplog):
    """``precision="16-mixed"``: Lightning hands ``on_before_backward`` the loss its GradScaler scaled, and the
    gradients of a step whose scaled backward overflowed are inf, a step the scaler skips before lowering its scale
    (its way of finding the scale). The monitor recorded every such step as ``nonfinite_grad`` and stopped the run
    at step 0 as diverged, and its losses (spike window, first loss, event values) were loss × scale."""
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 gradients: the first steps skip
    monitor = DivergenceMonitor(policy="stop")
    t = trainer(tmp_path, [monitor, RunStatus()], max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    t.fit(lit("gpt"), loader())
    assert scaler.get_scale() < 2.0**40  # the scaler did skip overflowing steps
    assert monitor.events == [] and "diverged" not in caplog.text
    assert t.global_step == 4 and read_summary(run_dir(tmp_path))["status"] == "completed"
    assert len(monitor.losses) == 4 and all(0.5 * math.log(VOCAB) < v < 2 * math.log(VOCAB) for v in monitor.losses)


def test_the_event_count_is_there_from_the_first_check_so_early_stopping_can_watch_it(tmp_path):
    """divergence/events was logged only with an event: EarlyStopping(monitor="divergence/events"), as the docs
    suggest, raised "not available" at the end of every run that never diverged."""
    from lightning.pytorch.callbacks import EarlyStopping

    monitor = DivergenceMonitor()
    t = trainer(tmp_path, [monitor, EarlyStopping(monitor="divergence/events", mode="min")], max_steps=3)
    t.fit(lit("gpt"), loader())
    assert t.global_step == 3 and float(t.callback_metrics["divergence/events"]) == 0.0
    rows = [r.split(",") for r in (run_dir(tmp_path) / "metrics.csv").read_text().splitlines()]
    step, column = rows[0].index("step"), rows[0].index("divergence/events")
    assert [(r[step], r[column]) for r in rows[1:] if r[column]] == [("0", "0.0")]  # once, at the first check


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "abort"}, "policy='abort'.*stop, skip, continue"),
        ({"window": 0}, "window=0"),
        ({"window": 9}, "window=9 is not allowed; it must be an integer >= 10"),  # it never held the 10 it judges by
        ({"track_activations": "no"}, "track_activations='no' is not allowed; choose one of: True, False"),
        ({"overflow_fraction": 2}, "overflow_fraction=2"),
        ({"fatal_kinds": ["nan"]}, "fatal_kinds='nan'"),
        ({"grad_norm_threshold": -1.0}, "grad_norm_threshold=-1.0"),
        ({"loss_explosion_factor": 1.0}, "loss_explosion_factor=1.0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DivergenceMonitor(**kwargs)


def sharpened(factor: float):
    """A tiny GPT whose q and k projections are scaled: about 40 % of the attention rows collapse at 20×."""
    module = lit("gpt")
    with torch.no_grad():
        for block in module.model.transformer.h:
            block.attn.c_attn.weight[: 2 * block.attn.n_embd] *= factor
    return module


def test_attention_collapse_and_logit_drift_are_recorded_with_layer_and_step_not_acted_on(tmp_path):
    monitor = DivergenceMonitor(stats_every_n_steps=2, collapse_fraction=0.1, log_z_threshold=1.0)  # log V = 4.6
    t = trainer(tmp_path, [monitor, RunStatus()], max_steps=5)
    t.fit(sharpened(20.0), loader(n=64))
    assert t.global_step == 5  # the policy is stop, yet neither kind is fatal by default
    kinds = [(e["step"], e["kind"], e["layer"], e.get("stat")) for e in monitor.events]
    assert kinds == [(s, k, layer, stat) for s in (0, 2, 4) for k, layer, stat in
                     (("attention_collapse", "L00", "collapsed"), ("logit_drift", "output", "log_z_mean"))]
    collapse = [e["value"] for e in monitor.events if e["kind"] == "attention_collapse"]
    assert all(0.1 < v < 1.0 for v in collapse) and all(e["value"] > 1.0 for e in monitor.events[1::2])
    lines = [json.loads(line) for line in (run_dir(tmp_path) / "divergence_events.jsonl").read_text().splitlines()]
    assert lines == monitor.events
    assert read_summary(run_dir(tmp_path))["status"] == "completed"


def test_attention_collapse_stops_when_named_fatal_and_a_logit_threshold_fires(tmp_path):
    watch = ParamWatch()
    monitor = DivergenceMonitor(stats_every_n_steps=1, collapse_fraction=None, attention_logit_threshold=5.0,
                                log_z_threshold=None, fatal_kinds=["attention_collapse"])
    t = trainer(tmp_path, [watch, monitor], max_steps=4)
    t.fit(sharpened(20.0), loader(n=64))
    assert [(e["step"], e["kind"], e["stat"]) for e in monitor.events] == [(0, "attention_collapse", "max_logit")]
    assert monitor.events[0]["value"] > 5.0 and t.global_step == 1 and unchanged(watch, 0)


def test_logit_drift_finds_a_head_by_its_pattern(tmp_path):
    def monitor(**kwargs):
        return DivergenceMonitor(stats_every_n_steps=1, collapse_fraction=None, attention_logit_threshold=None,
                                 log_z_threshold=1.0, **kwargs)  # log V = 4.6: every step drifts past 1

    with pytest.raises(ValueError, match=r"no module matches head_pattern='.*lm_head\$'"):
        trainer(tmp_path, [monitor()], max_steps=1).fit(lit("encoder"), loader())  # its head is model.head
    found = monitor(head_pattern=r"\.head$")
    trainer(tmp_path, [found], max_steps=2).fit(lit("encoder"), loader())
    with torch.no_grad():  # the first event's value is log Z of the untrained model's logits on the first batch
        x, _ = next(iter(loader()))
        expected = torch.logsumexp(lit("encoder").model(x).float(), dim=-1).mean().item()
    assert [(e["step"], e["kind"], e["layer"]) for e in found.events] == [(0, "logit_drift", "output"),
                                                                          (1, "logit_drift", "output")]
    assert found.events[0]["value"] == pytest.approx(abs(expected), rel=1e-5)


class OwnAttentionLM(torch.nn.Module):
    """A user's own two-layer causal LM: separate ``query``/``key``/``value`` projections, no recognised attention
    class, an output head called ``out``."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(
            {n: torch.nn.Linear(width, width) for n in ("query", "key", "value")}) for _ in range(2))
        self.out = torch.nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            q, k, v = (block[n](x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for n in ("query", "key", "value"))
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return self.out(x)  # (B, T, V)


def test_a_users_own_attention_and_head_are_watched_through_patterns(tmp_path):
    with pytest.raises(ValueError, match="name the projections with q_pattern, k_pattern and n_head"):
        trainer(tmp_path, [DivergenceMonitor(stats_every_n_steps=1)], max_steps=1).fit(
            LitLM(OwnAttentionLM()), loader())
    monitor = DivergenceMonitor(stats_every_n_steps=1, collapse_fraction=None, attention_logit_threshold=1e-3,
                                log_z_threshold=1e-3, q_pattern=r"blocks\.(\d+)\.query$",
                                k_pattern=r"blocks\.(\d+)\.key$", n_head=2, head_pattern=r"\.out$")
    torch.manual_seed(0)
    module = LitLM(OwnAttentionLM())
    with torch.no_grad():  # what the untrained model's first batch gives, computed directly
        x, _ = next(iter(loader()))
        h = module.model.embed(x)
        block = module.model.blocks[0]
        q, k = (block[n](h).unflatten(-1, (2, -1)).transpose(1, 2) for n in ("query", "key"))
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))  # (B, nh, T, T)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        max_logit = logits.abs().masked_fill(~causal, 0).amax().item()
        log_z = torch.logsumexp(module.model(x), dim=-1).mean().item()
    trainer(tmp_path, [monitor], max_steps=1).fit(module, loader())
    first = {(e["kind"], e["layer"]): e["value"] for e in monitor.events if e["step"] == 0}
    assert set(first) == {("attention_collapse", "L00"), ("logit_drift", "output")}  # the first layer past it
    assert first[("attention_collapse", "L00")] == pytest.approx(max_logit, rel=1e-5)
    assert first[("logit_drift", "output")] == pytest.approx(abs(log_z), rel=1e-5)


def test_on_a_shared_step_the_attention_view_is_computed_once(tmp_path, monkeypatch):
    from functools import cached_property

    from lnstab.callbacks import AttentionLogitStatistics
    from lnstab.callbacks._views import AttentionView

    calls = []
    original = AttentionView.attention.func
    prop = cached_property(lambda self: (calls.append(1), original(self))[1])
    prop.__set_name__(AttentionView, "attention")
    monkeypatch.setattr(AttentionView, "attention", prop)
    monitor, stats = DivergenceMonitor(stats_every_n_steps=2), AttentionLogitStatistics(every_n_steps=2)
    trainer(tmp_path, [monitor, stats], max_steps=3, accumulate_grad_batches=2).fit(lit("gpt"), loader(batch_size=2))
    assert len(calls) == 2 * 2 * 2  # steps 0 and 2, two micro-batches, two layers: once for both instruments
    assert stats.steps == [0, 2] and monitor.events == []


def test_stats_checks_refuse_a_model_without_attention(tmp_path):
    no_attention = LitLM(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))
    with pytest.raises(ValueError, match="model=LitLM is not allowed with DivergenceMonitor; no attention module"):
        trainer(tmp_path, [DivergenceMonitor(stats_every_n_steps=1)], max_steps=1).fit(no_attention, loader())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stats_every_n_steps": -1}, "stats_every_n_steps=-1"),
        ({"collapse_fraction": 1.0}, "collapse_fraction=1.0"),
        ({"attention_logit_threshold": 0}, "attention_logit_threshold=0"),
        ({"log_z_threshold": "big"}, "log_z_threshold='big'"),
        ({"fatal_kinds": ["attention"]}, "fatal_kinds='attention'"),
        ({"head_pattern": "(unclosed"}, "head_pattern='\\(unclosed'"),
        ({"head_pattern": None}, "head_pattern=None"),
        ({"q_pattern": "q"}, "q_pattern='q' with k_pattern=None is not allowed"),
        ({"q_pattern": "q", "k_pattern": "k"}, "n_head=None is not allowed with q_pattern"),
    ],
)
def test_bad_stats_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DivergenceMonitor(**kwargs)
