"""Detects divergence on the step it happens (non-finite values, loss spikes, exploding gradients, overflow risk)."""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lnstab import validation as require
from lnstab.errors import ConfigError
from lnstab.rundir import EVENTS_FILE, atomic_write_text, json_safe, run_dir, update_summary, writes_files

from ._captures import HEAD_PATTERN, qk_arguments
from ._sites import Site, auto_sites, no_sites
from ._stat_checks import StatChecks
from ._strategy import all_reduce_, count_nonfinite, distributed, params_sharded, require_strategy
from ._tap_callback import TapCallback
from .divergence_kinds import FATAL, KINDS, POLICIES

SPIKE_MIN_LOSSES = 10  # finite losses known before a loss spike is judged (so the least window)


class NonFiniteCheckpointError(RuntimeError):
    """Raised instead of saving a checkpoint whose weights are not finite."""


class DivergenceMonitor(TapCallback):
    """Records divergence events on the step they happen and stops, skips the update, or continues.

    Each checked optimizer step (every ``every_n_steps``) the monitor keeps on the device, over *every* micro-batch
    of the step, the loss (``on_before_backward``; their sum is the step's mean loss, and a NaN or inf in any
    micro-batch stays in it) and the NaN-propagating max |x| of every watched site (the model's shared tap); in
    ``on_before_optimizer_step``, once the last micro-batch has run, it adds the total gradient norm (squared norms
    of the shards summed over ranks under FSDP) and the finiteness of the weights the step started from (the
    previous update's result), and decides *before* the optimizer step, so a bad update can be dropped. That is one
    collective (several ranks) and one host sync per checked step; the weights after the last update are checked
    once more at the end of training. A step with no loss (its ``training_step`` returned ``None``, so Lightning ran
    no backward) gets no loss checks, the others as ever. Under a GradScaler (``precision="16-mixed"``) the loss is
    read unscaled, and a non-finite gradient is no event: it is the scaler's overflow, an update the scaler skips
    before it lowers its scale. Events (``step``, ``kind``, ``value``, ``layer``):

    * ``nonfinite_loss`` / ``nonfinite_grad`` / ``nonfinite_activation`` (``layer`` = the first site in depth order
      whose output was not finite in some micro-batch) / ``nonfinite_param`` (weights after the step's update);
    * ``grad_explosion``: total gradient norm > ``grad_norm_threshold``;
    * ``loss_explosion``: loss > ``loss_explosion_factor`` × the first finite loss the monitor checked (the run's
      first step; kept across a resume): a loss that blew up without overflowing, which fp32 can hold to ~1e38;
    * ``loss_spike``: loss > mean + ``spike_k``·std of the last ``window`` finite losses (≥ 10 of them);
    * ``activation_overflow``: some |x| > ``overflow_fraction``·finfo(dtype).max;
    * ``attention_collapse`` (``layer`` = the first layer in depth order, ``stat`` = which test): more than
      ``collapse_fraction`` of a layer's attention rows put over 0.99 of their weight on one key (``stat:
      collapsed``), or its largest |q·k|/√d_h exceeds ``attention_logit_threshold`` (``stat: max_logit``);
    * ``logit_drift`` (``layer`` = ``output``): |mean over tokens of log Z| > ``log_z_threshold``, log Z the
      logsumexp of a token's output logits;
    * ``remote``: another rank decided to act while this one saw nothing.

    The attention and output-logit checks run only every ``stats_every_n_steps`` optimizer steps (``0``, the default:
    never), on lnstab's GPT and Hugging Face GPT-2, Llama, Gemma, Mistral, Mixtral, Qwen2/3, Gemma 2/3, OLMo and OLMo 2,
    or on any model whose q and k projections and output head are named by ``q_pattern``/``k_pattern``/``n_head`` and
    ``head_pattern`` (found as :class:`AttentionLogitStatistics` and :class:`OutputLogitStatistics` find them; on the
    same steps they share those instruments' hooks and views, so nothing is computed twice): their hooks are no-ops on
    other steps, and on those steps their values, reduced over ranks (a few more collectives and, with several ranks,
    one more host sync for their agreement that every site ran), join the step's one host sync. Both kinds are recorded,
    not acted on, unless named in ``fatal_kinds``.

    On a fatal event (``fatal_kinds``; every rank agrees: local verdicts are summed over ranks in that collective)
    the policy acts: ``stop`` drops that update (gradients set to ``None``, so the optimizer leaves the weights
    alone) and sets ``trainer.should_stop``; ``skip`` drops the update and goes on; ``continue`` only records. With
    manual optimisation the step is decided at the first optimizer step of a ``training_step``, and a dropped update
    is dropped for every optimizer stepped in that ``training_step``, not only the first.
    Because ``stop``/``skip`` never apply a non-finite update, the weights stay finite and a ``last`` checkpoint
    is a finite one. Should the weights become non-finite anyway (``continue``), the run stops whatever the policy
    (no later update can repair them); :class:`RunCheckpoint` then writes no further checkpoint, and a plain
    ``ModelCheckpoint`` is refused by ``on_save_checkpoint`` (:class:`NonFiniteCheckpointError`). Events go to
    ``divergence_events.jsonl`` in the run directory as they happen; the run's ``summary.json`` gets
    ``diverged_step`` (the first step the ``stop`` policy acted on or the weights became non-finite) and
    ``divergence_events``; :class:`RunStatus` turns that into ``status: diverged``. A diverged run says so in one
    line as the fit ends (the step, its event kinds, the events file), since Lightning is silent when a callback
    stops it. Under ``fast_dev_run`` it checks and acts as ever but writes no file.

    Args:
        policy: ``stop``, ``skip`` or ``continue``.
        every_n_steps: Check every N optimizer steps (1: every step).
        window: Losses kept for spike detection (at least 10: a spike is judged once 10 losses are known).
        spike_k: Standard deviations above the window mean that make a spike.
        grad_norm_threshold: Total gradient norm that counts as an explosion (``None``: off).
        loss_explosion_factor: Multiple (> 1) of the first checked loss that counts as an explosion (``None``: off;
            meant for a positive loss such as cross-entropy, whose first value is ~ln V when training from scratch).
        overflow_fraction: Fraction of the dtype's maximum that counts as an overflow risk.
        fatal_kinds: Event kinds the policy acts on, one or a list (names from the event list above).
        layer_pattern: Sites whose outputs are watched, as in :class:`HiddenStateStatistics` (``None``: lnstab's
            residual modules, else every block).
        track_activations: Watch activations (one max-reduction per site per step).
        stats_every_n_steps: Check attention collapse and logit drift every N optimizer steps (``0``: never).
        collapse_fraction: Fraction of a layer's attention rows that may be collapsed (``None``: no such test).
        attention_logit_threshold: Largest attention logit allowed (``None``: no such test). The default 1e3: a
            logit that stands out by that much makes its row one-hot in every float format (e^-1000 is 0).
        log_z_threshold: Largest |mean log Z| allowed (``None``: no test). The default 30 lies above log Z at
            initialisation (log V: 10.8 for GPT-2's vocabulary) for any vocabulary under e^30 ≈ 10^13 tokens.
        head_pattern: Regex of the output head whose output is the logits, for models other than lnstab's GPT (as
            in :class:`OutputLogitStatistics`; default: Hugging Face's ``lm_head``).
        q_pattern, k_pattern, n_head, scale: The q and k projections of a model whose attention is not recognised,
            as in :class:`AttentionLogitStatistics` (``None``: found automatically).
        metric_prefix: Log as ``<metric_prefix>/<name>`` (``None``: the names below; see ``_sites.LogsMetrics``).

    **Logged metrics**:
        ``divergence/events`` (cumulative count, at the first check of a fit, 0 for a fresh run, and at each step
        with an event, so ``EarlyStopping(monitor="divergence/events")`` finds it in a run that never diverges).

    Raises:
        ConfigError: A bad argument, or a strategy it cannot serve (one line naming it; a ``ValueError``).
        NonFiniteCheckpointError: On saving a checkpoint with non-finite weights.

    Example::

        trainer = Trainer(callbacks=[DivergenceMonitor(policy="stop", grad_norm_threshold=1e3)])
    """

    def __init__(
        self,
        policy: str = "stop",
        every_n_steps: int = 1,
        window: int = 50,
        spike_k: float = 6.0,
        grad_norm_threshold: float | None = None,
        loss_explosion_factor: float | None = None,
        overflow_fraction: float = 0.5,
        fatal_kinds: str | list[str] | tuple[str, ...] = FATAL,
        layer_pattern: str | None = None,
        track_activations: bool = True,
        stats_every_n_steps: int = 0,
        collapse_fraction: float | None = 0.5,
        attention_logit_threshold: float | None = 1000.0,
        log_z_threshold: float | None = 30.0,
        head_pattern: str = HEAD_PATTERN,
        q_pattern: str | None = None,
        k_pattern: str | None = None,
        n_head: int | None = None,
        scale: float | None = None,
        metric_prefix: str | None = None,
    ) -> None:
        self.policy = require.choice("policy", policy, POLICIES)
        self.every_n_steps = require.positive_int("every_n_steps", every_n_steps)
        self.metric_prefix = require.metric_prefix("metric_prefix", metric_prefix)
        self.window = require.integer("window", window, SPIKE_MIN_LOSSES)
        self.spike_k = require.number("spike_k", spike_k, 0, low_open=True)
        self.grad_norm_threshold = require.optional_number("grad_norm_threshold", grad_norm_threshold, 0, low_open=True)
        self.loss_explosion_factor = require.optional_number("loss_explosion_factor", loss_explosion_factor, 1,
                                                             low_open=True)
        self.overflow_fraction = require.number("overflow_fraction", overflow_fraction, 0, 1, low_open=True)
        kinds = [fatal_kinds] if isinstance(fatal_kinds, str) else fatal_kinds
        if not isinstance(kinds, list | tuple):
            require.choices("fatal_kinds", fatal_kinds, KINDS)  # raises: neither a kind nor a list of them
        self.fatal_kinds = tuple(require.choice("fatal_kinds", kind, KINDS) for kind in kinds)
        self.layer_pattern = require.regex("layer_pattern", layer_pattern)
        self.track_activations = require.flag("track_activations", track_activations)
        self.stats_every_n_steps = require.integer("stats_every_n_steps", stats_every_n_steps, 0)
        if collapse_fraction is not None:
            require.number("collapse_fraction", collapse_fraction, 0, 1, high_open=True)
        self.checks = StatChecks(
            collapse_fraction,
            require.optional_number("attention_logit_threshold", attention_logit_threshold, 0, low_open=True),
            require.optional_number("log_z_threshold", log_z_threshold, 0, low_open=True),
            require.regex("head_pattern", head_pattern, optional=False),
            qk_arguments(q_pattern, k_pattern, n_head, scale),
        )
        self._stats_step = False
        self.events: list[dict[str, Any]] = []
        self.losses: deque[float] = deque(maxlen=window)
        self.first_loss: float | None = None  # the reference of loss_explosion_factor
        self.diverged_step: int | None = None
        self.sites: list[Site] = []
        self._checking = False
        self._loss: torch.Tensor | None = None
        self._params_bad: torch.Tensor | None = None  # non-finite parameter count after the previous update
        self._checked_through = -1  # weights after this step's update have been checked
        self._acted = False
        self._dropping = False  # this training step's update was dropped: so is every later optimizer's in it
        self._params: list[torch.nn.Parameter] = []
        self._sharded = self._distributed = False
        self._scaler: Any = None  # the precision plugin's GradScaler (16-mixed), when it scales
        self._counted = False  # divergence/events was logged in this fit
        self._began = False  # this fit reached on_fit_start (a refusal before it leaves the run's summary alone)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._began = False
        require_strategy(trainer, type(self).__name__, reads_parameters=True)
        if any(isinstance(c, DivergenceMonitor) and c is not self for c in trainer.callbacks):
            raise ConfigError("callbacks with two DivergenceMonitors are not allowed; both would write the run's "
                              "divergence_events.jsonl and summary.json: give one the settings of both")
        if self.track_activations:
            self.sites = auto_sites(pl_module, self.layer_pattern, (), None, None)
            if not self.sites:
                rank_zero_warn(no_sites(type(self).__name__, self.layer_pattern, None, "activations are not checked"))
            self.subscribe(pl_module, self.sites, [("max_abs",)] * len(self.sites))
        self.checks.close()
        if self.stats_every_n_steps:
            self.checks.setup(pl_module, type(self).__name__)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._began = True  # after a resumed run's state is restored: its events are this monitor's now
        self._counted = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._params = list(pl_module.parameters())  # after the strategy and configure_model set the model up
        self._sharded, self._distributed = params_sharded(trainer), distributed(trainer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self.checks.close()
        self._params = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._dropping = False
        if not self.step_begins(trainer):
            return
        step = trainer.global_step
        self._stats_step = bool(self.stats_every_n_steps) and step % self.stats_every_n_steps == 0
        self._checking = step % self.every_n_steps == 0 or self._stats_step
        if not self._checking:
            return
        if self._stats_step:
            self.checks.start()
        self._loss = None
        self._params_bad = count_nonfinite(self._params) if step > self._checked_through + 1 else None
        if self.subscription is not None:
            self.subscription.reset()
            self.subscription.active = True

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        if self._checking:  # Lightning divides each micro-batch's loss by their number: the sum is the step's mean
            loss = loss.detach().float().reshape(())
            if self._scaler is not None:  # the loss a GradScaler scaled for its backward: unscaled on the device
                loss = loss / self._scaler.scale(torch.ones((), device=loss.device))
            self._loss = loss if self._loss is None else self._loss + loss

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._checking:
            if self._dropping:  # another optimizer stepped in the training step whose update was dropped (manual
                optimizer.zero_grad(set_to_none=True)  # optimisation): its gradients are the same bad batch's
                self._checked_through = trainer.global_step
            return
        self._checking = False
        if self.subscription is not None:
            self.subscription.active = False
        self.checks.stop()
        step = trainer.global_step
        device = pl_module.device
        zero = torch.zeros((), device=device, dtype=torch.float64)
        grads = [p.grad for p in self._params or pl_module.parameters() if p.grad is not None]
        grad_sq = torch.stack(torch._foreach_norm(grads)).double().square().sum() if grads else zero
        # No loss when no micro-batch of the step ran a backward: a training_step that returns None (Lightning's way
        # to skip a batch; it still steps the optimizer, which leaves parameters without gradients alone). Nothing
        # to judge then, not a non-finite loss: the loss checks are off for the step, the others run.
        known = self._loss is not None
        loss = self._loss.double() if known else zero
        maxes = [m if m is not None else zero for m in self._site_maxes()]
        site_max = torch.stack(maxes).to(device, torch.float64) if maxes else zero.new_zeros(0)
        params_bad = self._params_bad.to(device, torch.float64) if self._params_bad is not None else zero
        spike_at = self._spike_threshold() if known else math.inf
        explosion_at = self._explosion_threshold() if known else math.inf
        overflow_at = self.overflow_fraction * self._dtype_max()
        head = [loss, grad_sq, params_bad]
        if self._distributed:  # every rank must agree: sum this rank's verdicts (on the device) over ranks
            local = {
                "nonfinite_loss": ~loss.isfinite(),
                "nonfinite_activation": (~site_max.isfinite()).any(),
                "loss_spike": loss.isfinite() & (loss > spike_at),
                "loss_explosion": loss.isfinite() & (loss > explosion_at),
                "activation_overflow": (site_max.isfinite() & (site_max > overflow_at)).any(),
            }
            fatal = sum((v.double() for k, v in local.items() if k in self.fatal_kinds), zero)
            shared = torch.stack([fatal, grad_sq if self._sharded else zero, params_bad])
            all_reduce_(shared, "sum", trainer)  # the step's one collective: verdicts, sharded grad norm, weights
            head += list(shared.unbind())
        stats = self.checks.values(trainer, device) if self._stats_step else zero.new_zeros(0)
        values = torch.cat([torch.stack(head), site_max, stats]).tolist()  # the step's one host sync
        loss_v, grad_local, bad_all = values[:3]
        fatal_all, grad_shared, bad_all = values[3:6] if self._distributed else (0.0, 0.0, bad_all)
        start = 6 if self._distributed else 3
        site_v, stats_v = values[start : start + len(maxes)], values[start + len(maxes) :]
        grad_v = math.sqrt(grad_shared if self._sharded else grad_local)
        new: list[dict[str, Any]] = []
        if bad_all > 0 and step > 0:
            new.append(self._event(step - 1, "nonfinite_param", math.nan))
            self.diverged_step = step - 1 if self.diverged_step is None else self.diverged_step
        if not math.isfinite(loss_v):
            new.append(self._event(step, "nonfinite_loss", loss_v))
        bad_site = next((i for i, v in enumerate(site_v) if not math.isfinite(v)), None)
        if bad_site is not None:
            new.append(self._event(step, "nonfinite_activation", site_v[bad_site], self.sites[bad_site].tag))
        # Under a GradScaler a non-finite gradient is its overflow: it skips that update and lowers its scale
        overflow = self._scaler is not None and not math.isfinite(grad_v)
        if not math.isfinite(grad_v):
            if not overflow:
                new.append(self._event(step, "nonfinite_grad", grad_v))
        elif self.grad_norm_threshold is not None and grad_v > self.grad_norm_threshold:
            new.append(self._event(step, "grad_explosion", grad_v))
        hot = next((i for i, v in enumerate(site_v) if math.isfinite(v) and v > overflow_at), None)
        if hot is not None:
            new.append(self._event(step, "activation_overflow", site_v[hot], self.sites[hot].tag))
        if known and math.isfinite(loss_v):
            if loss_v > explosion_at:
                new.append(self._event(step, "loss_explosion", loss_v))
            if self.first_loss is None:
                self.first_loss = loss_v
            if loss_v > spike_at:
                new.append(self._event(step, "loss_spike", loss_v))
            self.losses.append(loss_v)
        for kind, value, layer, stat in self.checks.events(stats_v) if self._stats_step else ():
            new.append(self._event(step, kind, value, layer, stat))
        local_fatal = any(e["kind"] in self.fatal_kinds for e in new)
        act = local_fatal or fatal_all > 0
        if act and not local_fatal:
            new.append(self._event(step, "remote", math.nan))
        self._record(trainer, new, step)
        self._checked_through = step - 1
        self._acted = act and self.policy != "continue"
        if act and self.policy == "stop" and self.diverged_step is None:
            self.diverged_step = step
        if self._acted:  # drop the update: the optimizer skips parameters without gradients
            optimizer.zero_grad(set_to_none=True)
            self._checked_through = step  # the weights stay those just checked
            self._dropping = True
        # Non-finite weights end the run whatever the policy (no later update can repair them): those the previous
        # update left, or those this update will leave when it is applied with a non-finite gradient (the final check
        # in on_train_end then records them).
        applies_nonfinite = not self._acted and not math.isfinite(grad_v) and not overflow
        if (self._acted and self.policy == "stop") or bad_all > 0 or applies_nonfinite:
            trainer.should_stop = True

    def _site_maxes(self) -> list[torch.Tensor | None]:
        sub = self.subscription
        if sub is None:
            return []
        return [None if p is None else p["max_abs"] for p in sub.pooled]

    def _dtype_max(self) -> float:
        dtypes = [d for d in (self.subscription.dtypes if self.subscription else []) if d is not None]
        return min((torch.finfo(d).max for d in dtypes if d.is_floating_point), default=math.inf)

    def _explosion_threshold(self) -> float:
        """Losses above this are explosions: ``loss_explosion_factor`` × the first finite loss, once it is known
        and positive."""
        if self.loss_explosion_factor is None or self.first_loss is None or self.first_loss <= 0:
            return math.inf
        return self.loss_explosion_factor * self.first_loss

    def _spike_threshold(self) -> float:
        """Losses above this are spikes: window mean + ``spike_k``·std once 10 finite losses are known."""
        n = len(self.losses)
        if n < SPIKE_MIN_LOSSES:
            return math.inf
        mean = math.fsum(self.losses) / n
        return mean + self.spike_k * math.sqrt(math.fsum((v - mean) ** 2 for v in self.losses) / n)

    @staticmethod
    def params_finite(pl_module: pl.LightningModule, trainer: Any = None) -> bool:
        """Whether every parameter is finite (one fused norm, one host sync; shards summed over ranks under FSDP)."""
        bad = count_nonfinite(pl_module.parameters()).float().reshape(1)
        if params_sharded(trainer):
            all_reduce_(bad, "sum", trainer)
        return bad.item() == 0

    def _check_last_update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether the weights are finite now (one host sync); records ``nonfinite_param`` for the newest update
        unless a decision has already checked the weights it left."""
        finite = self.params_finite(pl_module, trainer)
        step = trainer.global_step - 1
        if step > self._checked_through:
            self._checked_through = step
            if not finite:
                self._record(trainer, [self._event(step, "nonfinite_param", math.nan)], step)
                if self.diverged_step is None:
                    self.diverged_step = step
        return finite

    def _event(self, step: int, kind: str, value: float, layer: str | None = None,
               stat: str | None = None) -> dict[str, Any]:
        event = {"step": step, "kind": kind, "value": float(value), "layer": layer}
        return {**event, "stat": stat} if stat is not None else event

    def _record(self, trainer: pl.Trainer, new: list[dict[str, Any]], step: int) -> None:
        if not new and self._counted:
            return
        self._counted = True  # the count is logged at a fit's first check too, where it is usually 0
        self.events.extend(new)
        self.log_step(trainer, {"divergence/events": float(len(self.events))}, step)
        if new and writes_files(trainer):  # none under fast_dev_run
            self._write_events(trainer)

    @rank_zero_only
    def _write_events(self, trainer: pl.Trainer) -> None:
        # strict JSON: a non-finite value is the tagged {"$float": "nan"} that read_events gives back as a float
        lines = "".join(json.dumps(json_safe(e), allow_nan=False) + "\n" for e in self.events)
        atomic_write_text(run_dir(trainer) / EVENTS_FILE, lines)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_last_update(trainer, pl_module)  # the final check: the last update had no next decision
        update_summary(trainer, diverged_step=self.diverged_step, divergence_events=len(self.events))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning says nothing when a callback stops the run: say why, once the progress bar has closed its line
        if self.diverged_step is not None:
            kinds = dict.fromkeys(e["kind"] for e in self.events if e["step"] == self.diverged_step)
            where = f"in {run_dir(trainer) / EVENTS_FILE}" if writes_files(trainer) else "(fast_dev_run: not written)"
            rank_zero_info(f"DivergenceMonitor: the run diverged at step {self.diverged_step} ({', '.join(kinds)}) "
                           f"and ended at step {trainer.global_step}; {len(self.events)} events {where}")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._began:
            return  # refused before it began (the data's setup, another callback's): the run's summary is as it was
        update_summary(trainer, diverged_step=self.diverged_step, divergence_events=len(self.events))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if not self._check_last_update(trainer, pl_module):
            raise NonFiniteCheckpointError(
                f"refusing to save a checkpoint at step {trainer.global_step}: the weights are not finite"
            )

    @override
    def fresh_state(self) -> dict[str, Any]:
        return {"events": [], "losses": [], "diverged_step": None, "first_loss": None}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events), "losses": list(self.losses), "diverged_step": self.diverged_step,
                "first_loss": self.first_loss}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict["events"])
        self.losses = deque(state_dict["losses"], maxlen=self.window)
        self.diverged_step = state_dict["diverged_step"]
        self.first_loss = state_dict.get("first_loss")  # absent from checkpoints written before it was kept
