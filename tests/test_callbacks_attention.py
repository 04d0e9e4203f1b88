"""AttentionLogitStatistics: every statistic equals a direct computation on materialised attention (lnstab's GPT, its
QK-norm interface; Hugging Face families in test_callbacks_attention_hf), chunking changes
nothing and bounds memory, 1 × 8 equals 4 × 2 micro-batches and FSDP on two processes equals one, no host reads on
other steps, hooks go in teardown."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fsdp_cpu import CPUFSDPStrategy
from support.callbacks import (
    NAMES,
    SGDLM,
    STEPS,
    EncoderLM,
    ListLogger,
    LitLM,
    MaxNumel,
    Recorder,
    ShardedSGD,
    SyncCounter,
    assert_close,
    direct,
    fit_fixed,
    gpt,
    hook_counts,
    lit,
    loader,
    logged,
    trainer,
)
from torch import nn

from lnstab.callbacks import AttentionLogitStatistics, DivergenceMonitor, OutputLogitStatistics
from lnstab.callbacks._views import AttentionView
from lnstab.errors import ConfigError
from lnstab.model import Block

ROOT = Path(__file__).resolve().parents[1]


def keep(store: dict, key, value) -> None:
    """Store ``value`` under ``key`` once; returns ``None``, so a hook that calls it never replaces an output."""
    store.setdefault(key, value)


def sharpen(model: nn.Module, factor: float) -> None:
    """Scale every q/k projection so that attention is far from uniform (some rows collapse, some do not)."""
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * block.attn.n_embd] *= factor


def test_statistics_equal_direct_computation_on_lnstab_gpt(tmp_path):
    module = lit("gpt")
    sharpen(module.model, 15.0)
    callback = AttentionLogitStatistics(every_n_steps=1)
    values, data = fit_fixed(tmp_path, module, [callback])
    assert sorted(values) == [0, 1] and callback.tags == ["L00", "L01"]
    for step in range(2):
        inputs, outputs = {}, {}
        handles = [block.attn.register_forward_hook(
            lambda m, a, out, i=i, ins=inputs, outs=outputs: (keep(ins, i, a[0]), keep(outs, i, out[0]))[-1])
            for i, block in enumerate(module.model.transformer.h)]
        with torch.no_grad():
            module(data[4 * step : 4 * step + 4])  # the step's two micro-batches at once (lr 0: the same weights)
        for h in handles:
            h.remove()
        for i, block in enumerate(module.model.transformer.h):
            attn, x = block.attn, inputs[i].double()
            B, T, C = x.shape
            q, k, v = F.linear(x, attn.c_attn.weight.double(), attn.c_attn.bias.double()).split(C, dim=2)
            q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            z = q @ k.transpose(-1, -2) / math.sqrt(C // 2)
            p = z.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf).softmax(-1)
            y = F.linear((p @ v).transpose(1, 2).reshape(B, T, C), attn.c_proj.weight.double(),
                         attn.c_proj.bias.double())
            torch.testing.assert_close(y.float(), outputs[i], rtol=1e-4, atol=1e-5)  # SDPA used these q and k
            expected = direct([q], [k], 1 / math.sqrt(C // 2))
            assert_close(values[step], expected, f"L{i:02d}", step)
    collapsed = [values[s][f"attn/collapsed/L{i:02d}"] for s in range(2) for i in range(2)]
    assert any(0.0 < c < 1.0 for c in collapsed), collapsed  # the collapse statistic saw both kinds of rows
    assert all(values[s]["attn/max_logit/L00"] > 5 for s in range(2))


def test_qk_norm_outputs_are_what_is_measured(tmp_path):
    torch.manual_seed(0)
    model = gpt(qk_norm=True)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.q_norm.weight.uniform_(2.0, 4.0)  # γ of the query norm must count
    module = LitLM(model)
    callback = AttentionLogitStatistics(every_n_steps=1)
    values, data = fit_fixed(tmp_path, module, [callback], steps=1)
    seen, handles = {}, []
    for i, block in enumerate(model.transformer.h):
        for name in ("c_attn", "q_norm", "k_norm"):
            handles.append(getattr(block.attn, name).register_forward_hook(
                lambda m, a, o, key=(name, i): keep(seen, key, o)))
    with torch.no_grad():
        module(data[:4])
    for h in handles:
        h.remove()
    for i in range(2):
        q, k = seen[("q_norm", i)], seen[("k_norm", i)]  # (B, nh, T, hs), what SDPA multiplies
        assert_close(values[0], direct([q], [k], 1 / math.sqrt(q.size(-1))), f"L{i:02d}")
        raw_q, raw_k = (seen[("c_attn", i)][..., j * 64 : (j + 1) * 64].view(4, 16, 2, 32).transpose(1, 2)
                        for j in (0, 1))
        raw = direct([raw_q], [raw_k], 1 / math.sqrt(32))["max_logit"]
        assert values[0][f"attn/max_logit/L{i:02d}"] > 10 * raw  # not the un-normalised projections


def test_chunking_gives_the_same_numbers_and_bounds_memory_at_t_1024():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 37, 8, generator=g) * 3, torch.randn(2, 2, 37, 8, generator=g) * 3  # GQA
    ref = direct([q], [k], 0.35)  # unchunked, materialised in float64
    results = []
    for chunk in (1, 2 * 4 * 37 * 5, 10**9):  # one row, 5 rows, 10 rows (at least four chunks) per chunk
        s = AttentionView(q, k, 0.35, chunk_elements=chunk).attention
        results.append([s.max_logit.item(), s.entropy_sum.item() / s.rows, -s.neg_entropy_max.item(),
                        s.collapsed.item() / s.rows])
        assert results[-1] == pytest.approx([ref[n] for n in NAMES], rel=1e-5, abs=1e-6), chunk
    assert results[0] == pytest.approx(results[1], rel=1e-6) and results[1] == pytest.approx(results[2], rel=1e-6)
    assert 0 < ref["collapsed"] < 1
    q, k = torch.randn(1, 2, 1024, 8, generator=g), torch.randn(1, 2, 1024, 8, generator=g)
    budget = 1 << 16  # 32 rows of 2 heads × 1024 keys
    with MaxNumel() as spy:
        AttentionView(q, k, 0.35, chunk_elements=budget).attention  # noqa: B018
    assert spy.largest <= budget  # never one head's 1024 × 1024 matrix (that is 16 × the budget)
    with MaxNumel() as spy:
        AttentionView(q, k, 0.35, chunk_elements=10**9).attention  # noqa: B018
    assert spy.largest == 2 * 256 * 1024  # without a budget: four chunks of 256 rows, so the bound is the budget's


def fit_accumulated(tmp_path, name: str, batch_size: int, accumulate: int, steps: int = 3) -> dict:
    logger = ListLogger(tmp_path / name)
    callbacks = [AttentionLogitStatistics(every_n_steps=1), OutputLogitStatistics(every_n_steps=1)]
    torch.manual_seed(0)
    module = SGDLM(gpt())
    sharpen(module.model, 12.0)
    t = trainer(tmp_path / name, callbacks, max_steps=steps, accumulate_grad_batches=accumulate, logger=logger)
    t.fit(module, loader(n=8 * steps, batch_size=batch_size))
    return logged(logger)


def test_four_micro_batches_equal_one_batch(tmp_path):
    single = fit_accumulated(tmp_path, "single", batch_size=8, accumulate=1)
    micro = fit_accumulated(tmp_path, "micro", batch_size=2, accumulate=4)
    assert sorted(single) == sorted(micro) == [0, 1, 2]
    for step, expected in single.items():
        assert set(micro[step]) == set(expected) and len(expected) == 4 * 2 + 3
        for key, value in expected.items():
            assert micro[step][key] == pytest.approx(value, rel=2e-5, abs=1e-6), (step, key)


def test_no_host_reads_on_steps_that_do_not_measure_and_hooks_go_in_teardown(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    module = lit("gpt")
    attention, output = AttentionLogitStatistics(every_n_steps=3), OutputLogitStatistics(every_n_steps=3)
    monitor = DivergenceMonitor(stats_every_n_steps=3)
    hooks = {}

    class Hooks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            hooks[trainer.global_step] = hook_counts(pl_module)

    callbacks = [counter, attention, output, monitor, Hooks()]
    trainer(tmp_path, callbacks, max_steps=6, accumulate_grad_batches=2).fit(module, loader(n=32, batch_size=2))
    per_step = {step: {f: n for (s, f), n in counter.counts.items() if s == step} for step in range(6)}
    assert per_step[0] == per_step[3] == {"_tap_callback.py": 2, "divergence.py": 1}  # a read each; the decision
    for step in (1, 2, 4, 5):
        assert per_step[step] == {"divergence.py": 1}, step  # the monitor's own per-step decision only
    expected = {**{f"model.transformer.h.{i}.attn.{n}": 1 for i in range(2) for n in ("q_norm", "k_norm")},
                **{f"model.transformer.h.{i}.attn": 1 for i in range(2)},  # counts the calls of the capture's module
                **{f"model.transformer.h.{i}.resid_{n}": 1 for i in range(2) for n in ("attn", "mlp")},
                "model.transformer.ln_f": 2}  # q, k and ln_f once for three instruments; the monitor's max |x|
    assert hooks[0] == hooks[5] == expected
    assert hook_counts(module) == {}  # all removed in teardown
    assert attention.steps == output.steps == [0, 3] and monitor.events == []


def test_what_cannot_be_measured_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        AttentionLogitStatistics().setup(None, LitLM(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))), "fit")
    message = str(info.value)
    assert message.startswith("model=LitLM is not allowed with AttentionLogitStatistics") and "\n" not in message
    assert "q_pattern, k_pattern and n_head" in message and "in Instruments, which has no such arguments" in message
    with pytest.raises(ConfigError, match=r"q_pattern='nope' and k_pattern='k_proj' are not allowed"):
        AttentionLogitStatistics(q_pattern="nope", k_pattern="k_proj", n_head=2).setup(None, lit("hf"), "fit")
    with pytest.raises(ConfigError, match=r"both select 'model.encoder.layers.0.self_attn', and q and k must come"):
        AttentionLogitStatistics(q_pattern=r"layers\.(\d+)\.self_attn$", k_pattern=r"layers\.(\d+)\.self_attn$",
                                 n_head=2).setup(None, LitLM(EncoderLM()), "fit")  # before: q = k = its output


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"q_pattern": "q_proj"}, "q_pattern='q_proj' with k_pattern=None is not allowed"),
        ({"q_pattern": "q", "k_pattern": "k"}, "n_head=None is not allowed with q_pattern"),
        ({"q_pattern": "(", "k_pattern": "k", "n_head": 2}, "q_pattern='\\('"),
        ({"chunk_elements": 0}, "chunk_elements=0"),
        ({"min_keys": 0}, "min_keys=0"),
        ({"collapse_weight": 1.0}, "collapse_weight=1.0"),
        ({"scale": -1.0}, "scale=-1.0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AttentionLogitStatistics(**kwargs)


class SharpShardedSGD(ShardedSGD):
    def __init__(self, accumulate: int) -> None:
        super().__init__(accumulate)
        sharpen(self.model, 12.0)


def fit_ranks(tmp_path, name: str, **kwargs) -> dict:
    accumulate = kwargs.pop("accumulate_grad_batches", 1)
    instruments = [AttentionLogitStatistics(every_n_steps=1, chunk_elements=2 * 2 * 16 * 5),
                   OutputLogitStatistics(every_n_steps=1, chunk_rows=7)]
    recorder = Recorder(str(tmp_path / f"{name}.json"), instruments)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, max_steps=STEPS, callbacks=[*instruments, recorder],
                         use_distributed_sampler=False, accumulate_grad_batches=accumulate, **kwargs)
    torch.manual_seed(0)
    trainer.fit(SharpShardedSGD(accumulate))
    return json.loads((tmp_path / f"{name}.json").read_text())["steps"]


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process(tmp_path):
    torch.set_num_threads(1)
    single = fit_ranks(tmp_path, "single", devices=1)
    strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    sharded = fit_ranks(tmp_path, "fsdp", devices=2, strategy=strategy, accumulate_grad_batches=2)
    assert sorted(sharded) == sorted(single) == ["0", "1", "2"]
    assert any(0 < v < 1 for k, v in single["0"].items() if k.startswith("attn/collapsed/"))
    for step, expected in single.items():
        assert set(sharded[step]) == set(expected) and len(expected) == 4 * 2 + 3
        for key, value in expected.items():
            assert sharded[step][key] == pytest.approx(value, rel=2e-5, abs=1e-6), (step, key)


def test_the_instruments_group_adds_both_at_its_cadence_with_switches():
    from lnstab.callbacks import Instruments

    def built(**kwargs) -> dict[str, object]:
        return {type(c).__name__: c for c in Instruments(every_n_steps=20, **kwargs).callbacks()}

    group = built()
    assert group["AttentionLogitStatistics"].every_n_steps == group["OutputLogitStatistics"].every_n_steps == 20
    monitor = group["DivergenceMonitor"]
    assert monitor.stats_every_n_steps == 20 and monitor.every_n_steps == 1
    assert (monitor.checks.collapse_fraction, monitor.checks.log_z_threshold) == (0.5, 30.0)
    no_attention = built(attention=False)
    assert "AttentionLogitStatistics" not in no_attention and "OutputLogitStatistics" in no_attention
    checks = no_attention["DivergenceMonitor"].checks
    assert checks.collapse_fraction is None and checks.attention_logit_threshold is None
    neither = built(attention=False, output_logits=False)
    assert "OutputLogitStatistics" not in neither and neither["DivergenceMonitor"].stats_every_n_steps == 0


def test_attention_statistics_stay_out_of_the_hidden_state_instrument_and_have_charts():
    from lnstab.callbacks import HiddenStateStatistics, stability_layout

    with pytest.raises(ConfigError, match=r"stats=\['attn_max_logit'\] is not allowed; each must be one of: mean_abs"):
        HiddenStateStatistics(stats=["attn_max_logit"])  # it reads residual-stream views, not q and k
    layout = stability_layout()
    hidden = layout["Hidden states"]
    assert "hidden/attn_max_logit" not in hidden and "hidden/output_log_z_mean" not in hidden
    assert set(layout["Attention logits"]) == {f"attn/{n}" for n in NAMES}
    assert set(layout["Output logits"]) == {"output/log_z_mean", "output/log_z_std", "output/max_logit"}


def pooled_warnings(fit) -> tuple[list[str], object]:
    """Run ``fit()``; the pooled-calls warnings it raised, and what it returned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fit()
    return [str(w.message) for w in caught if "ran in one micro-batch" in str(w.message)], out


def test_q_and_k_of_one_forward_are_one_call_and_a_block_shared_across_depth_two(tmp_path):
    """A call of a site is a call of its module, however many hooks hand the tap its parts. q and k leave q_norm and
    k_norm, two hooks of one attention call: the tap counted each as a call, so every fit of lnstab's GPT warned of
    '2 calls' of every attention layer in a model that shares no weights (its numbers were right: the view is built
    once both parts are in). A block shared by two depths is two calls, pooled, and said as such (not 4)."""
    module = lit("gpt")
    sharpen(module.model, 15.0)
    callback = AttentionLogitStatistics(every_n_steps=1)
    said, _ = pooled_warnings(lambda: fit_fixed(tmp_path / "plain", module, [callback], steps=1, accumulate=1))
    assert said == [] and callback.steps == [0]

    torch.manual_seed(0)
    model = gpt()
    model.transformer.h[1] = model.transformer.h[0]  # one block at both depths: its weights shared
    sharpen(model, 15.0)
    shared = AttentionLogitStatistics(every_n_steps=1)
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    attn = model.transformer.h[0].attn
    for part in parts:
        getattr(attn, f"{part}_norm").register_forward_hook(
            lambda m, a, o, part=part: parts[part].append(o.detach()) if torch.is_grad_enabled() else None)
    said, (values, _) = pooled_warnings(
        lambda: fit_fixed(tmp_path / "shared", LitLM(model), [shared], steps=1, accumulate=1))
    assert shared.tags == ["L00"] and len(parts["q"]) == len(parts["k"]) == 2  # the training forward's two calls
    assert len(said) == 1 and "'model.transformer.h.0.attn' (2 calls) ran in one micro-batch" in said[0], said
    q, k = parts["q"], parts["k"]
    assert_close(values[0], direct(q, k, 1 / math.sqrt(q[0].size(-1))), "L00")  # both calls pooled, each once


WARNING_LINE = re.compile(r"^(?P<file>\S+\.py):\d+: (?P<kind>\w*Warning): (?P<message>.*)$")


def lnstab_warnings(stderr: str) -> list[str]:
    """The warnings in ``stderr`` that lnstab's own code raised (its packages' files; ``lnstab:`` messages)."""
    import lnstab
    import lnstab.callbacks
    import lnstab.datamodules

    roots = {Path(p.__file__).resolve().parent for p in (lnstab, lnstab.callbacks, lnstab.datamodules)}
    out = []
    for line in stderr.splitlines():
        match = WARNING_LINE.match(line)
        if match and (any(r in Path(match["file"]).resolve().parents for r in roots)
                      or match["message"].startswith("lnstab")):
            out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra", [
    [],  # the quickstart as shipped (precision auto: bf16 where the CPU has it), every instrument, a probe
    ["--model.n_layer", "2", "--trainer.precision", "32-true", "--instruments.jacobian_every_n_steps", "0",
     "--trainer.val_check_interval", "3"],  # 2 layers in fp32, no Jacobian probe, validation off the measuring steps
], ids=["quickstart", "fp32-2-layers-no-probe"])
def test_a_quickstart_fit_raises_no_lnstab_warning(tmp_path, extra):
    """``lnstab fit`` of the quickstart, a few steps measured by every instrument, in its own process: lnstab says
    nothing a user must act on (every fit warned that each attention layer ran twice in one micro-batch)."""
    exe = Path(sys.executable).with_name("lnstab")
    cmd = [str(exe), "fit", "--config", str(ROOT / "experiments" / "quickstart.yaml"), "--trainer.max_steps", "4",
           "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--instruments.every_n_steps", "2",
           "--instruments.jacobian_every_n_steps", "2", "--evaluation.on_fit_end", "false",
           "--data.init_args.source", "synthetic", "--trainer.enable_progress_bar", "false",
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    events = b"".join(p.read_bytes() for p in (tmp_path / "runs" / "quickstart").rglob("events.out.tfevents.*"))
    assert b"attn/max_logit/L01" in events and b"output/log_z_mean" in events  # the instruments measured
    assert lnstab_warnings(done.stderr) == [], done.stderr[-3000:]
