"""The model options (QK-norm, DyT, ReZero/LayerScale gates, DeepNorm, z-loss): each one's defining property, that it
trains, that the default is untouched, and that bad values are refused in one line."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from support.module import StepOfRead, saved_bytes, small_data, small_module
from torch import nn

from lnstab.errors import ConfigError
from lnstab.layers import DyT, Gate, cait_layerscale_init
from lnstab.memory import estimate_memory, total_params
from lnstab.model import GPT, PLACEMENTS, GPTConfig
from lnstab.module import GPTModule
from lnstab.moduleargs import MODEL_ARGS, MODEL_DEFAULTS, MODULE_ARGS, MODULE_TYPES, TRAINING_DEFAULTS, gpt_config

VOCAB = 97


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=16, **overrides)


def tokens(seed: int = 0, b: int = 3, t: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def randomize(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial norm and gate parameters, so no property can pass by the identity init alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "_norm." in name or "gate_" in name or name.startswith("transformer.ln_f"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith(("weight", "alpha")) else 0.0))


def hook_outputs(module: nn.Module) -> tuple[list[torch.Tensor], torch.utils.hooks.RemovableHandle]:
    seen: list[torch.Tensor] = []
    def hook(m: nn.Module, args: tuple, out: torch.Tensor | tuple) -> None:
        seen.append((out[0] if isinstance(out, tuple) else out).detach().clone())  # attention returns (y, cache)

    return seen, module.register_forward_hook(hook)


OPTIONS = {
    "qk_norm": dict(qk_norm=True),
    "qk_norm_rms": dict(qk_norm=True, norm_type="rmsnorm"),
    "z_loss": dict(z_loss=1e-2),
    "dyt_pre": dict(norm_type="dyt"),
    "dyt_peri": dict(norm_type="dyt", norm_placement="peri", qk_norm=True),
    "rezero": dict(residual_gate="rezero", norm_placement="none"),
    "layerscale": dict(residual_gate="layerscale", layerscale_init=0.1),
    "deepnorm": dict(norm_placement="deepnorm"),
    "untied": dict(tie_embeddings=False),
    "xavier_post": dict(init="xavier", norm_placement="post", tie_embeddings=False),
}


def test_dyt_is_gamma_tanh_alpha_x_plus_beta() -> None:
    torch.manual_seed(0)
    dyt = DyT(8, alpha_init=0.7)
    assert dyt.alpha.item() == pytest.approx(0.7) and torch.equal(dyt.weight, torch.ones(8))
    assert torch.equal(dyt.bias, torch.zeros(8))
    randomize(nn.ModuleDict({"ln_": dyt}))
    x = 3 * torch.randn(4, 5, 8)
    expected = dyt.weight * torch.tanh(dyt.alpha * x) + dyt.bias
    torch.testing.assert_close(dyt(x), expected, rtol=0, atol=0)
    assert (dyt(1e6 * x).abs() <= dyt.weight.abs() + dyt.bias.abs() + 1e-6).all()  # the entry-wise bound
    assert DyT(8, bias=False).bias is None


@pytest.mark.parametrize("placement", ["pre", "peri", "post", "output"])
def test_dyt_replaces_every_norm(placement: str) -> None:
    model = GPT(tiny(norm_placement=placement, norm_type="dyt", dyt_alpha_init=0.25, qk_norm=True))
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm | DyT)}
    assert kinds == {DyT}
    alphas = {m.alpha.item() for m in model.modules() if isinstance(m, DyT)}
    assert alphas == {0.25}
    row = PLACEMENTS[placement]
    assert sum(isinstance(m, DyT) for m in model.modules()) == 2 * (2 * (row.input + row.output + row.post) + 2) + (
        1 if row.final else 0
    )  # two blocks × (their placement's norms + q_norm + k_norm) + ln_f


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm", "dyt"])
def test_qk_norm_hooks_see_the_normalised_q_and_k_the_attention_uses(norm_type: str) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(qk_norm=True, norm_type=norm_type)).eval()
    randomize(model)
    attn = model.transformer.h[1].attn
    q_seen, hq = hook_outputs(attn.q_norm)
    k_seen, hk = hook_outputs(attn.k_norm)
    y_seen, hy = hook_outputs(attn)
    inputs: list[torch.Tensor] = []
    hx = attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    with torch.no_grad():
        model(tokens())
    for h in (hq, hk, hy, hx):
        h.remove()
    (q,), (k,), (x,) = q_seen, k_seen, inputs
    B, T, C = x.shape
    hs = C // attn.n_head
    assert q.shape == k.shape == (B, attn.n_head, T, hs)
    raw_q, raw_k, v = F.linear(x, attn.c_attn.weight, attn.c_attn.bias).split(C, dim=2)
    raw_q, raw_k, v = (t.view(B, T, attn.n_head, hs).transpose(1, 2) for t in (raw_q, raw_k, v))
    for got, raw, norm in ((q, raw_q, attn.q_norm), (k, raw_k, attn.k_norm)):
        if norm_type == "layernorm":  # per (token, head): undo γ, β; zero mean, unit variance over the head dim
            z = (got - norm.bias) / norm.weight
            torch.testing.assert_close(z.mean(-1), torch.zeros_like(z[..., 0]), atol=1e-4, rtol=0)
            torch.testing.assert_close(z.var(-1, unbiased=False), torch.ones_like(z[..., 0]), atol=1e-3, rtol=0)
        elif norm_type == "rmsnorm":
            z = got / norm.weight
            torch.testing.assert_close(z.square().mean(-1), torch.ones_like(z[..., 0]), atol=1e-3, rtol=0)
        else:
            torch.testing.assert_close(got, norm.weight * torch.tanh(norm.alpha * raw) + norm.bias)
        assert not torch.allclose(got, raw)
    # the attention output is SDPA of exactly the hooked q and k
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(y_seen[0], F.linear(y, attn.c_proj.weight, attn.c_proj.bias), rtol=1e-5, atol=1e-6)


def test_without_qk_norm_the_hooks_see_the_raw_q_and_k() -> None:
    model = GPT(tiny()).eval()
    attn = model.transformer.h[0].attn
    assert isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)
    q_seen, hq = hook_outputs(attn.q_norm)
    model(tokens())
    hq.remove()
    x = model.transformer.drop(model.transformer.wte(tokens()) + model.transformer.wpe(torch.arange(16)))
    q = F.linear(model.transformer.h[0].ln_1(x), attn.c_attn.weight, attn.c_attn.bias)[..., :64]
    torch.testing.assert_close(q_seen[0], q.view(3, 16, 2, 32).transpose(1, 2))


def test_qk_norm_kv_cache_generation_equals_full_recompute() -> None:
    torch.manual_seed(3)
    model = GPT(tiny(qk_norm=True)).eval()
    randomize(model)
    prompt = tokens(b=2, t=5)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, greedy=True), seq)


@pytest.mark.parametrize("placement", ["none", "pre", "peri", "output"])
def test_rezero_is_the_identity_of_the_stream_at_initialisation(placement: str) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(norm_placement=placement, residual_gate="rezero"))
    gates = model.residual_gates()
    assert len(gates) == 4 and all(isinstance(g, Gate) and g.weight.shape == (1,) for g in gates)
    assert all(g.weight.item() == 0 for g in gates)
    updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for block in model.transformer.h:
        for resid in (block.resid_attn, block.resid_mlp):
            resid.register_forward_hook(lambda m, a, out: updates.append((a[0], a[1], out)))
    idx = tokens()
    logits = model(idx)
    assert len(updates) == 4
    for x, fx, out in updates:
        assert torch.equal(out, x) and fx.abs().max() == 0
    t = model.transformer
    x0 = t.wte(idx) + t.wpe(torch.arange(16))
    torch.testing.assert_close(logits, F.linear(t.ln_f(x0), t.wte.weight), rtol=0, atol=0)
    model(idx, idx).backward()  # at α = 0 only the gates receive a gradient from the branches
    assert all(g.weight.grad.abs().item() > 0 for g in gates)
    assert model.transformer.h[0].mlp.c_fc.weight.grad.abs().max() == 0


def test_layerscale_init_and_update() -> None:
    model = GPT(tiny(residual_gate="layerscale", layerscale_init=1e-3, residual_scale=0.5)).eval()
    assert all(torch.equal(g.weight, torch.full((64,), 1e-3)) for g in model.residual_gates())
    randomize(model)
    block = model.transformer.h[0]
    seen: list = []
    block.resid_mlp.register_forward_hook(lambda m, a, out: seen.append((a[0], a[1], out)))
    branch, h = hook_outputs(block.mlp)
    model(tokens())
    h.remove()
    x, fx, out = seen[0]
    torch.testing.assert_close(fx, block.gate_mlp.weight * branch[0])  # the gate multiplies the sublayer output
    torch.testing.assert_close(out, x + 0.5 * block.gate_mlp.weight * branch[0])  # … before Δt
    # CaiT's rule when no value is given (Touvron et al. 2021: 0.1 up to depth 18, 1e-5 at 24, 1e-6 deeper)
    assert [cait_layerscale_init(n) for n in (2, 12, 18, 24, 36)] == [0.1, 0.1, 0.1, 1e-5, 1e-6]
    assert GPTConfig.preset("gpt2", residual_gate="layerscale").layerscale == 0.1
    with torch.device("meta"):
        deep = GPT(GPTConfig.preset("gpt2-xl", residual_gate="layerscale"))
    assert deep.transformer.h[0].gate_attn.init == 1e-6


@pytest.mark.parametrize("n_layer", [2, 12, 48])
def test_deepnorm_constants(n_layer: int) -> None:
    with torch.device("meta"):
        model = GPT(tiny(norm_placement="deepnorm", n_layer=n_layer))
    # Wang et al. 2022, Figure 2(b), decoder-only: α = (2N)^(1/4), β = (8N)^(-1/4)
    alpha = (2 * n_layer) ** 0.25
    for block in model.transformer.h:
        assert block.resid_attn.stream == pytest.approx(alpha) and block.resid_mlp.stream == pytest.approx(alpha)
        assert isinstance(block.ln_1_post, nn.LayerNorm) and isinstance(block.ln_1, nn.Identity)
    assert isinstance(model.transformer.ln_f, nn.Identity)
    assert PLACEMENTS["deepnorm"].init_gain(n_layer) == pytest.approx((8 * n_layer) ** -0.25)
    assert model.output_norms() == []  # the post norm renormalises: no Theorem 4 bound


def test_deepnorm_init_gains() -> None:
    torch.manual_seed(0)
    n_layer, C = 6, 384
    model = GPT(GPTConfig.preset("small", vocab_size=500, norm_placement="deepnorm"))
    beta = (8 * n_layer) ** -0.25
    block = model.transformer.h[3]
    q, k, v = block.attn.c_attn.weight.split(C)

    def xavier_std(gain: float, fan_in: int, fan_out: int) -> float:
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    expected = {"q": (q, xavier_std(1.0, C, C)), "k": (k, xavier_std(1.0, C, C)), "v": (v, xavier_std(beta, C, C)),
                "attn.c_proj": (block.attn.c_proj.weight, xavier_std(beta, C, C)),
                "mlp.c_fc": (block.mlp.c_fc.weight, xavier_std(beta, C, 4 * C)),
                "mlp.c_proj": (block.mlp.c_proj.weight, xavier_std(beta, 4 * C, C))}
    for name, (w, std) in expected.items():
        assert w.std().item() == pytest.approx(std, rel=0.02), name
        assert abs(w.mean().item()) < 0.05 * std, name
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)  # embeddings keep GPT-2's


def test_deepnorm_forward_is_post_ln_at_step_dt_over_alpha() -> None:
    # LN(α·x + Δt·f) = LN(x + (Δt/α)·f): LayerNorm ignores the scale of its input (up to eps)
    torch.manual_seed(0)
    deep = GPT(tiny(norm_placement="deepnorm", residual_scale=0.5)).eval()
    randomize(deep)
    post = GPT(tiny(norm_placement="post", residual_scale=0.5 / (2 * 2) ** 0.25)).eval()
    post.load_state_dict(deep.state_dict())
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(deep(idx), post(idx), rtol=1e-3, atol=1e-3)
        assert not torch.allclose(deep(idx), GPT(tiny(norm_placement="post", residual_scale=0.5)).eval()(idx))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_keeps_the_module_names(name: str) -> None:
    base = [n for n, _ in GPT(tiny()).named_modules()]
    assert [n for n, _ in GPT(tiny(**OPTIONS[name])).named_modules()] == base


def test_default_is_gpt2_with_no_option_on() -> None:
    config = GPTConfig()
    assert (config.qk_norm, config.z_loss, config.norm_type, config.residual_gate) == (False, 0.0, "layernorm", "none")
    assert (config.tie_embeddings, config.init) == (True, "gpt2")
    model = GPT(tiny())
    assert not any(isinstance(m, Gate | DyT) for m in model.modules())
    assert all(b.resid_attn.stream == 1.0 for b in model.transformer.h)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_trains_and_lowers_the_loss(name: str) -> None:
    torch.manual_seed(0)
    model = GPT(tiny(**OPTIONS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = tokens(0, b=8), tokens(1, b=8)
    with torch.no_grad():
        before = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    for _ in range(25):
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    # memorising one batch: 4.57 -> ~0.7 in 25 steps for most options; DyT slowest (-0.49: tanh(0.5·x) passes the
    # 0.02-scale embedding on at half its size, where a norm would rescale it to unit variance)
    assert math.isfinite(after) and after < before - 0.3, (before, after)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(qk_norm="yes"), "qk_norm='yes'"),
        (dict(z_loss=-1e-4), "z_loss=-0.0001"),
        (dict(z_loss=float("inf")), "z_loss=inf"),
        (dict(norm_type="tanh"), "norm_type='tanh'"),
        (dict(dyt_alpha_init=0.0), "dyt_alpha_init=0.0"),
        (dict(residual_gate="highway"), "residual_gate='highway'"),
        (dict(layerscale_init=0.0), "layerscale_init=0.0"),
        (dict(layerscale_init="small"), "layerscale_init='small'"),
        (dict(norm_placement="deepest"), "norm_placement='deepest'"),
    ],
)
def test_bad_option_is_one_line_naming_the_field(overrides: dict, field: str) -> None:
    for build in (lambda: GPTConfig.preset("tiny", **overrides), lambda: GPTModule(preset="tiny", **overrides)):
        with pytest.raises(ConfigError) as info:
            build()
        message = str(info.value)
        assert field in message and "is not allowed" in message and "\n" not in message


def test_module_exposes_every_option() -> None:
    values = dict(qk_norm=True, z_loss=1e-4, dyt_alpha_init=0.8, residual_gate="layerscale", layerscale_init=1e-2,
                  norm_type="dyt", norm_placement="deepnorm")
    assert set(values) <= set(MODEL_ARGS)
    module = GPTModule(preset="tiny", vocab_size=VOCAB, block_size=16, **values)
    assert all(getattr(module.config, k) == v for k, v in values.items())
    assert gpt_config(dict(module.hparams)) == module.config  # what a checkpoint's hyperparameters rebuild


def test_the_lightning_free_copy_of_the_modules_arguments_is_its_signature() -> None:
    """``lnstab.moduleargs`` (read by ``lnstab check``'s parent, which never imports Lightning) names GPTModule's
    arguments in order, with the same defaults, and tells which build the model."""
    signature = {k: p for k, p in inspect.signature(GPTModule.__init__).parameters.items() if k != "self"}
    params = {k: p.default for k, p in signature.items()}
    assert tuple(params) == MODULE_ARGS
    assert {k: p.annotation for k, p in signature.items()} == MODULE_TYPES  # what lnstab report checks a config by
    assert {k: params[k] for k in MODEL_DEFAULTS} == MODEL_DEFAULTS
    assert {k: params[k] for k in TRAINING_DEFAULTS} == TRAINING_DEFAULTS
    assert set(MODEL_ARGS) == {f.name for f in dataclasses.fields(GPTConfig)} & set(params)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_memory_estimate_counts_each_option(name: str) -> None:
    config = GPTConfig.preset("tiny", vocab_size=97, block_size=32, n_layer=3, pad_vocab_multiple=64, **OPTIONS[name])
    torch.manual_seed(0)
    model = GPT(config)
    assert total_params(config) == model.num_params()
    estimate = estimate_memory(config, 4, precision="32-true", strategy="single")
    assert estimate.activations + estimate.head == saved_bytes(model, tokens(0, b=4, t=32))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_z_loss_is_logged_on_logging_steps_without_host_reads_on_the_others(tmp_path, monkeypatch, precision) -> None:
    # As tests/test_module.py's host-read test, with the z-loss on: train/z_loss travels with train/loss.
    from lightning.pytorch.loggers import CSVLogger

    from lnstab.callbacks import Throughput
    from lnstab.trainer import LNStabTrainer

    reads = StepOfRead(monkeypatch)
    t = LNStabTrainer(accelerator="cpu", precision=precision, max_steps=10, log_every_n_steps=5, gradient_clip_val=1.0,
                      logger=CSVLogger(tmp_path), callbacks=[reads, Throughput()], limit_val_batches=0,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    module = small_module(z_loss=1e-2)
    t.fit(module, small_data())
    for step in (0, 1, 2, 3):
        assert step not in reads.reads, step
    for step in (5, 6, 7, 8):
        assert reads.reads.get(step, set()) <= reads.reads[4], step
    z, ce = t.callback_metrics["train/z_loss"].item(), t.callback_metrics["train/loss"].item()
    assert 0 < z < 1e-2 * (2 * math.log(64)) ** 2 and 0 < ce < math.log(64) + 0.5  # c·(log Z)², log Z near log V


def test_z_loss_off_logs_no_z_loss_and_val_loss_is_the_cross_entropy(tmp_path) -> None:
    import lightning.pytorch as pl

    data = small_data()
    for z_loss in (0.0, 0.5):
        pl.seed_everything(0)
        module = small_module(z_loss=z_loss)
        t = pl.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, val_check_interval=2,
                       num_sanity_val_steps=0, default_root_dir=tmp_path)
        t.fit(module, data)
        assert ("train/z_loss" in t.callback_metrics) == (z_loss > 0)
        batches = [b for _, b in zip(range(2), data.val_dataloader(), strict=False)]
        with torch.no_grad():
            ce = sum(module.loss(module(x), y).item() for x, y in batches) / 2
            x, y = batches[0]
            parts = module.model(x, y, loss_parts=True)
            assert module(x, y).item() == pytest.approx((parts.cross_entropy + parts.z_loss).item(), rel=1e-6)
        assert t.callback_metrics["val/loss"].item() == pytest.approx(ce, rel=1e-5)  # not the objective
        assert (parts.z_loss.item() > 1.0) == (z_loss > 0)  # 0.5·(log Z)², log Z ≈ log 64 at this stage


# ------------------------------------------------------------------ untied embeddings, Xavier initialisation


def test_untied_head_is_its_own_weight_and_trains_separately() -> None:
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=False))
    head, wte = model.lm_head.weight, model.transformer.wte.weight
    assert head is not wte and head.data_ptr() != wte.data_ptr()
    assert model.num_params() == GPT(tiny()).num_params() + head.numel()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() != state["transformer.wte.weight"].data_ptr()
    before_head, before_wte = head.detach().clone(), wte.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(tokens(), tokens(1)).backward()
    assert not torch.equal(head.grad, wte.grad)  # the head's gradient is not added into the embedding's
    opt.step()
    assert not torch.equal(head, before_head) and not torch.equal(wte, before_wte)
    torch.testing.assert_close(head - before_head, -model.lm_head.weight.grad, rtol=0, atol=1e-7)
    torch.testing.assert_close(wte - before_wte, -model.transformer.wte.weight.grad, rtol=0, atol=1e-7)


def gpt2_reference_init(model: GPT, n_layer: int) -> None:
    """GPT-2's initialisation as lnstab drew it before the init option: the default must draw exactly this."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


def test_default_init_and_tying_draw_gpt2_weights_as_before() -> None:
    ours, ref = GPT(tiny()), GPT(tiny())
    assert ours.lm_head.weight is ours.transformer.wte.weight and list(ours.state_dict()) == list(ref.state_dict())
    torch.manual_seed(123)
    gpt2_reference_init(ref, 2)
    torch.manual_seed(123)
    ours.reset_parameters()
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def xavier_bound(weight: torch.Tensor) -> float:
    fan_out, fan_in = weight.shape
    return math.sqrt(6.0 / (fan_in + fan_out))


@pytest.mark.parametrize("tie", [True, False])
def test_xavier_init_is_xavier_uniform_without_residual_scaling(tie: bool) -> None:
    torch.manual_seed(0)
    config = GPTConfig.preset("mini", vocab_size=512, init="xavier", tie_embeddings=tie)
    model, gpt2 = GPT(config).requires_grad_(False), GPT(dataclasses.replace(config, init="gpt2")).requires_grad_(False)
    c = config.n_embd
    for block, ref in zip(model.transformer.h, gpt2.transformer.h, strict=True):
        q, k, v = block.attn.c_attn.weight.split(c)  # each its own (C, C) Xavier matrix
        for w, ref_w in ((q, ref.attn.c_attn.weight), (k, None), (v, None), (block.attn.c_proj.weight,
                         ref.attn.c_proj.weight), (block.mlp.c_fc.weight, ref.mlp.c_fc.weight),
                         (block.mlp.c_proj.weight, ref.mlp.c_proj.weight)):
            bound = xavier_bound(w)
            assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.97 * bound  # U(-a, a)
            assert float(w.std()) == pytest.approx(bound / math.sqrt(3), rel=0.03)  # sqrt(2 / (fan_in + fan_out))
            if ref_w is not None:
                assert float(w.std()) > 2 * float(ref_w.std())  # not GPT-2's 0.02 nor its 0.02/sqrt(2N)
    # c_proj of the MLP and the attention: fan-based, the same std at every depth (no 1/sqrt(2N))
    assert float(model.transformer.h[0].attn.c_proj.weight.std()) == pytest.approx(math.sqrt(1 / c), rel=0.03)
    assert float(model.transformer.wte.weight.std()) == pytest.approx(0.02, rel=0.03)  # embeddings: GPT-2's
    head = model.lm_head.weight
    if tie:
        assert head is model.transformer.wte.weight
    else:
        assert float(head.std()) == pytest.approx(xavier_bound(head) / math.sqrt(3), rel=0.03)


def test_deepnorm_keeps_its_own_init_with_xavier() -> None:
    torch.manual_seed(0)
    a = GPT(GPTConfig.preset("mini", vocab_size=64, norm_placement="deepnorm", init="xavier"))
    v = a.transformer.h[0].attn.c_attn.weight.split(128)[2]
    beta = PLACEMENTS["deepnorm"].init_gain(4)
    assert float(v.std()) == pytest.approx(beta * math.sqrt(2 / 256), rel=0.05)  # DeepNet's Xavier normal, gain β


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(init="he"), "init='he'"),
        (dict(tie_embeddings="no"), "tie_embeddings='no' is not allowed; it must be true or false"),
    ],
)
def test_bad_init_and_tying_are_one_line(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        tiny(**overrides)
    assert "\n" not in str(info.value)


def test_rmsnorm_under_bf16_autocast_says_nothing_and_computes_what_torchs_does() -> None:
    """Every bf16-mixed fit with norm_type rmsnorm on a CPU printed torch's 'Mismatch dtype between input and weight
    … Cannot dispatch to fused implementation' (autocast hands the norm bf16, its weight is fp32)."""
    import warnings

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=64, block_size=16, norm_type="rmsnorm"))
    x = torch.randint(0, 64, (2, 16))
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        logits = model(x)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)], [str(w.message) for w in caught]
    norm = model.transformer.ln_f
    assert type(norm).__mro__[1] is nn.RMSNorm and isinstance(norm, nn.RMSNorm)
    h = torch.randn(2, 16, norm.weight.numel(), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(norm(h), nn.RMSNorm.forward(norm, h))  # the same computation, only quiet
    assert torch.isfinite(logits).all()
