"""``LNStabTrainer``: Lightning's Trainer with hardware-aware precision, atomic checkpoints and ``evaluate``."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.trainer.connectors.accelerator_connector import _PRECISION_INPUT
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lnstab.callbacks.progress import StepProgressBar
from lnstab.callbacks.summary import ParameterSummary
from lnstab.checkpoint import AtomicCheckpointIO
from lnstab.errors import ConfigError
from lnstab.precision import resolve_precision


class _CloudTips(logging.Filter):
    """Drops Lightning's tips that advertise its cloud services (``litlogger``, ``litmodels``) and nothing else: they
    are logged at INFO on the logger every ``rank_zero_info`` goes through, so a level would silence lnstab too."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip: For seamless cloud")


_CLOUD_TIPS = _CloudTips()
# Lightning 2.6 builds torch's deprecated LeafSpec on every batch it moves (torch >= 2.10 warns once per process): a
# FutureWarning a user cannot act on, in every fit. Only that message, only from that module.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"lightning\.pytorch\.utilities\._pytree")


def _one_process(kwargs: dict[str, Any]) -> bool:
    """Whether these Trainer arguments start one process (one node, one device). Lightning's hint on a SLURM host
    ("prepend your python command with srun", against multi-process runs that hang) then only adds noise to every fit
    on a login node or in an allocation; lnstab's own way onto SLURM, ``lnstab sweep --slurm``, runs fits under srun."""
    devices, accelerator = kwargs.get("devices", "auto"), kwargs.get("accelerator", "auto")
    # devices "auto" is one CPU, or every GPU: one where there is at most one (the paper's configs on a CPU machine)
    auto_one = accelerator == "cpu" or (accelerator in ("auto", "gpu", "cuda") and torch.cuda.device_count() <= 1)
    return kwargs.get("num_nodes", 1) == 1 and (devices in (1, "1") or (devices == "auto" and auto_one))


def _without_srun_hint(method: Callable[..., Any]) -> Callable[..., Any]:
    """``pl.Trainer``'s ``method`` (same signature) run under the trainer's ``_no_srun_hint``: Lightning looks for
    SLURM again as each fit, validate, test or predict starts."""

    @functools.wraps(method)
    def run(self: LNStabTrainer, *args: Any, **kwargs: Any) -> Any:
        with self._no_srun_hint():
            return method(self, *args, **kwargs)

    return run


class LNStabTrainer(pl.Trainer):
    """A :class:`lightning.pytorch.Trainer` (same arguments) with these additions.

    * ``precision="auto"`` resolves to ``bf16-mixed`` where bf16 is native (CUDA devices that support it, CPUs with
      native bf16) and to ``32-true`` elsewhere, and says so in one line (:func:`lnstab.precision.resolve_precision`).
    * Checkpoints are written atomically and loaded with ``weights_only=True`` (:class:`AtomicCheckpointIO`) unless
      ``plugins`` already holds a ``CheckpointIO``.
    * Step-bounded runs show ``global_step / max_steps`` (:class:`~lnstab.callbacks.progress.StepProgressBar`)
      unless a progress bar is given or ``enable_progress_bar=False``.
    * The model summary leaves out FLOPs where Lightning measured none
      (:class:`~lnstab.callbacks.summary.ParameterSummary`) unless a summary is given or
      ``enable_model_summary=False``; Lightning's tips for its cloud services (litlogger, litmodels) are not shown,
      nor, in a one-process fit, its hint to launch with ``srun`` where SLURM is installed.
    * :meth:`evaluate`: the final evaluation of a checkpoint (``lnstab evaluate``).

    Example::

        trainer = LNStabTrainer(precision="auto", max_steps=100)
    """

    def __init__(
        self, *, precision: _PRECISION_INPUT | Literal["auto"] | None = None, plugins: Any = None, **kwargs: Any
    ) -> None:
        accelerator = kwargs.get("accelerator", "auto")
        resolved, reason = resolve_precision(precision, accelerator if isinstance(accelerator, str) else "auto")
        if reason:
            rank_zero_info(f"lnstab: precision auto -> {resolved} ({reason})")
        items = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in items):
            items.append(AtomicCheckpointIO())
        callbacks = kwargs.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        if kwargs.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        if kwargs.get("enable_model_summary") is not False and not kwargs.get("barebones") and not any(
            isinstance(c, ModelSummary) for c in callbacks
        ):
            callbacks.append(ParameterSummary())
            kwargs["enable_model_summary"] = False  # Lightning's default summary (FLOPs: 0) is not added
        kwargs["callbacks"] = callbacks
        tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # Lightning's rank_zero_info
        if _CLOUD_TIPS not in tips.filters:
            tips.addFilter(_CLOUD_TIPS)
        self._one_process = _one_process(kwargs)
        with self._no_srun_hint():  # Lightning looks for SLURM here and again as each fit, test, … starts
            try:
                super().__init__(precision=resolved, plugins=items, **kwargs)
            except (ValueError, MisconfigurationException) as exc:  # an argument Lightning refused: a user's mistake
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(f"trainer: {' '.join(str(exc).split())}") from exc

    @contextlib.contextmanager
    def _no_srun_hint(self) -> Iterator[None]:
        with warnings.catch_warnings():
            if self._one_process:  # a process with no peers cannot hang waiting for them, srun or not
                warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not")
            yield

    fit = _without_srun_hint(pl.Trainer.fit)
    validate = _without_srun_hint(pl.Trainer.validate)
    test = _without_srun_hint(pl.Trainer.test)
    predict = _without_srun_hint(pl.Trainer.predict)

    def evaluate(
        self,
        model: pl.LightningModule | None = None,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | None = None,
        weights_only: bool | None = True,
    ) -> list[dict[str, float]]:
        """Final evaluation of a checkpoint: val loss, perplexities, ROUGE-1/2/L and BERTScore into ``eval.json``.

        Runs :meth:`test` with the :class:`~lnstab.evaluation.callback.FinalEvaluation` callback of this trainer
        (``lnstab evaluate`` adds it from the ``evaluation:`` settings), so sharded checkpoints load through the
        strategy and every rank evaluates its shard of the samples.

        Args:
            model: The LightningModule whose weights ``ckpt_path`` holds.
            datamodule: Data with ``validation_tokens()`` (an lnstab datamodule).
            ckpt_path: The checkpoint (file, or directory for a sharded one).
            weights_only: Load with ``torch.load(weights_only=True)`` (default; checkpoints are data, not code).

        Raises:
            ConfigError: No checkpoint, or no FinalEvaluation callback that runs at the end of test.
        """
        from lnstab.evaluation.callback import FinalEvaluation

        if not ckpt_path:
            raise ConfigError("ckpt_path=None is not allowed; lnstab evaluate needs --ckpt_path CHECKPOINT")
        evaluators = [cb for cb in self.callbacks if isinstance(cb, FinalEvaluation) and cb.run_on["test"]]
        if not evaluators:
            raise ConfigError("evaluation.on_test_end=False is not allowed for lnstab evaluate; it must be true")
        if len(evaluators) > 1:
            rank_zero_warn("lnstab evaluate: several FinalEvaluation callbacks; each writes its own eval file")
        for evaluator in evaluators:
            evaluator.test_stage = "evaluate"
        try:
            return self.test(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
        finally:
            for evaluator in evaluators:
                evaluator.test_stage = "test"
