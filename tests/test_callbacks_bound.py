"""GrowthBoundMonitor: Theorem 4's MA bound and the variance bound hold on Peri-LN, fail when broken; growth fits."""

from __future__ import annotations

import math

import pytest
import torch
from support.callbacks import StepClock, lit, loader, record_outputs, trainer

from lnstab.callbacks import GrowthBoundMonitor
from lnstab.layers import DyT, Gate
from lnstab.measures import fit_line


def manual_bound(module, x0: torch.Tensor, dt: float) -> torch.Tensor:
    """RMS(X_0) + Σ Δt·gmax·(γmax + βmax) per sequence, from the model's output norms and the gates beside them."""
    total = 0.0
    named = dict(module.named_modules())
    for name, m in named.items():
        if name.endswith(("ln_1_out", "ln_2_out")) and isinstance(m, torch.nn.LayerNorm | torch.nn.RMSNorm | DyT):
            beta = m.bias.abs().max().item() if getattr(m, "bias", None) is not None else 0.0
            gate = named[name.replace("ln_1_out", "gate_attn").replace("ln_2_out", "gate_mlp")]
            g = gate.weight.abs().max().item() if isinstance(gate, Gate) else 1.0
            total += dt * g * (m.weight.abs().max().item() + beta)
    return x0.reshape(x0.shape[0], -1).square().mean(1).sqrt() + total


@pytest.mark.parametrize(
    "gpt",
    [
        {},
        {"residual_scale": 0.3, "norm_type": "rmsnorm"},
        {"bias": False, "n_layer": 4},
        {"norm_type": "dyt"},  # Peri-LN with DyT: |γ·tanh(αx) + β| ≤ |γ| + |β|, the same bound
        {"norm_type": "dyt", "bias": False, "residual_scale": 0.5, "qk_norm": True},
        {"residual_gate": "layerscale", "layerscale_init": 0.5},  # the gate's max |λ| enters the bound
    ],
    ids=["layernorm", "rmsnorm_dt0.3", "nobias_L4", "dyt", "dyt_nobias_dt0.5_qk", "layerscale"],
)
def test_bound_holds_on_random_and_briefly_trained_peri(tmp_path, gpt):
    module = lit("gpt", gpt=gpt, lr=3e-2)  # a large learning rate moves γ, β away from 1, 0 within a few steps
    clock = StepClock()
    store, remove = record_outputs(module, r"transformer\.drop$", clock)
    finals, remove_f = record_outputs(module, r"transformer\.ln_f$", clock, use_input=True)
    callback = GrowthBoundMonitor(every_n_steps=1)
    snapshots = []

    class Snapshot(StepClock):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots.append(manual_bound(pl_module, torch.zeros(1, 1), gpt.get("residual_scale", 1.0)).item())

    trainer(tmp_path, [clock, Snapshot(), callback], max_steps=8).fit(module, loader(n=32))
    remove(), remove_f()
    assert callback.violations == 0
    assert callback.last["bound/violations"] == 0
    assert callback.last["bound/slack"] > 0 and callback.last["bound/var_slack"] > 0
    assert callback.last["bound/var_final"] <= callback.last["bound/var_bound"]
    assert snapshots[-1] != pytest.approx(snapshots[0]), snapshots  # γ/β really changed during training
    # the logged bound at the last step equals the direct evaluation from X_0 and the live γ, β
    step = 7
    x0 = store[(step, "model.transformer.drop")]
    bound = x0.reshape(x0.shape[0], -1).square().mean(1).sqrt() + snapshots[step]
    assert callback.last["bound/ma_bound"] == pytest.approx(bound.mean().item(), rel=1e-5)
    xd = finals[(step, "model.transformer.ln_f")]
    ma = xd.reshape(xd.shape[0], -1).abs().mean(1)
    assert callback.last["bound/ma_final"] == pytest.approx(ma.mean().item(), rel=1e-5)
    assert callback.last["bound/slack"] == pytest.approx((bound - ma).min().item(), rel=1e-4)


def test_a_gate_above_one_is_in_the_bound_and_leaving_it_out_is_violated():
    """LayerScale's λ multiplies the normalised update: with λ = 3 the updates outgrow Σ Δt·(γmax + βmax), and the
    bound holds only with max |λ| in it."""
    module = lit("gpt", gpt={"n_layer": 4, "residual_gate": "layerscale", "layerscale_init": 3.0})
    with torch.no_grad():
        for name, m in module.named_modules():
            if name.endswith(("ln_1_out", "ln_2_out")):
                m.bias.fill_(1.0)  # aligned updates, so the gate-free bound is really exceeded
    callback = GrowthBoundMonitor(every_n_steps=1)
    callback.setup(None, module, "fit")
    assert all(isinstance(g, Gate) for g in callback.gates) and len(callback.gates) == 8
    callback.subscription.active = callback.subscription.tap.open = True  # a measured micro-batch
    module(torch.randint(0, 100, (4, 16)))
    metrics = callback.evaluate(type("T", (), {"world_size": 1, "loggers": []})(), 0)
    assert metrics["bound/violations"] == 0 and metrics["bound/slack"] > 0
    x0 = callback.subscription.local("seq_rms_var", [0])[0][0].double()
    with_gate = (x0 + callback.growth_sum().item()).mean().item()
    assert metrics["bound/ma_bound"] == pytest.approx(with_gate, rel=1e-5)
    assert callback.growth_sum().item() == pytest.approx(8 * 3.0 * (1.0 + 1.0), rel=1e-6)  # 8 updates, Δt = 1
    without_gate = x0 + callback.growth_sum().item() / 3.0  # RMS(X_0) + Σ Δt·(γmax + βmax)
    assert metrics["bound/ma_final"] > without_gate.mean().item()  # 24.0 against 16.0
    callback.teardown(None, module, "fit")


def test_violation_counted_when_an_update_is_scaled_past_the_bound(tmp_path):
    module = lit("gpt")
    last = module.model.transformer.h[1].resid_mlp
    last.register_forward_hook(lambda m, a, out: out * 100.0)
    callback = GrowthBoundMonitor(every_n_steps=2)
    trainer(tmp_path, [callback], max_steps=3).fit(module, loader())
    # 2 logging steps × 4 sequences × (MA bound + variance bound)
    assert callback.violations == 16
    assert callback.last["bound/violations"] == 16
    assert callback.last["bound/slack"] < 0


def test_violation_when_bound_uses_a_smaller_step_than_the_model():
    """A bound computed with Δt too small for a model whose updates use Δt = 1 is violated."""
    module = lit("gpt", gpt={"n_layer": 4})
    with torch.no_grad():
        for name, m in module.named_modules():
            if name.endswith(("ln_1_out", "ln_2_out")):
                m.weight.fill_(3.0)  # big, aligned updates
                m.bias.fill_(3.0)
    callback = GrowthBoundMonitor(every_n_steps=1, residual_scale=0.01)
    callback.setup(None, module, "fit")
    callback.subscription.active = callback.subscription.tap.open = True  # a measured micro-batch
    module(torch.randint(0, 100, (4, 16)))
    callback.evaluate(type("T", (), {"world_size": 1, "loggers": []})(), 0)
    assert callback.violations > 0


def test_growth_law_fits():
    depth = [0.0, 0.5, 1.0, 1.5, 2.0]
    linear = fit_line(depth, [1 + 3 * d for d in depth], complete=True)
    assert linear["slope"] == pytest.approx(3.0) and linear["r2"] == pytest.approx(1.0)
    exponential = fit_line(depth, [math.log(2.0**d) for d in depth], complete=True)
    assert exponential["slope"] == pytest.approx(math.log(2.0)) and exponential["r2"] == pytest.approx(1.0)
    assert 0 <= fit_line(depth, [1.0, 3.0, 1.5, 4.0, 2.0], complete=True)["r2"] < 0.9
    assert math.isnan(fit_line([0.0], [1.0], complete=True)["slope"])
    # The live fit of a profile with a site that is not finite is undefined, not a fit over the other sites.
    assert math.isnan(fit_line(depth, [1.0, math.inf, 1.5, 4.0, 2.0], complete=True)["slope"])
    assert math.isfinite(fit_line(depth, [1.0, math.inf, 1.5, 4.0, 2.0])["slope"])


@pytest.mark.parametrize("placement", ["pre", "post", "none"])
def test_growth_logged_for_every_placement_without_bound(tmp_path, placement):
    module = lit("gpt", gpt={"placement": placement, "n_layer": 4})
    clock = StepClock()
    store, remove = record_outputs(module, r"transformer\.(drop|h\.\d+\.resid_(attn|mlp))$", clock)
    callback = GrowthBoundMonitor(every_n_steps=1)
    trainer(tmp_path, [clock, callback], max_steps=1).fit(module, loader())
    remove()
    assert "bound/ma_bound" not in callback.last
    names = ["model.transformer.drop"] + [
        f"model.transformer.h.{i}.resid_{k}" for i in range(4) for k in ("attn", "mlp")
    ]
    ma = [store[(0, n)].abs().mean().item() for n in names]
    depth = [k / 2 for k in range(len(names))]
    slope, r2 = (fit_line(depth, ma)[k] for k in ("slope", "r2"))
    rate, r2_exp = (fit_line(depth, [math.log(v) for v in ma])[k] for k in ("slope", "r2"))
    assert callback.last["growth/linear_slope"] == pytest.approx(slope, rel=1e-4, abs=1e-5 * max(ma))
    assert callback.last["growth/linear_r2"] == pytest.approx(r2, rel=1e-3, abs=1e-3)
    assert callback.last["growth/exp_rate"] == pytest.approx(rate, rel=1e-4, abs=1e-5)
    assert callback.last["growth/exp_r2"] == pytest.approx(r2_exp, rel=1e-3, abs=1e-3)


class OwnRMSNorm(torch.nn.Module):
    """An RMSNorm of a user's own (nanoGPT derivatives write one): not a class whose output the bound knows."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


class PeriUpdate(torch.nn.Module):
    """One residual MLP update ``x + ln_out(mlp(x))``, its output norm of class ``norm``."""

    def __init__(self, norm: type) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.ln_out = norm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ln_out(self.mlp(x))


class PeriMLP(torch.nn.Module):
    def __init__(self, norm: type) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 32)
        self.h = torch.nn.Sequential(*(PeriUpdate(norm) for _ in range(4)))
        self.ln_f, self.head = norm(32), torch.nn.Linear(32, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.h(self.embed(x))))


def test_output_norms_of_a_class_it_cannot_bound_are_said_not_dropped_silently(tmp_path):
    """norm_pattern naming the output norms of a user's Peri-LN model whose norm is a class of its own: the matches
    were left out without a word (only LayerNorm, RMSNorm and DyT have outputs the bound knows), so the run logged
    no bound/* metric while the user had named every output norm."""
    from support.callbacks import LitLM

    def monitor():
        return GrowthBoundMonitor(every_n_steps=1, norm_pattern=r"h\.(\d+)\.ln_out$", layer_pattern=r"h\.(\d+)$",
                                  embed_pattern=r"embed$", final_pattern=r"ln_f$")

    said = r"Theorem 4's bound is not checked: norm_pattern=.* matches 4 modules of a class whose output it cannot"
    with pytest.warns(UserWarning, match=rf"GrowthBoundMonitor: {said} bound \(OwnRMSNorm\)"):
        own = monitor()
        trainer(tmp_path, [own], max_steps=1).fit(LitLM(PeriMLP(OwnRMSNorm)), loader())
    assert "bound/ma_bound" not in own.last and "growth/exp_rate" in own.last
    torch_norms = monitor()
    trainer(tmp_path, [torch_norms], max_steps=1).fit(LitLM(PeriMLP(torch.nn.RMSNorm)), loader())
    assert torch_norms.unchecked is None and torch_norms.last["bound/violations"] == 0


def test_state_dict_round_trip_and_arguments():
    callback = GrowthBoundMonitor()
    callback.violations = 7
    restored = GrowthBoundMonitor()
    restored.load_state_dict(callback.state_dict())
    assert restored.violations == 7
    with pytest.raises(ValueError, match="residual_scale=-1"):
        GrowthBoundMonitor(residual_scale=-1)
    with pytest.raises(ValueError, match="every_n_steps="):
        GrowthBoundMonitor(every_n_steps="10")
    with pytest.raises(ValueError, match="tolerance="):
        GrowthBoundMonitor(tolerance=2)
