"""The GPT under every placement: what each norm does, shapes, presets, KV cache and bad input."""

from __future__ import annotations

import pytest
import torch

from lnstab.errors import ConfigError
from lnstab.layers import RMSNorm
from lnstab.model import GPT, NORM_PLACEMENTS, GPTConfig

PLACEMENTS = list(NORM_PLACEMENTS)


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=97, block_size=16, **overrides)


def randomize_norms(model: GPT, seed: int = 0) -> None:
    """Non-trivial γ, β so tests cannot pass by the identity init alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("weight") else 0.0))


def capture(model: GPT, suffix: str) -> dict[str, list]:
    """Inputs and outputs of every module whose name ends with ``suffix``, in call order."""
    seen: dict[str, list] = {"inputs": [], "outputs": []}

    def copy(t):
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    def hook(module, args, output):
        seen["inputs"].append(tuple(copy(a) for a in args))
        seen["outputs"].append(tuple(map(copy, output)) if isinstance(output, tuple) else copy(output))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(suffix)]
    seen["handles"] = handles
    return seen


@pytest.mark.parametrize(
    "name, expected",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)],
)
def test_preset_parameter_counts_match_gpt2(name: str, expected: int) -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(name))
    assert model.num_params() == expected


def test_every_placement_shares_module_names_and_hook_points() -> None:
    names = {p: [n for n, _ in GPT(tiny(norm_placement=p)).named_modules()] for p in PLACEMENTS}
    assert all(v == names["pre"] for v in names.values())
    assert "transformer.h.1.resid_attn" in names["pre"] and "transformer.h.1.resid_mlp" in names["pre"]


def test_pre_ln_state_dict_uses_gpt2_names_only() -> None:
    keys = set(GPT(tiny(norm_placement="pre")).state_dict())
    expected = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    expected.add("lm_head.weight")
    for i in range(2):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            expected |= {f"transformer.h.{i}.{part}.weight", f"transformer.h.{i}.{part}.bias"}
    assert keys == expected


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dt", [1.0, 0.1])
def test_residual_update_is_exactly_dt_times_branch(placement: str, dt: float) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(norm_placement=placement, residual_scale=dt)).eval()
    randomize_norms(model)
    seen = capture(model, "resid_attn")
    seen_mlp = capture(model, "resid_mlp")
    model(torch.randint(0, 97, (3, 16)))
    alpha = (2 * 2) ** 0.25 if placement == "deepnorm" else 1.0  # DeepNet's (2N)^(1/4) for N = 2 layers
    assert len(seen["outputs"]) == 2 and len(seen_mlp["outputs"]) == 2
    for s in (seen, seen_mlp):
        for (x, fx), out in zip(s["inputs"], s["outputs"], strict=True):
            torch.testing.assert_close(out, alpha * x + dt * fx, rtol=0, atol=1e-6)
            assert fx.abs().mean() > 1e-6  # the branch is not trivially zero


def _is_normalised(y: torch.Tensor, norm: torch.nn.Module, x: torch.Tensor) -> None:
    """``y`` is ``norm`` applied to ``x`` per token: undo γ, β; zero mean, variance v/(v + eps) with v = Var(x)."""
    z = (y - norm.bias) / norm.weight
    v = x.var(-1, unbiased=False)
    torch.testing.assert_close(z.mean(-1), torch.zeros_like(v), atol=1e-4, rtol=0)
    torch.testing.assert_close(z.var(-1, unbiased=False), v / (v + norm.eps), atol=1e-4, rtol=1e-4)


def test_post_ln_block_outputs_are_normalised_per_token() -> None:
    torch.manual_seed(1)
    model = GPT(tiny(norm_placement="post", residual_scale=0.5)).eval()
    randomize_norms(model)
    assert isinstance(model.transformer.ln_f, torch.nn.Identity)
    assert isinstance(model.transformer.h[0].ln_1, torch.nn.Identity)
    post = capture(model, "h.0.ln_2_post")
    resid = capture(model, "h.0.resid_mlp")
    model(torch.randint(0, 97, (2, 16)))
    torch.testing.assert_close(post["inputs"][0][0], resid["outputs"][0])  # the norm follows the residual sum
    _is_normalised(post["outputs"][0], model.transformer.h[0].ln_2_post, post["inputs"][0][0])


def test_peri_ln_sublayer_outputs_pass_through_their_norm() -> None:
    torch.manual_seed(2)
    model = GPT(tiny(norm_placement="peri", residual_scale=0.1)).eval()
    randomize_norms(model)
    block = model.transformer.h[0]
    attn = capture(model, "h.0.attn")
    resid = capture(model, "h.0.resid_attn")
    ln_in = capture(model, "h.0.ln_1")
    model(torch.randint(0, 97, (2, 16)))
    x, fx = resid["inputs"][0]
    _is_normalised(ln_in["outputs"][0], block.ln_1, x)  # the sublayer's input is normalised
    torch.testing.assert_close(ln_in["inputs"][0][0], x)
    torch.testing.assert_close(fx, block.ln_1_out(attn["outputs"][0][0]))
    _is_normalised(fx, block.ln_1_out, attn["outputs"][0][0])
    assert not isinstance(model.transformer.ln_f, torch.nn.Identity)  # final norm kept


def test_output_placement_normalises_the_branch_only() -> None:
    model = GPT(tiny(norm_placement="output")).eval()
    randomize_norms(model)
    block = model.transformer.h[1]
    assert isinstance(block.ln_1, torch.nn.Identity) and isinstance(block.ln_2, torch.nn.Identity)
    resid = capture(model, "h.1.resid_mlp")
    mlp = capture(model, "h.1.mlp")
    model(torch.randint(0, 97, (2, 16)))
    _is_normalised(resid["inputs"][0][1], block.ln_2_out, mlp["outputs"][0])


def test_none_placement_has_no_norm_at_all() -> None:
    model = GPT(tiny(norm_placement="none"))
    assert not any(isinstance(m, torch.nn.LayerNorm | torch.nn.RMSNorm) for m in model.modules())


@pytest.mark.parametrize("placement", ["pre", "peri", "post", "output"])
def test_rmsnorm_replaces_every_norm(placement: str) -> None:
    model = GPT(tiny(norm_placement=placement, norm_type="rmsnorm"))
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.LayerNorm | torch.nn.RMSNorm)}
    assert kinds == {RMSNorm} and issubclass(RMSNorm, torch.nn.RMSNorm)  # torch's, quiet under bf16 autocast


def test_init_follows_gpt2() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small", vocab_size=500))
    std_proj = model.transformer.h[0].attn.c_proj.weight.std().item()
    std_fc = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.001
    assert abs(std_proj - 0.02 / (2 * 6) ** 0.5) < 0.0005
    assert model.lm_head.weight is model.transformer.wte.weight


def test_vocab_padding_keeps_logit_width() -> None:
    model = GPT(GPTConfig.preset("tiny", pad_vocab_multiple=64))
    assert model.transformer.wte.weight.shape[0] == 50304
    assert model(torch.randint(0, 50257, (1, 8))).shape == (1, 8, 50257)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_kv_cache_generation_equals_full_recompute(placement: str) -> None:
    torch.manual_seed(3)
    model = GPT(tiny(norm_placement=placement)).eval()
    prompt = torch.randint(0, 97, (2, 5))
    out = model.generate(prompt, max_new_tokens=8, greedy=True)
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sampled = [model.generate(prompt, 6, top_k=10, generator=g) for g in (g1, g2)]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(norm_placement="sideways"), "norm_placement='sideways'"),
        (dict(norm_type="batchnorm"), "norm_type='batchnorm'"),
        (dict(residual_scale=0.0), "residual_scale=0.0"),
        (dict(residual_scale=-1.0), "residual_scale=-1.0"),
        (dict(residual_scale=float("nan")), "residual_scale=nan"),
        (dict(n_embd=100, n_head=3), "n_embd=100"),
        (dict(n_layer=0), "n_layer=0"),
        (dict(dropout=1.5), "dropout=1.5"),
        (dict(colour="red"), "'colour' is not a GPTConfig field"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        GPTConfig.preset("tiny", **overrides)
    message = str(info.value)
    assert field in message and "\n" not in message


def test_unknown_preset_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"preset='gpt5' is not allowed; choose one of: gpt2, gpt2-medium"):
        GPTConfig.preset("gpt5")


def test_sequence_longer_than_block_size_is_refused() -> None:
    model = GPT(tiny())
    with pytest.raises(ConfigError, match=r"sequence length 17 is not allowed; it must be <= block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), max_new_tokens=7)
