"""A block that one forward runs several times (weights shared across depth: a looped Transformer): with
``unroll_repeats`` each call is a layer of its own, its statistics those of that call alone; without it the calls are
pooled and a warning says so; a loop that later runs more or fewer times leaves those steps unmeasured; Theorem 4's
bound counts each call of a looped output norm, and is not checked (and the card says why) where the norms are not
one per update; the check's Jacobian probe and card see each call."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from check_factories import LoopedLM
from fsdp_cpu import CPUDDPSpawnStrategy
from lightning.pytorch.loggers import CSVLogger
from support.callbacks import VOCAB, LitLM, StepClock, loader, tokens, trainer
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, DistributedSampler

from lnstab.callbacks import GrowthBoundMonitor, HiddenStateStatistics, JacobianSensitivity, spectral_norm
from lnstab.callbacks._sites import find_sites
from lnstab.check.probes import _branch_call, measure_branches
from lnstab.cli import main

BLOCK = r"model\.block$"


class LoopLit(LitLM):
    """:class:`LoopedLM` (3 loops), whose loop count is ``loops_at[step]`` where given."""

    def __init__(self, loops_at: dict[int, int] | None = None, **kwargs) -> None:
        torch.manual_seed(0)
        super().__init__(LoopedLM(VOCAB, **kwargs))
        self.loops_at = loops_at or {}
        self.base = self.model.loops

    def training_step(self, batch, batch_idx):
        self.model.loops = self.loops_at.get(self.global_step, self.base)
        return super().training_step(batch, batch_idx)


class RankLoopLit(LoopLit):
    """:class:`LoopLit` whose loop count is ``plan[(step, rank)]`` where given; each rank takes half of a batch of 8."""

    def __init__(self, plan: dict[tuple[int, int], int]) -> None:
        super().__init__()
        self.plan = plan

    def training_step(self, batch, batch_idx):
        self.model.loops = self.plan.get((self.global_step, self.global_rank), self.base)
        return LitLM.training_step(self, batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(tokens(16), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(tokens(16), batch_size=8 // world, sampler=sampler)


def record_calls(module: torch.nn.Module, clock: StepClock) -> dict[int, list[torch.Tensor]]:
    """Every output of ``module`` in a training forward, by step, in call order."""
    calls: dict[int, list[torch.Tensor]] = {}

    def hook(mod, args, out) -> None:
        if torch.is_grad_enabled():  # the training step's forward, not the counting forward (no grad)
            calls.setdefault(clock.step, []).append(out.detach().clone())

    module.register_forward_hook(hook)
    return calls


def fit(tmp_path, lit: LitLM, callbacks: list, steps: int = 3) -> list[str]:
    """Train; the warnings raised, as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, callbacks, max_steps=steps).fit(lit, loader(12, batch_size=4))
    return [str(w.message) for w in caught]


def hidden(**kwargs) -> HiddenStateStatistics:
    return HiddenStateStatistics(every_n_steps=1, layer_pattern=BLOCK, embed_pattern=None, final_pattern=None,
                                 log_heatmap=False, series_file=None, **kwargs)


def test_unrolled_calls_are_layers_with_each_calls_statistics(tmp_path):
    lit, clock = LoopLit(), StepClock()
    calls = record_calls(lit.model.block, clock)
    hss = hidden(unroll_repeats=True)
    said = fit(tmp_path, lit, [clock, hss])
    assert hss.tags == ["L00", "L01", "L02"]
    assert hss.steps == [0, 1, 2]
    for k, step in enumerate(hss.steps):
        assert len(calls[step]) == 3
        for c, x in enumerate(calls[step]):
            tag = f"L{c:02d}"
            assert hss.values["mean_abs"][tag][k] == pytest.approx(x.abs().mean().item(), rel=1e-6)
            assert hss.values["max_abs"][tag][k] == pytest.approx(x.abs().max().item(), rel=1e-6)
            expected = x.flatten(1).var(dim=1, unbiased=False).mean().item()
            assert hss.values["var_entry"][tag][k] == pytest.approx(expected, rel=1e-5)
    assert not [m for m in said if "pools all its calls" in m]


def test_pooled_calls_are_said_once_and_pooled(tmp_path):
    lit, clock = LoopLit(), StepClock()
    calls = record_calls(lit.model.block, clock)
    hss = hidden()
    said = fit(tmp_path, lit, [clock, hss])
    assert hss.tags == ["L00"]
    pooled = [m for m in said if "pools all its calls" in m]
    assert len(pooled) == 1
    assert "'model.block' (3 calls)" in pooled[0] and "unroll_repeats=True" in pooled[0]
    for k, step in enumerate(hss.steps):  # three calls of equal size: the pooled mean is the mean of the means
        means = [x.abs().mean().item() for x in calls[step]]
        assert hss.values["mean_abs"]["L00"][k] == pytest.approx(sum(means) / 3, rel=1e-6)
        assert hss.values["max_abs"]["L00"][k] == pytest.approx(max(x.abs().max().item() for x in calls[step]))


def test_a_loop_that_runs_more_or_fewer_times_leaves_the_step_unmeasured(tmp_path):
    hss = hidden(unroll_repeats=True)
    said = fit(tmp_path, LoopLit(loops_at={1: 4, 2: 2}), [hss], steps=4)
    assert hss.tags == ["L00", "L01", "L02"]
    assert hss.steps == [0, 3]
    told = [m for m in said if "was not measured" in m]
    assert len(told) == 1 and "step 1" in told[0] and "ran more often than when its calls were counted" in told[0]
    assert all(len(v) == 2 for v in hss.values["mean_abs"].values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_a_loop_that_runs_longer_on_one_rank_is_unmeasured_on_both(tmp_path):
    torch.set_num_threads(1)
    hss = HiddenStateStatistics(every_n_steps=1, layer_pattern=BLOCK, embed_pattern=None, final_pattern=None,
                                log_heatmap=False, unroll_repeats=True)
    t = trainer(tmp_path, [hss], max_steps=4, devices=2, strategy=CPUDDPSpawnStrategy(),
                use_distributed_sampler=False, logger=CSVLogger(tmp_path, name="ddp", version=0))
    t.fit(RankLoopLit({(1, 1): 4}))  # rank 1 loops once more at step 1: its extra call has no site
    series = json.loads((tmp_path / "ddp" / "version_0" / "hidden_stats.json").read_text())
    assert series["tags"] == ["L00", "L01", "L02"] and series["steps"] == [0, 2, 3]


def test_theorem4_bound_is_not_checked_when_output_norms_repeat(tmp_path):
    # One Peri-style update x + LN(f(x)) looped 8 times: the bound's sum would count one update where the stream
    # takes 8, and its X_0 (the block's input) and X_D (its output) would each pool all 8 calls: a bound of nothing,
    # which before this guard "held" (0 violations, slack 0.8) for the wrong reasons.
    lit = LoopLit(peri=True, loops=8)
    bound = GrowthBoundMonitor(every_n_steps=1, layer_pattern=BLOCK, norm_pattern=r"model\.block\.ln_out$",
                               embed_pattern=None, final_pattern=None)
    said = fit(tmp_path, lit, [bound], steps=2)
    assert len([m for m in said if "Theorem 4's bound is not checked" in m]) == 1
    assert bound.violations == 0 and bound.norms == []
    assert not any(k.startswith("bound/") for k in bound.last) and "growth/exp_rate" in bound.last


def test_theorem4_bound_counts_each_call_of_a_looped_output_norm(tmp_path):
    # The same looped update, unrolled: X_0 is the first call's input, X_D the last call's output, and the sum S
    # counts the output norm once per call (8 updates of at most γmax + βmax = 1 at initialisation).
    lit, clock = LoopLit(peri=True, loops=8), StepClock()
    inputs: list[torch.Tensor] = []
    lit.model.block.register_forward_pre_hook(
        lambda m, a: inputs.append(a[0].detach().clone()) if torch.is_grad_enabled() else None)
    outputs = record_calls(lit.model.block, clock)
    bound = GrowthBoundMonitor(every_n_steps=1, layer_pattern=BLOCK, norm_pattern=r"model\.block\.ln_out$",
                               embed_pattern=None, final_pattern=None, unroll_repeats=True)
    said = fit(tmp_path, lit, [clock, bound], steps=1)
    assert not [m for m in said if "not checked" in m or "pools all its calls" in m]
    assert [s.tag for s in bound.sites] == ["embed"] + [f"L{c:02d}" for c in range(8)] and bound.norm_calls == [8]
    x0, xd = inputs[0], outputs[0][-1]  # (B, T, C) at step 0
    rms0 = x0.square().mean(dim=(1, 2)).sqrt().double()  # per sequence
    assert bound.last["bound/ma_bound"] == pytest.approx((rms0 + 8.0).mean().item(), rel=1e-6)
    assert bound.last["bound/ma_final"] == pytest.approx(xd.abs().mean(dim=(1, 2)).double().mean().item(), rel=1e-6)
    assert bound.violations == 0
    # with the norm counted once, as before, the variance bound (RMS(X_0) + 1)² would be "violated"
    assert bound.last["bound/var_final"] > ((rms0 + 1.0).square()).mean().item()


def test_branch_probe_measures_every_call_at_its_own_input():
    torch.manual_seed(0)
    model = LoopedLM(VOCAB)
    probe = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    blocks = find_sites(model, re.compile(r"block$"))
    got = measure_branches(model, blocks, probe, n_iter=6)
    assert sorted(got) == sorted(f"jacobian/{m}/L{c:02d}" for m in ("sensitivity", "act_scale") for c in range(3))
    inputs = []
    handle = model.block.register_forward_pre_hook(lambda m, a, kw: inputs.append((a, kw)), with_kwargs=True)
    model.eval()
    with torch.no_grad():
        model(probe)
    handle.remove()
    assert len(inputs) == 3
    for c, (args, kwargs) in enumerate(inputs):
        x = args[0]
        with sdpa_kernel(SDPBackend.MATH):  # torch.func's jvp/vjp, as the probe's fallback computes it
            reference = spectral_norm(_branch_call(model.block, args, kwargs), x, 6, 0).item()
        assert got[f"jacobian/sensitivity/L{c:02d}"] == pytest.approx(reference, rel=1e-4)
        assert got[f"jacobian/act_scale/L{c:02d}"] == pytest.approx(x.abs().mean().item(), rel=1e-6)
    assert len({round(got[f"jacobian/act_scale/L{c:02d}"], 6) for c in range(3)}) == 3  # three depths, not one
    full = JacobianSensitivity(probe=probe, n_iter=6, layer_pattern=r"block$")  # the callback's own probe, as well
    lit = LitLM(model)
    full.blocks = find_sites(lit, re.compile(r"block$"))
    measured = full.measure(lit)
    assert {k.rsplit("/", 1)[1] for k in measured} == {"L00", "L01", "L02"}  # before: L00 only, the first call
    for c in range(3):
        for metric in ("sensitivity", "act_scale"):
            key = f"jacobian/{metric}/L{c:02d}"
            assert measured[key] == pytest.approx(got[key], rel=1e-4)


TINY = ["--no-reference", "--steps", "6", "--measure-every", "3", "--batch-size", "4", "--seq-len", "16", "--seeds",
        "0", "--lrs", "1e-3", "--workers", "1", "--threads", "1", "--no-progress", "--data.source", "synthetic"]


def test_check_card_of_a_looped_factory_measures_each_call(tmp_path):
    args = ["check", "--factory", "check_factories:looped_lm", "--layer-pattern", "block$", *TINY,
            "--out", str(tmp_path / "card")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            main(args)
        except SystemExit as exc:
            assert exc.code in (0, 1)  # a verdict, not a failed check
    report = json.loads((tmp_path / "card" / "report.json").read_text())
    assert report["model"]["repeated"] == {"model.block": 3}
    assert report["model"]["shape"]["n_layer"] == 3  # the depth the loop gives (references would be built so)
    rows = {r["id"]: r for r in report["criteria"]}
    assert rows["growth_init"]["status"] != "n/a" and rows["growth_trained"]["status"] != "n/a"
    markdown = (tmp_path / "card" / "report.md").read_text()
    assert "`model.block` runs 3 times in one forward" in markdown
    run = report["runs"][0]
    tags = json.loads((tmp_path / "card" / run["log_dir"] / "hidden_stats.json").read_text())["tags"]
    assert [t for t in tags if t.startswith("L")] == ["L00", "L01", "L02"]


def test_check_grades_theorem4_on_a_looped_peri_factory(tmp_path):
    out = tmp_path / "card"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            main(["check", "--factory", "check_factories:looped_peri_lm", "--layer-pattern", "block$",
                  "--norm-pattern", r"block\.ln_out$", *TINY, "--out", str(out)])
        except SystemExit as exc:
            assert exc.code in (0, 1)
    bound = {r["id"]: r for r in json.loads((out / "report.json").read_text())["criteria"]}["bound"]
    assert bound["status"] == "pass" and bound["measured"] == 0  # before: n/a, "not one per residual update"


def test_check_says_why_located_output_norms_are_not_checked(tmp_path):
    # nn.TransformerEncoderLayer has two norms per block, the layer pattern one site per block: 4 norms, 2 sites
    out = tmp_path / "card"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            main(["check", "--factory", "check_factories:encoder_lm", "--layer-pattern", r"layers\.(\d+)$",
                  "--norm-pattern", r"layers\.\d+\.norm[12]$", *TINY, "--out", str(out)])
        except SystemExit as exc:
            assert exc.code in (0, 1)
    bound = {r["id"]: r for r in json.loads((out / "report.json").read_text())["criteria"]}["bound"]
    assert bound["status"] == "n/a"
    assert bound["why"].startswith("output norms were located but not checked: 4 output-norm updates for 2 layer "
                                   "sites")  # before: "no output norms matched …", which they had
