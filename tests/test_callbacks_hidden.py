"""HiddenStateStatistics: values equal a direct computation on the captured tensors; files, hooks, state, args."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from support.callbacks import VOCAB, EncoderLM, LitLM, StepClock, direct_stats, lit, loader, record_outputs, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lnstab.callbacks import DivergenceMonitor, HiddenStateStatistics, StabilityLayout
from lnstab.callbacks._sites import Site
from lnstab.callbacks._tap import SharedTap, Subscription
from lnstab.callbacks.hidden_stats import STATS

GPT_TAGS = ["embed", "L00_attn", "L00_mlp", "L01_attn", "L01_mlp", "final"]


def test_statistics_equal_direct_computation(tmp_path):
    module = lit("gpt")
    clock = StepClock()
    outputs, remove_out = record_outputs(module, r"transformer\.(drop|h\.\d+\.resid_(attn|mlp))$", clock)
    inputs, remove_in = record_outputs(module, r"transformer\.ln_f$", clock, use_input=True)
    callback = HiddenStateStatistics(every_n_steps=2)
    trainer(tmp_path, [clock, callback], max_steps=5).fit(module, loader())
    remove_out(), remove_in()

    assert callback.tags == GPT_TAGS
    assert callback.steps == [0, 2, 4]
    names = {
        "embed": "model.transformer.drop",
        "final": "model.transformer.ln_f",
        **{f"L{i:02d}_{k}": f"model.transformer.h.{i}.resid_{k}" for i in range(2) for k in ("attn", "mlp")},
    }
    for k, step in enumerate(callback.steps):
        for tag, name in names.items():
            store = inputs if tag == "final" else outputs
            expected = direct_stats(store[(step, name)])
            for stat in STATS:
                assert callback.values[stat][tag][k] == pytest.approx(expected[stat], rel=1e-6, abs=1e-9), (stat, tag)
    # Peri-LN: the final-norm input is the last residual output; activations grow along depth at init
    assert callback.values["mean_abs"]["final"] == pytest.approx(callback.values["mean_abs"]["L01_mlp"])
    assert callback.values["var_data"]["embed"][0] > 0


def test_only_logging_steps_capture(tmp_path, monkeypatch):
    module = lit("gpt")
    calls = []
    callback = HiddenStateStatistics(every_n_steps=3)
    original = Subscription.add
    monkeypatch.setattr(Subscription, "add", lambda self, i, view: (calls.append(i), original(self, i, view)))
    trainer(tmp_path, [callback], max_steps=7).fit(module, loader(n=32))
    assert callback.steps == [0, 3, 6]
    assert len(calls) == 3 * len(GPT_TAGS)  # hooks did nothing on the other 4 steps


def test_series_file_tensorboard_scalars_heatmap_and_layout(tmp_path):
    module = lit("gpt")
    callback = HiddenStateStatistics(every_n_steps=1)
    t = trainer(tmp_path, [StabilityLayout(), callback], max_steps=3, tensorboard=True)
    t.fit(module, loader())
    series = json.loads((tmp_path / "tb" / "version_0" / "hidden_stats.json").read_text())
    assert series["tags"] == GPT_TAGS and series["steps"] == [0, 1, 2]
    assert series["stats"]["max_abs"]["L01_mlp"] == pytest.approx(callback.values["max_abs"]["L01_mlp"])
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert "hidden/mean_abs/L00_attn" in tags["scalars"] and "hidden/var_data/final" in tags["scalars"]
    assert [e.step for e in events.Scalars("hidden/max_abs/embed")] == [0, 1, 2]
    assert {f"hidden/heatmap/{s}" for s in STATS} <= set(tags["images"])
    written = layout_pb2.Layout()
    written.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in written.category] == ["Training", "Hidden states"]  # the instruments present only
    assert "z-loss" not in [chart.title for chart in written.category[0].chart]  # a module without a z-loss


def test_hooks_removed_in_teardown(tmp_path):
    module = lit("gpt")
    callback = HiddenStateStatistics(every_n_steps=1)
    trainer(tmp_path, [callback], max_steps=1).fit(module, loader())
    assert callback.subscription is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())


def test_gradient_accumulation_pools_micro_batches(tmp_path):
    module = lit("gpt", lr=0.0)  # nothing changes, so the pooled step equals one forward on both halves
    callback = HiddenStateStatistics(every_n_steps=1)
    trainer(tmp_path, [callback], max_steps=1, accumulate_grad_batches=2).fit(module, loader(batch_size=2))
    x = loader(batch_size=4).dataset.tensors[0][:4]
    clock = StepClock()
    store, remove = record_outputs(module, r"h\.1\.resid_mlp$", clock)
    module.eval()(x)
    remove()
    expected = direct_stats(store[(-1, "model.transformer.h.1.resid_mlp")])
    for stat in STATS:
        assert callback.values[stat]["L01_mlp"][0] == pytest.approx(expected[stat], rel=1e-5)


def test_state_dict_round_trip(tmp_path):
    callback = HiddenStateStatistics(every_n_steps=1)
    trainer(tmp_path, [callback], max_steps=2).fit(lit("gpt"), loader())
    restored = HiddenStateStatistics(every_n_steps=1)
    restored.load_state_dict(callback.state_dict())
    assert restored.steps == [0, 1] and restored.values == callback.values
    assert restored.state_key == callback.state_key != HiddenStateStatistics(every_n_steps=5).state_key


def test_foreign_model_selected_by_regex_and_type(tmp_path):
    callback = HiddenStateStatistics(every_n_steps=1, layer_pattern=r"hf\.transformer\.h\.(\d+)$")
    by_type = HiddenStateStatistics(every_n_steps=1, module_types="torch.nn.TransformerEncoderLayer")
    trainer(tmp_path, [callback], max_steps=1).fit(lit("hf"), loader())
    trainer(tmp_path, [by_type], max_steps=1).fit(lit("encoder"), loader())
    assert callback.tags == ["embed", "L00", "L01", "final"]
    assert by_type.tags == ["L00", "L01"]
    assert all(v[0] > 0 for v in by_type.values["mean_abs"].values())


class OwnBlock(torch.nn.Module):
    """A residual MLP block of a user's own, run on (T, B, d) when ``batch_first`` is False, as it says."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class OwnLM(torch.nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(OwnBlock(batch_first) for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.batch_first else self.embed(x).transpose(0, 1)
        for block in self.blocks:
            h = block(h)
        return self.head(h if self.batch_first else h.transpose(0, 1))


@pytest.mark.parametrize(("model", "sites"), [
    (EncoderLM, {"module_types": "torch.nn.TransformerEncoderLayer"}),
    (OwnLM, {"layer_pattern": r"model\.blocks\.(\d+)$"}),
], ids=["torch-layers", "own-block"])
def test_sequence_first_layers_are_read_batch_first(tmp_path, model, sites):
    """torch's TransformerEncoderLayer defaults to (T, B, d): its statistics were computed with T as the batch
    (var_data 0.90 where it is 0.73); a block of the user's own on (T, B, d) that says ``batch_first = False``
    (torch's own spelling) was read so too. The same weights run batch-first and sequence-first give the same series."""
    torch.manual_seed(0)
    first, seq = model(batch_first=True), model(batch_first=False)
    seq.load_state_dict(first.state_dict())
    series = []
    for i, m in enumerate((first, seq)):
        callback = HiddenStateStatistics(every_n_steps=1, **sites)
        trainer(tmp_path / str(i), [callback], max_steps=2).fit(LitLM(m), loader())
        series.append(callback.values)
    assert list(series[1]["var_data"]) == ["L00", "L01"]
    for stat in STATS:
        for tag, values in series[0][stat].items():
            assert values == pytest.approx(series[1][stat][tag], rel=1e-4), (stat, tag)


def test_a_second_fit_of_the_same_instances_measures_its_own_steps(tmp_path):
    """A second trainer.fit from step 0 with the same callbacks: the steps of the first looked measured already, so
    nothing was (attention, output logits and hidden states logged nothing, silently)."""
    hidden, divergence = HiddenStateStatistics(every_n_steps=1), DivergenceMonitor()
    for run in ("a", "b"):
        t = trainer(tmp_path / run, [hidden, divergence], max_steps=3)
        t.fit(lit("gpt"), loader())
        assert hidden.steps == [0, 1, 2] and len(hidden.values["mean_abs"]["L00_attn"]) == 3
        assert "hidden/mean_abs/L00_attn" in t.callback_metrics
        assert len(divergence.losses) == 3 and divergence.events == []
    series = json.loads((tmp_path / "b" / "csv" / "version_0" / "hidden_stats.json").read_text())
    assert series["steps"] == [0, 1, 2]


def test_resumed_with_another_every_n_steps_keeps_the_series_wherever_checkpoints_are(tmp_path):
    """The instance's state key changes with every_n_steps, so the checkpoint holds no state for it; the series was
    read back only from <run>/checkpoints/../hidden_stats.json, so a ModelCheckpoint elsewhere lost it silently."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = HiddenStateStatistics(every_n_steps=2)
    saving = ModelCheckpoint(dirpath=tmp_path / "elsewhere", save_last=True, every_n_train_steps=3)
    trainer(tmp_path / "a", [first, saving], max_steps=3, enable_checkpointing=True).fit(lit("gpt"), loader())
    assert first.steps == [0, 2]
    second = HiddenStateStatistics(every_n_steps=1)
    with pytest.warns(UserWarning, match="its 2 earlier steps are taken from the checkpoint"):
        trainer(tmp_path / "b", [second], max_steps=5).fit(lit("gpt"), loader(),
                                                            ckpt_path=str(tmp_path / "elsewhere" / "last.ckpt"))
    assert second.steps == [0, 2, 3, 4]
    assert second.values["mean_abs"]["L00_attn"][:2] == first.values["mean_abs"]["L00_attn"]


def test_a_layer_pattern_that_matches_no_layer_is_said_although_embed_and_final_match(tmp_path):
    callback = HiddenStateStatistics(every_n_steps=1, layer_pattern=r"nomatch\.(\d+)$")
    with pytest.warns(UserWarning, match="matched no module of the model; only the embedding and final sites"):
        trainer(tmp_path, [callback], max_steps=1).fit(lit("gpt"), loader())
    assert callback.tags == ["embed", "final"]


def test_a_layer_pattern_whose_first_group_is_no_number_tags_the_layers_in_order(tmp_path):
    """The block's name captured instead of its index (``transformer\\.(h\\.\\d+)$``): the sites were tagged
    ``h.0``, ``h.1``, which the instruments do not read as layers: HiddenStateStatistics measured them and warned
    that the pattern 'matched no module of the model', and GrowthBoundMonitor dropped every site and fitted no growth
    law. They are layers numbered in depth order now, the group appended as a second group's is."""
    from lnstab.callbacks import GrowthBoundMonitor

    pattern = r"hf\.transformer\.(h\.\d+)$"
    hidden = HiddenStateStatistics(every_n_steps=1, layer_pattern=pattern, series_file=None)
    bound = GrowthBoundMonitor(every_n_steps=1, layer_pattern=pattern)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*matched no module")
        t = trainer(tmp_path, [hidden, bound], max_steps=1)
        t.fit(lit("hf"), loader())
    assert hidden.tags == ["embed", "L00_h.0", "L01_h.1", "final"]
    assert "hidden/mean_abs/L01_h.1" in t.callback_metrics and "growth/exp_rate" in t.callback_metrics


def test_an_end_or_head_pattern_that_matches_several_modules_is_refused_naming_them(tmp_path):
    """``final_pattern=r'norm$'`` on Llama (whose final norm is ``model.norm``) matches every layer's
    ``input_layernorm`` and ``post_attention_layernorm`` too: the first match, layer 0's input norm, was measured as
    the final site, so X_0 was logged as ``hidden/*/final`` without a word; ``head_pattern`` took its first match
    alike."""
    from hf_tiny import HFLM, hf_model

    from lnstab.callbacks import OutputLogitStatistics
    from lnstab.errors import ConfigError

    def fit(callback):
        trainer(tmp_path, [callback], max_steps=1).fit(LitLM(HFLM(hf_model("llama"))), loader())

    with pytest.raises(ConfigError, match=r"^final_pattern='norm\$' is not allowed; it matches 5 modules of the model "
                                          r"\('model\.hf\.model\.layers\.0\.input_layernorm', "
                                          r"'model\.hf\.model\.layers\.0\.post_attention_layernorm', …\) and must name "
                                          r"one: anchor it to that module's name$"):
        fit(HiddenStateStatistics(every_n_steps=1, embed_pattern=r"embed_tokens$", final_pattern=r"norm$"))
    with pytest.raises(ConfigError, match=r"^head_pattern='proj\$' is not allowed; it matches 14 modules"):
        fit(OutputLogitStatistics(every_n_steps=1, head_pattern=r"proj$"))
    anchored = HiddenStateStatistics(every_n_steps=1, embed_pattern=r"embed_tokens$", final_pattern=r"model\.norm$")
    fit(anchored)
    assert anchored.sites[-1].name == "model.hf.model.norm"


def test_an_embedding_or_final_pattern_that_matches_nothing_is_said_once_with_the_final_norm_to_name(tmp_path):
    """torch's TransformerEncoder with a final norm: the default patterns (lnstab's and Hugging Face's names) find
    neither end site. Before, nothing was said, and a ModelCheckpoint(monitor="hidden/mean_abs/final") never saved."""

    def said(kind_or_module, callback, name) -> list[str]:
        module = lit(kind_or_module) if isinstance(kind_or_module, str) else kind_or_module
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(tmp_path / name, [callback], max_steps=1).fit(module, loader(8))
        return [str(w.message) for w in caught if "not measured:" in str(w.message)]

    torch.manual_seed(0)
    module, callback = LitLM(EncoderLM(final_norm=True)), HiddenStateStatistics(every_n_steps=1)
    assert said(module, callback, "a") == [
        "HiddenStateStatistics: embed_pattern='(?:^|\\\\.)transformer\\\\.drop$' and final_pattern="
        "'(?:^|\\\\.)transformer\\\\.ln_f$' matched no module of the model; the embedding (X_0) and final (the final "
        "norm's input) sites are not measured: give embed_pattern a regex of the module whose output is X_0 (the "
        "embeddings' dropout, say) and final_pattern a regex of the final norm's name, e.g. "
        "final_pattern=r'encoder\\.norm$', or None not to look for it"]
    assert callback.tags == ["L00", "L01"]
    assert said(module, callback, "again") == []  # once: a second fit of the same instance does not say it again
    only_final = HiddenStateStatistics(every_n_steps=1, embed_pattern=None)
    assert said(module, only_final, "b")[0].startswith("HiddenStateStatistics: final_pattern='(?:^|\\\\.)transformer"
                                                       "\\\\.ln_f$' matched no module of the model; the final (the "
                                                       "final norm's input) site is not measured: give final_pattern")
    named = HiddenStateStatistics(every_n_steps=1, embed_pattern=r"embed$", final_pattern=r"encoder\.norm$")
    assert said(module, named, "c") == [] and named.tags == ["embed", "L00", "L01", "final"]
    assert "hidden/mean_abs/final" in named.last  # what a ModelCheckpoint can monitor
    for kind in ("gpt", "hf"):  # lnstab's and Hugging Face GPT-2's names: both found, nothing said
        callback = HiddenStateStatistics(every_n_steps=1)
        assert said(kind, callback, kind) == [] and callback.tags[0] == "embed" and callback.tags[-1] == "final"
    # Hugging Face Llama (and its kin): its final norm is a LlamaRMSNorm, not torch's, and none was named before
    from hf_tiny import HFLM, hf_model

    llama = said(LitLM(HFLM(hf_model("llama"))), HiddenStateStatistics(every_n_steps=1, embed_pattern=None), "llama")
    assert llama[0].endswith("a regex of the final norm's name, e.g. final_pattern=r'model\\.norm$', or None not to "
                             "look for it")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"log_heatmap": "no"}, "log_heatmap='no' is not allowed; choose one of: True, False"),
        ({"unroll_repeats": "yes"}, "unroll_repeats='yes'"),
        ({"layer_pattern": "h.(\\d+"}, "layer_pattern="),
        ({"module_types": "torch.nn.NoSuchLayer"}, "module_types="),
        ({"series_file": "a/b.json"}, "series_file="),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HiddenStateStatistics(**kwargs)


@pytest.mark.parametrize("scale, offset, rel", [(3.0, 1.0, 1e-6), (1.0, 1000.0, 1e-5)])
def test_pooling_micro_batches_equals_the_whole_batch(scale, offset, rel):
    """Sums, maxima and Chan-merged moments: three micro-batches of 2 reproduce the batch of 6 (what accumulation and
    DDP's all-reduce do), to float32 precision even with a mean 1000× the spread (no catastrophic cancellation)."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4) * scale + offset
    site = torch.nn.Identity()
    root = torch.nn.Sequential(site)
    tap = SharedTap.of(root)
    sub = tap.subscribe([Site("L00", "0", site)], [STATS])
    sub.active = tap.open = True  # what a TapCallback does at a measured step's micro-batch
    for part in x.split(2):
        root(part)
    table = sub.reduce(trainer_stub(), STATS)
    sub.close()
    expected = direct_stats(x)
    for stat in STATS:
        assert table[stat][0].item() == pytest.approx(expected[stat], rel=rel), stat
    assert not site._forward_hooks


def trainer_stub():
    class Stub:
        world_size = 1

    return Stub()
