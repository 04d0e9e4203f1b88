"""The pieces of ``lnstab check`` without training: thresholds, growth laws, slopes, phrases, input parsing."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from lnstab.check.card import relation
from lnstab.check.criteria import DEFAULT_THRESHOLDS, evaluate_expression, load_thresholds, resolve, status
from lnstab.check.factory import factory_subject
from lnstab.check.options import build_parser, checked_threads, make_protocol, split_model_args, worker_counts
from lnstab.check.subjects import REFERENCE_KEEPS, context_length, lnstab_subject, references
from lnstab.errors import LNStabError
from lnstab.measures import deep_doublings, fit_line, growth_fit, layer_depths
from lnstab.model import GPTConfig

DEPTHS = [0.5 * k for k in range(1, 13)]  # six layers of half-steps


@pytest.mark.parametrize(
    "law, expected",
    [
        (lambda d: 0.3 + 0.0 * d, 0.0),  # constant
        (lambda d: 2.0 * d, 1.0),  # linear from zero: one doubling over the deeper half
        (lambda d: math.sqrt(d), 0.5),
        (lambda d: d**2, 2.0),
        (lambda d: math.exp(0.7 * d), 0.7 * 6 / (2 * math.log(2))),  # exponential: r·D / (2 ln 2)
    ],
)
def test_deep_doublings_reads_the_growth_law(law, expected) -> None:
    assert deep_doublings(DEPTHS, [law(d) for d in DEPTHS]) == pytest.approx(expected, abs=1e-9)


def test_growth_fit_tells_linear_from_exponential() -> None:
    linear = growth_fit(DEPTHS, [1.0 + 3.0 * d for d in DEPTHS])
    exponential = growth_fit(DEPTHS, [math.exp(0.9 * d) for d in DEPTHS])
    assert linear["law"] == "linear" and linear["lin_slope"] == pytest.approx(3.0)
    assert exponential["law"] == "exponential" and exponential["exp_rate"] == pytest.approx(0.9)
    assert exponential["exp_r2"] == pytest.approx(1.0)


def test_fit_line_slope_and_standard_error() -> None:
    x = [0.0, 1.0, 2.0, 3.0]
    exact = fit_line(x, [1.0 - 2.0 * v for v in x])
    assert exact["slope"] == pytest.approx(-2.0) and exact["se"] == pytest.approx(0.0, abs=1e-12)
    noisy = fit_line(x, [0.0, 1.0, 0.0, 1.0])
    assert noisy["se"] > 0 and 0 <= noisy["r2"] < 1
    assert math.isnan(fit_line([1.0, 1.0], [0.0, 1.0])["slope"])  # no spread in x: undefined


def test_layer_depths_for_half_steps_and_blocks() -> None:
    assert layer_depths(["embed", "L00_attn", "L00_mlp", "L01_attn", "L01_mlp", "final"]) == {
        "L00_attn": 0.5, "L00_mlp": 1.0, "L01_attn": 1.5, "L01_mlp": 2.0}
    assert layer_depths(["L00", "L01", "L02"]) == {"L00": 1.0, "L01": 2.0, "L02": 3.0}


def test_thresholds_follow_the_references_and_fall_back_without_them() -> None:
    spec = {"warn": "peri + 2*sd", "fail": "max(pre, peri) + 2*sd", "absolute": {"warn": 1, "fail": 2}}
    refs = {"pre-ln": (1.5, 0.1), "peri-ln": (0.8, 0.05)}
    limits = resolve(spec, refs)
    assert limits["warn"] == pytest.approx(0.8 + 0.2) and limits["fail"] == pytest.approx(1.5 + 0.2)
    assert [status(v, limits) for v in (0.9, 1.2, 1.8, math.nan)] == ["pass", "warn", "fail", "n/a"]
    # A reference without a value (e.g. every Pre-LN run diverged) or none at all: the absolute thresholds.
    missing = resolve(spec, {"pre-ln": (math.nan, math.nan), "peri-ln": (0.8, 0.05)})
    assert missing["fail"] == 2 and missing["fail_source"] == "absolute" and missing["warn_source"] == "relative"
    assert resolve(spec, None)["warn"] == 1 and resolve(DEFAULT_THRESHOLDS["loss"], refs)["fail"] is None
    assert resolve(DEFAULT_THRESHOLDS["growth_init"], refs)["fail"] is None  # growth at initialisation only warns
    assert resolve(DEFAULT_THRESHOLDS["growth_trained"], refs)["fail"] is None  # so does growth after training
    # When the references come in the other order the pass band ends at Peri-LN, the fail band above both: no
    # warning band is left, and none is shown.
    swapped = resolve(spec, {"pre-ln": (0.2, 0.0), "peri-ln": (0.6, 0.0)})
    assert swapped["warn"] is None and swapped["fail"] == pytest.approx(0.6)
    assert [status(v, swapped) for v in (0.5, 0.7)] == ["pass", "fail"]


def test_threshold_expressions_allow_arithmetic_only() -> None:
    names = {"pre": 2.0, "peri": 1.0, "sd": 0.5}
    assert evaluate_expression("max(pre, peri) + 2*sd", names) == pytest.approx(3.0)
    assert evaluate_expression("log10(0.5*fp16_max)", {}) == pytest.approx(math.log10(32752.0))
    assert evaluate_expression(None, names) is None and evaluate_expression(-1, names) == -1.0
    assert math.isnan(evaluate_expression("max(pre, peri)", {"pre": math.nan, "peri": 1.0}))
    for bad in ("__import__('os').system('true')", "pre.__class__", "(lambda: 1)()", "pre if peri else 0", "os"):
        with pytest.raises(LNStabError):
            evaluate_expression(bad, names)


def test_thresholds_file_overrides_key_by_key(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("divergence:\n  fail: 0.25\n  absolute: {warn: null}\n")
    merged = load_thresholds(path)
    assert merged["divergence"]["fail"] == 0.25 and merged["divergence"]["warn"] == "peri"
    assert merged["divergence"]["absolute"] == {"warn": None, "fail": 0.5}
    assert load_thresholds(None) == DEFAULT_THRESHOLDS  # the defaults themselves are untouched
    path.write_text("divergence: {too_high: 1}\n")
    with pytest.raises(LNStabError, match="divergence.too_high is not allowed"):
        load_thresholds(path)


def test_relation_names_the_nearest_reference() -> None:
    refs = {"pre-ln": (1.5, 0.05), "peri-ln": (0.5, 0.05)}
    assert relation("growth_trained", 1.45, refs) == "grows like Pre-LN"
    assert relation("growth_trained", 3.0, refs) == "grows faster than both references"
    assert relation("growth_trained", 0.0, refs) == "grows slower than both references"
    assert relation("growth_trained", 1.0, refs) == "between Peri-LN and Pre-LN"
    assert relation("sensitivity", 0.52, refs) == "as insensitive as Peri-LN to activation scale"
    assert relation("sensitivity", 1.52, refs) == "as sensitive as Pre-LN to activation scale"
    assert relation("divergence", 0.0, {"pre-ln": (0.0, 0.0), "peri-ln": (0.0, 0.0)}).endswith("both references")
    assert relation("growth_trained", 1.0, {}) == ""


def test_model_arguments_are_parsed_as_yaml_and_split_from_the_rest() -> None:
    model, rest = split_model_args(["--model.n_layer", "3", "--model.bias=false", "--model.betas", "[0.8, 0.9]",
                                    "--model.norm-placement", "peri", "--steps", "4", "--model.preset=tiny"])
    assert model == {"n_layer": 3, "bias": False, "betas": [0.8, 0.9], "norm_placement": "peri", "preset": "tiny"}
    assert rest == ["--steps", "4"]
    subject, extra = lnstab_subject(model)
    assert subject.config.n_layer == 3 and not subject.config.bias and subject.config.norm_placement == "peri"
    protocol = make_protocol(build_parser().parse_args(rest), extra)
    assert protocol.optimisation.betas == (0.8, 0.9) and protocol.optimisation.steps == 4
    _, extra = lnstab_subject({"preset": "tiny", "learning_rate": 0.02})
    assert make_protocol(build_parser().parse_args([]), extra).lrs == (0.02,)
    with pytest.raises(LNStabError, match="not both"):
        make_protocol(build_parser().parse_args(["--lrs", "1e-3"]), extra)
    with pytest.raises(LNStabError, match="GPTModule takes"):
        lnstab_subject({"n_layers": 3})


def test_a_default_longer_than_the_run_or_context_is_cut_and_a_given_one_refused() -> None:
    subject, extra = lnstab_subject({"preset": "tiny", "block_size": 32})
    short = make_protocol(build_parser().parse_args(["--steps", "2"]), extra)
    assert short.optimisation.warmup_steps == 2 and short.seq_len == 64  # default warmup 3, cut to the run
    assert context_length(subject, short.seq_len) == 32  # default length 64, cut to the context
    with pytest.raises(LNStabError, match=r"--warmup-steps=3 is not allowed with --steps=2; it must be at most"):
        make_protocol(build_parser().parse_args(["--steps", "2", "--warmup-steps", "3"]), extra)
    with pytest.raises(LNStabError, match=r"--seq-len=33 is not allowed with .*context of 32; it must be at most 32"):
        context_length(subject, 33, given=True)
    assert context_length(subject, 32, given=True) == 32


@pytest.mark.parametrize(
    "model, same",
    [
        ({"preset": "tiny", "norm_placement": "pre"}, {"pre-ln": "checked", "peri-ln": None}),
        ({"preset": "tiny", "norm_placement": "peri"}, {"pre-ln": None, "peri-ln": "checked"}),
        ({"preset": "tiny", "norm_placement": "peri", "residual_scale": 0.1}, {"pre-ln": None, "peri-ln": None}),
        ({"preset": "tiny", "norm_placement": "pre", "norm_type": "rmsnorm"}, {"pre-ln": None, "peri-ln": None}),
    ],
)
def test_references_have_the_checked_shape_and_reuse_identical_runs(model, same) -> None:
    subject, _ = lnstab_subject(model)
    refs = {r.key: r for r in references(subject, 16)}
    assert {k: r.same_as for k, r in refs.items()} == same
    for key, placement in (("pre-ln", "pre"), ("peri-ln", "peri")):
        config = refs[key].config
        assert (config.norm_placement, config.norm_type, config.residual_scale) == (placement, "layernorm", 1.0)
        assert (config.n_layer, config.n_embd, config.block_size, config.vocab_size) == (
            subject.config.n_layer, subject.config.n_embd, subject.config.block_size, subject.config.vocab_size)


# Every GPTConfig field a reference does not copy, at a value other than its default. A field added to GPTConfig
# must be named here or in REFERENCE_KEEPS: the test fails until it is.
OPTIONS_ON = {"norm_type": "rmsnorm", "residual_scale": 0.1, "dropout": 0.1, "qk_norm": True, "z_loss": 1e-4,
              "dyt_alpha_init": 0.3, "residual_gate": "layerscale", "layerscale_init": 0.01}
KEPT = {"pad_vocab_multiple": 8, "bias": False, "tie_embeddings": False, "init": "xavier"}


def test_references_take_every_option_at_its_default_and_keep_the_shape() -> None:
    """A reference is lnstab's block under its placement with the checked GPT's shape: every option of the checked
    model (and any option added to GPTConfig later) at GPTConfig's default, never copied from the checked model."""
    fields = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    assert set(fields) == {"norm_placement", *REFERENCE_KEEPS, *OPTIONS_ON}, "name a new GPTConfig field above"
    subject, _ = lnstab_subject({"preset": "tiny", "norm_placement": "post", **OPTIONS_ON, **KEPT})
    subject = dataclasses.replace(subject, config=dataclasses.replace(subject.config, norm_eps=1e-6))  # not an argument
    for ref in references(subject, 16):
        config = ref.config
        assert ref.same_as is None and config.norm_placement == ref.key.removesuffix("-ln")
        assert {k: getattr(config, k) for k in OPTIONS_ON} == {k: fields[k] for k in OPTIONS_ON}
        assert {k: getattr(config, k) for k in REFERENCE_KEEPS} == {k: getattr(subject.config, k)
                                                                     for k in REFERENCE_KEEPS}
        assert {k: getattr(config, k) for k in KEPT} == KEPT and config.norm_eps == 1e-6


def test_factory_blocks_by_type_get_exact_patterns() -> None:
    subject = factory_subject("check_factories:encoder_lm", None, "torch.nn.TransformerEncoderLayer", 8)
    assert subject.shape.n_layer == 2 and subject.shape.n_embd == 32 and subject.shape.vocab_size == 128
    assert subject.sites.param_pattern is not None and "encoder\\.layers" in subject.sites.param_pattern
    model = subject.build()
    import re

    hidden = re.compile(subject.sites.hidden_pattern)
    names = [n for n, _ in model.named_modules() if hidden.search("model." + n)]
    assert names == ["encoder.layers.0", "encoder.layers.1"]
    assert isinstance(model(torch.zeros(1, 8, dtype=torch.long)), torch.Tensor)


def test_no_more_workers_than_runs(monkeypatch) -> None:
    """--workers 1000 on a check of one run spawned a thousand processes, each importing Lightning (minutes on two
    cores, then a traceback); a worker beyond the runs has nothing to do."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert worker_counts(build_parser().parse_args(["--workers", "1000"]), 1) == (1, 2)
    assert worker_counts(build_parser().parse_args(["--workers", "1000"]), 3) == (3, 1)
    assert worker_counts(build_parser().parse_args(["--workers", "2"]), 18) == (2, 1)
    assert worker_counts(build_parser().parse_args([]), 18) == (2, 1)  # the default: one per thread


def test_threads_are_at_most_the_cpus_this_process_may_use(monkeypatch) -> None:
    """--threads 1000 on two cores was taken as asked: torch.set_num_threads(1000), a thousand threads contending for
    two CPUs. The range is 1 … the process's CPU affinity (a container's or taskset's share), else the machine's."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine has more; this process may use two
    assert checked_threads(1) == 1 and checked_threads(2) == 2
    for threads in (3, 1000, 0, -1):
        with pytest.raises(LNStabError, match=rf"^--threads={threads} is not allowed; it must be an integer in "
                                              r"\[1, 2\], the CPUs this process may use$"):
            checked_threads(threads)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows: the machine's count
    assert checked_threads(64) == 64
    with pytest.raises(LNStabError, match=r"in \[1, 64\]"):
        checked_threads(65)
