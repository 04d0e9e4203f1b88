"""Theorem 4's growth bound for Peri-LN, checked live, and the growth law of the mean |x| over depth."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lnstab import validation as require
from lnstab.layers import NORM_MODULES
from lnstab.measures import growth_law, layer_depths

from ._sites import (
    EMBED_PATTERN,
    FINAL_PATTERN,
    OUTPUT_NORMS,
    Site,
    auto_sites,
    clean_name,
    no_sites,
    resolve_types,
)
from ._strategy import abs_max, all_reduce_, reduce_over_shards_, require_strategy
from ._tap_callback import TapCallback

_SIBLING = {"ln_1_out": "resid_attn", "ln_2_out": "resid_mlp"}
_GATE = {"ln_1_out": "gate_attn", "ln_2_out": "gate_mlp"}


class GrowthBoundMonitor(TapCallback):
    """Checks Theorem 4's bound on the final mean |x| of Peri-LN models; fits the growth law of MA over depth.

    **Bound.** When every residual update is ``x ← x + Δt·N(y)`` with an output norm ``N`` (LayerNorm or RMSNorm,
    weight γ, bias β) the normalised vector of each token has RMS ≤ 1, so each update adds at most
    ``Δt·(γmax + βmax)·√d`` to a token's Euclidean norm (γmax = max |γ|, βmax = max |β|, 0 without bias). A DyT
    output norm (``γ·tanh(αx) + β``, :class:`lnstab.layers.DyT`) obeys the same: ``|γ·tanh(αx) + β| ≤ |γ| + |β|``
    entry-wise, whatever α. A residual gate ``g`` (ReZero's scalar, LayerScale's ``diag(λ)``) multiplies the
    normalised update, ``x ← x + Δt·g ⊙ N(y)``, so it scales that increment by at most ``gmax = max |g|`` (1 without
    a gate). With ``S = Σ_updates Δt·gmax·(γmax + βmax)`` over the 2D output norms and, per sequence of n tokens of
    width d, ``RMS(X) = ‖X‖_F/√(nd)`` and ``MA(X) = mean |x|``:

    * MA bound (Theorem 4): ``MA(X_D) ≤ RMS(X_D) ≤ RMS(X_0) + S``;
    * variance bound: ``Var_entry(X_D) ≤ mean(X_D²) = RMS(X_D)² ≤ (RMS(X_0) + S)²``.

    Both are evaluated for every sequence of the optimizer step's batch (the per-sequence values of all its
    micro-batches are pooled; the γ, β are those of the step's forward, read before its update); a sequence above a
    bound by more than a relative 1e-5 adds one to the cumulative ``bound/violations`` (must stay 0). X_D is the
    final-norm input. The output norms and their Δt come from the model's ``output_norms()`` (lnstab's GPT: empty
    unless its placement normalises every update, see :data:`lnstab.model.PLACEMENTS`); models without that method
    are searched with ``norm_pattern``, Δt read from each norm's sibling ``resid_attn``/``resid_mlp`` ``.scale``.
    The gates come from the model's ``residual_gates()`` (aligned with ``output_norms()``), else from each norm's
    sibling ``gate_attn``/``gate_mlp`` (its ``weight``), else none. ``residual_scale`` overrides Δt. Models without
    output norms get no bound metrics, only the growth law. Under FSDP γmax, βmax, gmax are maxima over the shards
    (exact).

    **Growth law.** ``y_k`` = MA after the k-th site (X_0 at depth 0, half-step k at depth k/2 layers) averaged
    over the batch; least-squares fits ``y = a + b·depth`` and ``log y = a + r·depth`` give the per-layer slope
    ``b``, the per-layer log-growth rate ``r`` (factor ``e^r`` per layer) and their R².

    Args:
        every_n_steps: Evaluate once on optimizer steps ``0, N, 2N, …`` (hooks are no-ops on other steps).
        residual_scale: Δt for every update; ``None`` takes the model's (``output_norms()`` or ``Residual.scale``).
        norm_pattern: Regex of the output norms, one per residual update, for models without ``output_norms()``
            (torch's ``LayerNorm`` or ``RMSNorm``, lnstab's ``DyT``: matches of another class are said in a warning
            and the bound is not checked).
        layer_pattern, module_types, embed_pattern, final_pattern: Sites, as in :class:`HiddenStateStatistics`.
        tolerance: Relative slack allowed before a violation is counted (float rounding).
        unroll_repeats: A layer module that one forward runs several times (a looped block) is a layer per call,
            as in :class:`HiddenStateStatistics`, and each output norm's term of ``S`` counts its calls (an update
            per call); X_0 is then the first call's input. ``False``: the bound is not checked where a watched
            module repeats (its calls pooled, said in a warning).
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics**:
        ``bound/ma_bound``, ``bound/ma_final``, ``bound/slack`` (min over sequences of bound − MA),
        ``bound/var_bound``, ``bound/var_final``, ``bound/var_slack``, ``bound/violations``;
        ``growth/linear_slope``, ``growth/linear_r2``, ``growth/exp_rate``, ``growth/exp_r2``.

    Raises:
        ConfigError: A bad argument, or a strategy it cannot serve (one line naming it; a ``ValueError``).

    Example::

        trainer = Trainer(callbacks=[GrowthBoundMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        residual_scale: float | None = None,
        norm_pattern: str = OUTPUT_NORMS,
        layer_pattern: str | None = None,
        module_types: Any = None,
        embed_pattern: str = EMBED_PATTERN,
        final_pattern: str | None = FINAL_PATTERN,
        tolerance: float = 1e-5,
        unroll_repeats: bool = False,
        metric_prefix: str | None = None,
    ) -> None:
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.residual_scale = require.optional_number("residual_scale", residual_scale, 0, low_open=True)
        self.norm_pattern = require.regex("norm_pattern", norm_pattern, optional=False)
        self.layer_pattern = require.regex("layer_pattern", layer_pattern)
        self.module_types = resolve_types("module_types", module_types)
        self.embed_pattern = require.regex("embed_pattern", embed_pattern)  # None: X_0 is the first layer's input
        self.final_pattern = require.regex("final_pattern", final_pattern)
        self.tolerance = require.number("tolerance", tolerance, 0, 1, high_open=True)
        self.unroll_repeats = require.flag("unroll_repeats", unroll_repeats)
        self._unrolled = False
        self.norm_calls: list[int] = []  # per output norm: its calls in one forward (its updates)
        self._base_sites: list[Site] = []
        self.unchecked: str | None = None  # why located output norms do not get the bound checked
        self.violations = 0
        self.last: dict[str, float] = {}
        self.sites: list[Site] = []
        self.norms: list[tuple[nn.Module, float]] = []
        self.gates: list[nn.Module | None] = []  # the gate of each update in self.norms (None: gain 1)
        self.depths: list[float] = []
        self._step: int | None = None
        self._gsum: torch.Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        extra = {"unroll_repeats": "True"} if self.unroll_repeats else {}  # older checkpoints keep their key
        return self._generate_state_key(every_n_steps=self.every_n_steps, norm_pattern=self.norm_pattern.pattern,
                                        **extra)

    def layout_sources(self, root: nn.Module) -> set[str]:
        """The dashboard charts this monitor fills on ``root`` (:func:`lnstab.callbacks.layout.layout_sources`): the
        growth fits always, Theorem 4's bound only where it finds output norms (a Pre-LN model has none)."""
        try:
            found = bool(self.find_norms(root))
        except Exception:  # a model it cannot read: its own setup says why
            found = True
        return {cls.__name__ for cls in type(self).__mro__} | ({"GrowthBoundMonitor:norms"} if found else set())

    def find_norms(self, root: nn.Module) -> list[tuple[nn.Module, float]]:
        """``(norm, Δt)`` per residual update: the model's ``output_norms()``, else the modules ``norm_pattern``
        matches."""
        return [(m, dt) for m, dt, _ in self._find_updates(root)]

    def _find_updates(self, root: nn.Module) -> list[tuple[nn.Module, float, nn.Module | None]]:
        """``(norm, Δt, gate)`` per residual update (``gate`` ``None`` where no gate has a ``weight``)."""
        module = self._norms_owner(root)
        if module is not None:
            norms = list(module.output_norms())
            gates = list(module.residual_gates()) if callable(getattr(module, "residual_gates", None)) else []
            gates = gates if len(gates) == len(norms) else [None] * len(norms)
            updates = [(m, dt, g) for (m, dt), g in zip(norms, gates, strict=True)]
        else:
            named = {clean_name(n): m for n, m in root.named_modules()}
            updates = [
                (m, self._sibling_scale(named, name), self._sibling_gate(named, name))
                for name, m in named.items()
                if self.norm_pattern.search(name) and isinstance(m, NORM_MODULES)
            ]
        if self.residual_scale is not None:
            updates = [(m, float(self.residual_scale), g) for m, _, g in updates]
        return [(m, dt, g if isinstance(getattr(g, "weight", None), torch.Tensor) else None) for m, dt, g in updates]

    @staticmethod
    def _norms_owner(root: nn.Module) -> nn.Module | None:
        """The first module of ``root`` with ``output_norms()`` (lnstab's GPT, the check's Hugging Face wrapper), whose
        list is read instead of ``norm_pattern``'s matches; ``None`` where none has it."""
        return next((m for m in root.modules() if callable(getattr(m, "output_norms", None))), None)

    def _unboundable(self, root: nn.Module) -> list[nn.Module]:
        """The modules ``norm_pattern`` matches that :meth:`_find_updates` leaves out for their class (neither a norm
        it can bound nor ``nn.Identity``, the placeholder of an absent norm); none for a model with
        ``output_norms()``."""
        if self._norms_owner(root) is not None:
            return []
        return [m for name, m in ((clean_name(n), m) for n, m in root.named_modules())
                if self.norm_pattern.search(name) and not isinstance(m, (*NORM_MODULES, nn.Identity))]

    @staticmethod
    def _sibling_scale(named: dict[str, nn.Module], name: str) -> float:
        parent, _, leaf = name.rpartition(".")
        sibling = named.get(f"{parent}.{_SIBLING[leaf]}") if leaf in _SIBLING and parent else None
        return float(getattr(sibling, "scale", 1.0))

    @staticmethod
    def _sibling_gate(named: dict[str, nn.Module], name: str) -> nn.Module | None:
        parent, _, leaf = name.rpartition(".")
        return named.get(f"{parent}.{_GATE[leaf]}") if leaf in _GATE and parent else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_strategy(trainer, type(self).__name__, reads_parameters=True)
        self._base_sites = auto_sites(
            pl_module, self.layer_pattern, self.module_types, self.embed_pattern, self.final_pattern
        )
        self._unrolled = False
        self._layout(pl_module, list(self._base_sites))

    def _layout(self, pl_module: nn.Module, sites: list[Site], norm_calls: dict[int, int] | None = None) -> None:
        """Sites, depths and output norms from ``sites`` (unrolled or not; ``norm_calls``: calls per norm module
        by ``id``, each call an update), then subscribe."""
        self.sites = sites
        layers = [s for s in self.sites if s.tag.startswith("L")]
        if not layers:
            rank_zero_warn(no_sites(type(self).__name__, self.layer_pattern, self.module_types))
            self.sites = []
        elif self.sites[0].tag != "embed":  # X_0 = the input of the first layer (of its first call)
            self.sites.insert(0, Site("embed", layers[0].name, layers[0].module, use_input=True, call=layers[0].call))
        self.depths = [0.0, *layer_depths([s.tag for s in layers]).values()]  # one per site: tags are unique
        updates = self._find_updates(pl_module)
        self.norms, self.gates = [(m, dt) for m, dt, _ in updates], [g for _, _, g in updates]
        self.norm_calls = [(norm_calls or {}).get(id(m), 1) for m, _ in self.norms]
        self.unchecked = None
        if not self.norms and (unbounded := self._unboundable(pl_module)):
            classes = ", ".join(dict.fromkeys(type(m).__name__ for m in unbounded))
            self.unchecked = (f"norm_pattern={self.norm_pattern.pattern!r} matches {len(unbounded)} modules of a class "
                              f"whose output it cannot bound ({classes}): it knows torch's LayerNorm and RMSNorm and "
                              "lnstab's DyT, whose outputs their weight and bias bound")
            rank_zero_warn(f"{type(self).__name__}: Theorem 4's bound is not checked: {self.unchecked}")
        if self.norms and sum(self.norm_calls) != len(layers):
            self.unchecked = (f"{sum(self.norm_calls)} output-norm updates for {len(layers)} layer sites, where it "
                              "needs one output norm per residual update")
            rank_zero_warn(f"{type(self).__name__}: Theorem 4's bound is not checked: {self.unchecked}")
            self.norms, self.gates, self.norm_calls = [], [], []
        last = len(self.sites) - 1
        stats = [
            (("mean_abs",) if s.tag != "final" else ())
            + (("seq_rms_var",) if i in (0, last) else ())
            + (("seq_mean_abs",) if i == last else ())
            for i, s in enumerate(self.sites)
        ]
        self.subscribe(pl_module, self.sites, stats)

    def growth_sum(self, trainer: Any = None) -> torch.Tensor | float:
        """``S = Σ Δt·gmax·(γmax + βmax)`` over the output norms from the live parameters, as a device tensor (no
        host sync); γmax is 1 for a norm without weight, βmax 0 without bias, gmax 1 without a gate; maxima over
        shards under FSDP."""
        if not self.norms:
            return 0.0
        weights = [getattr(m, "weight", None) for m, _ in self.norms]
        gates = [getattr(g, "weight", None) for g in self.gates] if self.gates else [None] * len(weights)
        device = next((w.device for w in weights if w is not None), torch.device("cpu"))
        maxes = abs_max(weights + [getattr(m, "bias", None) for m, _ in self.norms] + gates, device)
        reduce_over_shards_(maxes, "max", trainer)  # one collective for every norm and gate
        n = len(self.norms)
        no_weight = torch.tensor([w is None for w in weights], device=device)
        no_gate = torch.tensor([g is None for g in gates], device=device)
        gamma = maxes[:n].masked_fill(no_weight, 1.0)
        gain = maxes[2 * n :].masked_fill(no_gate, 1.0)
        dts = torch.tensor([dt * c for (_, dt), c in zip(self.norms, self.norm_calls or [1] * n, strict=True)],
                           device=device, dtype=maxes.dtype)  # a norm a looped block runs c times: c updates
        return (dts * gain * (gamma + maxes[n : 2 * n])).sum()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)  # unrolls first, where asked
        sub = self.subscription
        if sub is None or not self.sites or not self.step_begins(trainer):
            return
        if trainer.global_step % self.every_n_steps == 0:
            sub.reset()
            self._step = trainer.global_step
            self._gsum = self.growth_sum(trainer) if self.norms else None  # the γ, β of this step's forwards
            sub.active = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        sub = self.subscription
        if sub is None or not sub.active or not self.step_ended(trainer):
            return
        sub.active = False
        self.repeats_pooled()
        if self.norms and sub.repeats:  # a looped block: the sum over updates would count each output norm once
            self.unchecked = (f"a watched module ran more than once in one micro-batch, so {len(self.norms)} output "
                              "norms are not one per residual update (unroll_repeats=True counts each call)")
            rank_zero_warn(f"{type(self).__name__}: Theorem 4's bound is not checked: {self.unchecked}")
            self.norms, self.gates = [], []
        if self.captured_everywhere(trainer):
            self.evaluate(trainer, self._step)
        else:
            self.unmeasured(self._step)
        sub.reset()

    @override
    def unroll(self, pl_module: nn.Module, batch: Any) -> None:
        """Count the calls of the layer sites and of the output norms in one forward; lay the sites out per call."""
        norms = [m for m, _, _ in self._find_updates(pl_module)]
        unrolled = self.unroll_sites(pl_module, batch, self._base_sites, count=norms)
        if unrolled is not None:
            self._layout(pl_module, *unrolled)

    def evaluate(self, trainer: Any, step: int) -> dict[str, float]:
        """Bound and growth law from what the tap pooled since the step began; logged at ``step`` and returned."""
        sub = self.subscription
        last = len(self.sites) - 1
        layer_ids = [i for i, s in enumerate(self.sites) if s.tag != "final"]
        ma = sub.reduce(trainer, ["mean_abs"])["mean_abs"][layer_ids]  # (sites,) over every rank
        x0 = sub.local("seq_rms_var", [0])[0]  # (2, B_step) RMS, variance of X_0 per sequence
        xd_ma = sub.local("seq_mean_abs", [last])[0][0]  # (B_step,)
        xd_var = sub.local("seq_rms_var", [last])[0][1]
        values = ma.tolist() if not self.norms else None
        if self.norms:
            gsum = self._gsum if self._gsum is not None else self.growth_sum(trainer)
            bound = x0[0].double() + gsum  # (B,) RMS(X_0) + S
            ma_d, var_d = xd_ma.double(), xd_var.double()
            tol = self.tolerance
            violations = (ma_d > bound * (1 + tol)).sum() + (var_d > bound.square() * (1 + tol)).sum()
            count = torch.full((), float(bound.numel()), device=bound.device, dtype=torch.float64)
            sums = torch.stack([count, bound.sum(), ma_d.sum(), bound.square().sum(), var_d.sum(), violations.double()])
            neg_slack = torch.stack([(ma_d - bound).max(), (var_d - bound.square()).max()])
            all_reduce_(sums, "sum", trainer)
            all_reduce_(neg_slack, "max", trainer)
            values = torch.cat([ma.to(sums.device), sums, neg_slack]).tolist()  # one host sync
        n_depth = len(layer_ids)
        ma_values = values[:n_depth]
        metrics: dict[str, float] = {}
        if self.norms:
            count, ma_bound, ma_final, var_bound, var_final, viol = values[n_depth : n_depth + 6]
            self.violations += int(viol)
            metrics.update(
                {
                    "bound/ma_bound": ma_bound / count,
                    "bound/ma_final": ma_final / count,
                    "bound/slack": -values[-2],
                    "bound/var_bound": var_bound / count,
                    "bound/var_final": var_final / count,
                    "bound/var_slack": -values[-1],
                    "bound/violations": float(self.violations),
                }
            )
        depth = [self.depths[k] for k in range(n_depth)]
        fit = growth_law(depth, ma_values, complete=True)  # a site without a finite MA leaves the law undefined
        metrics.update({"growth/linear_slope": fit["lin_slope"], "growth/linear_r2": fit["lin_r2"],
                        "growth/exp_rate": fit["exp_rate"], "growth/exp_r2": fit["exp_r2"]})
        self.last = metrics
        self.log_step(trainer, metrics, step)
        return metrics

    @override
    def fresh_state(self) -> dict[str, Any]:
        return {"violations": 0}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"violations": self.violations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.violations = int(state_dict["violations"])
