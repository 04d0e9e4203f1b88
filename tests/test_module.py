"""The Lightning module: schedule, decay groups, a short fit per placement, checkpoint round-trip and resume."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from support.module import VOCAB, StepOfRead, small_data, small_module

from lnstab.errors import ConfigError
from lnstab.model import NORM_PLACEMENTS
from lnstab.module import GPTModule, lr_at
from lnstab.rundir import read_summary


def trainer(tmp_path, **overrides) -> pl.Trainer:
    kwargs = dict(
        accelerator="cpu",
        max_steps=40,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        limit_val_batches=4,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def test_schedule_warms_up_linearly_then_follows_cosine_to_min_lr() -> None:
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)  # half way down the cosine
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(10_000, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_only_matrices_decay() -> None:
    module = small_module(weight_decay=0.1)
    decay, no_decay = module.parameter_groups()
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == module.model.num_params()  # every parameter exactly once (the tied head not twice)


# Δt per placement: with Δt = 1, 'output' adds a unit-variance branch to a 0.02-scale embedding at every half-step
# and needs ~200 steps to move (measured: 4.18 -> 4.09 after 60 steps, 3.62 after 200); Δt = 0.1 trains at once.
STEP_SIZES = {"pre": 1.0, "peri": 1.0, "post": 1.0, "output": 0.1, "none": 0.5, "deepnorm": 1.0}


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_short_cpu_fit_lowers_the_loss(placement: str, tmp_path) -> None:
    pl.seed_everything(0)
    module = small_module(norm_placement=placement, residual_scale=STEP_SIZES[placement])
    data = small_data()
    data.setup("fit")
    x, y = next(iter(data.val_dataloader()))
    with torch.no_grad():
        before = module.loss(module(x), y).item()
    trainer(tmp_path, max_steps=60).fit(module, data)
    with torch.no_grad():
        after = module.loss(module(x), y).item()
    assert before == pytest.approx(math.log(VOCAB), abs=0.3)
    assert after < before - 0.25, (before, after)


def test_logged_metrics_and_ppl(tmp_path) -> None:
    module, data = small_module(), small_data()
    t = trainer(tmp_path, max_steps=6, val_check_interval=6, log_every_n_steps=3)
    t.fit(module, data)
    metrics = t.callback_metrics
    for key in ("train/loss", "train/lr", "train/tokens", "val/loss", "val/ppl"):
        assert key in metrics, key
    assert metrics["val/ppl"].item() == pytest.approx(math.exp(metrics["val/loss"].item()), rel=1e-5)
    assert metrics["train/tokens"].item() == 6 * 8 * 32
    summary = read_summary(tmp_path)  # the run directory's summary.json keeps the latest validation
    assert summary["val"]["step"] == 6
    assert summary["val"]["loss"] == pytest.approx(metrics["val/loss"].item(), rel=1e-6)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_host_reads_on_training_steps_that_do_not_log(tmp_path, monkeypatch, precision: str) -> None:
    # On a GPU, reading a device tensor waits for all queued work. The training step reads the loss only on the
    # Trainer's logging steps (global steps 4 and 9 here); on the others, the only reads are Lightning re-reading the
    # progress-bar value logged last, which the module logs as a CPU tensor. As `lnstab fit` runs: LNStabTrainer
    # (its step progress bar), Throughput, clipping, and the AdamW each precision uses (fused under 32-true, foreach
    # under bf16-mixed with clipping), both precisions explicitly whatever `auto` would pick on this machine.
    from lightning.pytorch.loggers import CSVLogger

    from lnstab.callbacks import Throughput
    from lnstab.trainer import LNStabTrainer

    reads = StepOfRead(monkeypatch)
    t = LNStabTrainer(accelerator="cpu", precision=precision, max_steps=10, log_every_n_steps=5, gradient_clip_val=1.0,
                      logger=CSVLogger(tmp_path), callbacks=[reads, Throughput()], limit_val_batches=0,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    module = small_module()
    t.fit(module, small_data())
    foreach = bool(t.optimizers[0].defaults.get("foreach"))
    assert foreach == (precision == "bf16-mixed")
    # foreach reads every parameter's counter every step; fused reads none
    assert (reads.step_counter_reads >= 10 * len(list(module.parameters()))) if foreach else \
        reads.step_counter_reads == 0
    logged = reads.reads[4] | reads.reads[9]
    for step in (0, 1, 2, 3):
        assert step not in reads.reads, step
    for step in (5, 6, 7, 8):
        assert reads.reads.get(step, set()) <= reads.reads[4], step  # stale values only, nothing new
    assert logged


def same_batch_loader() -> torch.utils.data.DataLoader:
    """Every batch identical, so this test checks model, optimizer and schedule state, not the data's position
    (the data modules' own tests check that)."""
    window = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(0))
    pairs = torch.utils.data.TensorDataset(window[:-1].repeat(64, 1), window[1:].repeat(64, 1))
    return torch.utils.data.DataLoader(pairs, batch_size=8)


def test_checkpoint_round_trip_and_exact_resume(tmp_path) -> None:
    # The interrupted run has the uninterrupted run's schedule: the decay horizon is fixed, not max_steps of each leg.
    pl.seed_everything(0)
    full = small_module(lr_decay_steps=12)
    trainer(tmp_path / "a", max_steps=12).fit(full, same_batch_loader())

    pl.seed_everything(0)
    first = small_module(lr_decay_steps=12)
    t = trainer(tmp_path / "b", max_steps=6)
    t.fit(first, same_batch_loader())
    ckpt = tmp_path / "half.ckpt"
    t.save_checkpoint(ckpt)

    loaded = GPTModule.load_from_checkpoint(ckpt)
    x = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), first(x), rtol=0, atol=0)
    assert loaded.config == first.config

    pl.seed_everything(0)
    resumed = small_module(lr_decay_steps=12)
    trainer(tmp_path / "c", max_steps=12).fit(resumed, same_batch_loader(), ckpt_path=ckpt)
    assert resumed.tokens_seen == full.tokens_seen == 12 * 8 * 32
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(learning_rate=-1.0), "learning_rate=-1.0"),
        (dict(min_lr=1.0, learning_rate=0.1), "min_lr=1.0"),
        (dict(betas=(0.9, 1.5)), "betas="),
        (dict(warmup_steps=-3), "warmup_steps=-3"),
        (dict(preset="gpt7"), "preset='gpt7'"),
    ],
)
def test_bad_hyperparameters_are_refused(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        small_module(**overrides)


def test_a_nan_batch_makes_the_validation_loss_nan_instead_of_being_averaged_away() -> None:
    module = small_module()
    for metric in (module.val_loss, module.test_loss):
        for value in (2.0, math.nan, 4.0):
            metric.update(torch.tensor(value), weight=10)
        assert math.isnan(metric.compute().item())  # torchmetrics' default would give 3.0 with a warning
        metric.reset()
        for value in (2.0, 4.0):
            metric.update(torch.tensor(value), weight=10)
        assert metric.compute().item() == pytest.approx(3.0)


def test_fsdp_clips_through_the_sharded_root_and_fused_adamw_where_clipping_allows(monkeypatch) -> None:
    # Lightning's FSDP precision plugin refuses norm clipping (torch.nn.utils.clip_grad_norm_ sees one shard only);
    # the module clips through FullyShardedDataParallel.clip_grad_norm_ of the wrapped root instead.
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    calls = []
    strategy = FSDPStrategy.__new__(FSDPStrategy)
    monkeypatch.setattr(FSDPStrategy, "model", property(lambda self: SimpleNamespace(clip_grad_norm_=calls.append)))
    module = small_module()
    module._trainer = SimpleNamespace(strategy=strategy)
    module.configure_gradient_clipping(None, 1.0, "norm")
    assert calls == [1.0]

    for precision, clip, expected in [("32-true", 1.0, "fused"), ("bf16-mixed", 1.0, "foreach"),
                                      ("bf16-mixed", None, "fused")]:
        t = pl.Trainer(accelerator="cpu", precision=precision, gradient_clip_val=clip, max_steps=10, logger=False)
        module = small_module()
        module.trainer = t
        optimizer = module.configure_optimizers()["optimizer"]
        assert optimizer.defaults[expected], (precision, clip)


@pytest.mark.parametrize("mode", ["coupled", "independent"])
def test_weight_decay_modes_against_a_hand_computed_adamw(mode: str) -> None:
    # two AdamW steps of the module's own optimizer and schedule (2 warm-up steps: s = 1/2, then 1) against the
    # update written out: theta <- theta - eta_t * Adam(g) - d_t * theta, with d_t = eta_t * lambda (coupled) or
    # s_t * lambda (independent: not scaled by the peak rate eta_max)
    eta_max, lam, b1, b2, eps = 0.01, 0.1, 0.9, 0.95, 1e-8
    module = small_module(learning_rate=eta_max, min_lr=0.0, warmup_steps=2, lr_decay_steps=100, weight_decay=lam,
                          weight_decay_mode=mode, betas=(b1, b2), eps=eps)
    opt_conf = module.configure_optimizers()
    optimizer, scheduler = opt_conf["optimizer"], opt_conf["lr_scheduler"]["scheduler"]
    weight, gain = module.model.transformer.h[0].mlp.c_fc.weight, module.model.transformer.h[0].ln_1.weight
    theta = {"w": weight.detach().clone().double(), "g": gain.detach().clone().double()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    v = {k: torch.zeros_like(t) for k, t in theta.items()}
    gen = torch.Generator().manual_seed(0)
    for t, s in ((1, 0.5), (2, 1.0)):
        grads = {p: torch.randn(p.shape, generator=gen) for p in module.parameters()}
        for p, g in grads.items():
            p.grad = g.clone()
        eta = s * eta_max
        assert optimizer.param_groups[0]["lr"] == pytest.approx(eta)
        for key, param, decays in (("w", weight, True), ("g", gain, False)):
            g = grads[param].double()
            m[key] = b1 * m[key] + (1 - b1) * g
            v[key] = b2 * v[key] + (1 - b2) * g * g
            adam = (m[key] / (1 - b1**t)) / ((v[key] / (1 - b2**t)).sqrt() + eps)
            decay = (s * lam if mode == "independent" else eta * lam) if decays else 0.0
            theta[key] = theta[key] * (1 - decay) - eta * adam
        optimizer.step()
        scheduler.step()
        torch.testing.assert_close(weight.detach().double(), theta["w"], rtol=0, atol=1e-6)
        torch.testing.assert_close(gain.detach().double(), theta["g"], rtol=0, atol=1e-6)
    if mode == "independent":
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(lam / eta_max)


def test_bad_weight_decay_mode_is_one_line() -> None:
    with pytest.raises(ConfigError, match="weight_decay_mode='decoupled'") as info:
        small_module(weight_decay_mode="decoupled")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="weight_decay_mode='independent' is not allowed with learning_rate=0"):
        small_module(weight_decay_mode="independent", learning_rate=0.0, min_lr=0.0)
