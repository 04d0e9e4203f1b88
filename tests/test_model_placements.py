"""The placement table drives the model, the Hugging Face export and the growth bound; logits are bit-for-bit those
of the update rules written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lnstab.errors import ConfigError
from lnstab.hf import gpt_to_hf
from lnstab.model import GPT, NORM_PLACEMENTS, PLACEMENTS, GPTConfig, Placement

MODULES = {"input": ("ln_1", "ln_2"), "output": ("ln_1_out", "ln_2_out"), "post": ("ln_1_post", "ln_2_post")}


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=97, block_size=16, **overrides)


def randomize(model: GPT, seed: int = 0) -> None:
    """Non-trivial γ, β so that a missing or misplaced norm cannot hide behind the identity init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("weight") else 0.0))


def norm(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(m, nn.RMSNorm):
        return F.rms_norm(x, m.normalized_shape, m.weight, m.eps)
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def attention(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    a = block.attn
    B, T, C = x.shape
    q, k, v = F.linear(x, a.c_attn.weight, a.c_attn.bias).split(C, dim=2)
    q, k, v = (t.view(B, T, a.n_head, C // a.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
    return F.linear(y, a.c_proj.weight, a.c_proj.bias)


def mlp(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m = block.mlp
    return F.linear(F.gelu(F.linear(x, m.c_fc.weight, m.c_fc.bias), approximate="tanh"), m.c_proj.weight, m.c_proj.bias)


def add(x: torch.Tensor, fx: torch.Tensor, dt: float) -> torch.Tensor:
    return x + fx if dt == 1.0 else torch.add(x, fx, alpha=dt)


# One half-step of each placement, written out from the paper's update rules (not from the table); L = n_layer.
HALF_STEP = {
    "pre": lambda x, f, n_in, n_out, n_post, dt, L: add(x, f(norm(n_in, x)), dt),
    "peri": lambda x, f, n_in, n_out, n_post, dt, L: add(x, norm(n_out, f(norm(n_in, x))), dt),
    "post": lambda x, f, n_in, n_out, n_post, dt, L: norm(n_post, add(x, f(x), dt)),
    "output": lambda x, f, n_in, n_out, n_post, dt, L: add(x, norm(n_out, f(x)), dt),
    "none": lambda x, f, n_in, n_out, n_post, dt, L: add(x, f(x), dt),
    # DeepNet (Wang et al. 2022): LN(α·x + f(x)), α = (2N)^(1/4) for an N-layer decoder
    "deepnorm": lambda x, f, n_in, n_out, n_post, dt, L: norm(n_post, add(x * (2 * L) ** 0.25, f(x), dt)),
}
HAS_FINAL = {"pre": True, "peri": True, "post": False, "output": True, "none": False, "deepnorm": False}


def by_hand(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    c, t = model.config, model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.size(1)))
    step = HALF_STEP[c.norm_placement]
    for b in t.h:
        x = step(x, lambda z, b=b: attention(b, z), b.ln_1, b.ln_1_out, b.ln_1_post, c.residual_scale, c.n_layer)
        x = step(x, lambda z, b=b: mlp(b, z), b.ln_2, b.ln_2_out, b.ln_2_post, c.residual_scale, c.n_layer)
    if HAS_FINAL[c.norm_placement]:
        x = norm(t.ln_f, x)
    return F.linear(x, t.wte.weight)[..., : c.vocab_size]


def test_table_lists_every_placement_once_with_a_docstring() -> None:
    assert NORM_PLACEMENTS == ("pre", "peri", "post", "output", "none", "deepnorm") == tuple(HALF_STEP)
    for name, row in PLACEMENTS.items():
        assert row.name == name and len(row.doc) > 20
    assert PLACEMENTS["pre"].norms == {"input", "final"}
    assert [n for n, p in PLACEMENTS.items() if p.normalised_updates] == ["peri", "output"]


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_modules_exist_exactly_where_the_table_says(placement: str) -> None:
    row = PLACEMENTS[placement]
    model = GPT(tiny(norm_placement=placement))
    for field, names in MODULES.items():
        for block in model.transformer.h:
            for name in names:
                assert isinstance(getattr(block, name), nn.LayerNorm) == getattr(row, field), (field, name)
    assert isinstance(model.transformer.ln_f, nn.LayerNorm) == row.final
    assert model.placement is row


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
@pytest.mark.parametrize("norm_type, dt", [("layernorm", 1.0), ("rmsnorm", 0.3)])
def test_logits_are_bitwise_the_update_rules_by_hand(placement: str, norm_type: str, dt: float) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(norm_placement=placement, norm_type=norm_type, residual_scale=dt)).eval()
    randomize(model)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(idx), by_hand(model, idx))


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_output_norms_are_the_updates_norms_in_order(placement: str) -> None:
    model = GPT(tiny(norm_placement=placement, residual_scale=0.25, n_layer=3))
    found = model.output_norms()
    if not PLACEMENTS[placement].normalised_updates:
        assert found == []
        return
    expected = [getattr(b, n) for b in model.transformer.h for n in ("ln_1_out", "ln_2_out")]
    assert [m for m, _ in found] == expected and all(m is e for (m, _), e in zip(found, expected, strict=True))
    assert [dt for _, dt in found] == [0.25] * 6


@pytest.fixture
def extra_row(monkeypatch):
    """Adding a placement is one row: the model, the export and the bound pick it up without other edits."""

    def add_row(row: Placement) -> None:
        monkeypatch.setitem(PLACEMENTS, row.name, row)

    return add_row


def test_a_new_row_drives_model_export_and_bound(extra_row) -> None:
    extra_row(Placement("sandwich", input=True, output=True, post=True, final=False, doc="Norms everywhere (test)."))
    extra_row(Placement("pre_again", input=True, output=False, post=False, final=True, doc="Pre-LN again (test)."))
    model = GPT(tiny(norm_placement="sandwich"))
    block = model.transformer.h[0]
    assert all(isinstance(getattr(block, n), nn.LayerNorm) for names in MODULES.values() for n in names)
    assert isinstance(model.transformer.ln_f, nn.Identity)
    assert model.output_norms() == []  # the post norm renormalises: the bound's form does not hold
    with pytest.raises(ConfigError, match="norm_placement='sandwich'.*'pre' or 'pre_again'"):
        gpt_to_hf(model)
    torch.manual_seed(0)
    ours = GPT(tiny(norm_placement="pre_again")).eval()
    idx = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(gpt_to_hf(ours).eval()(idx).logits, ours(idx), rtol=0, atol=1e-5)


def test_a_new_row_with_normalised_updates_gets_the_growth_bound(extra_row) -> None:
    from lnstab.callbacks import GrowthBoundMonitor

    extra_row(Placement("peri_bare", input=True, output=True, post=False, final=False, doc="Peri-LN, no ln_f (test)."))
    torch.manual_seed(0)
    model = GPT(tiny(norm_placement="peri_bare", residual_scale=0.5))
    randomize(model)
    bound = GrowthBoundMonitor(every_n_steps=1)
    bound.setup(None, model, "fit")
    assert [m for m, _ in bound.norms] == [m for m, _ in model.output_norms()] and len(bound.norms) == 4
    bound.subscription.active = bound.subscription.tap.open = True  # a measured micro-batch
    model(torch.randint(0, 97, (3, 16)))
    metrics = bound.evaluate(type("T", (), {"world_size": 1, "loggers": []})(), 0)
    assert metrics["bound/violations"] == 0 and metrics["bound/slack"] > 0
    growth = sum(0.5 * (m.weight.abs().max() + m.bias.abs().max()).item() for m, _ in model.output_norms())
    rms_x0 = bound.subscription.local("seq_rms_var", [0])[0][0].double().mean().item()  # mean RMS(X_0)
    assert metrics["bound/ma_bound"] == pytest.approx(rms_x0 + growth, rel=1e-5)  # RMS(X_0) + Σ Δt(γmax + βmax)
    bound.teardown(None, model, "fit")
