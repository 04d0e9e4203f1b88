"""``FinalEvaluation``: the paper's end-of-training scores (loss, perplexities, ROUGE, BERTScore) as a callback."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lnstab import validation as require
from lnstab.callbacks._strategy import unsharded
from lnstab.callbacks.run_status import interrupted, stop_at_once_on_signal, trained_steps
from lnstab.errors import LNStabError
from lnstab.evaluation import metrics
from lnstab.evaluation.core import eval_scalars, evaluate_model, write_eval_json
from lnstab.evaluation.settings import EvalSettings
from lnstab.rundir import run_dir, update_summary, writes_files


class FinalEvaluation(Callback):
    """Evaluates the trained model once at the end of ``fit`` and of ``test`` (see :mod:`lnstab.evaluation.core`).

    "End of fit" is ``on_train_end``, while the model is still on its device; BERTScore runs on rank zero's device.
    Under FSDP every rank evaluates its shard of the samples on gathered full parameters
    (:func:`lnstab.callbacks.unsharded`).
    A run stopped by a signal (:class:`lnstab.callbacks.RunStatus`) is not evaluated: it will be resumed.

    The validation stream comes from ``trainer.datamodule.validation_tokens()`` (the lnstab datamodule contract).
    Every rank runs its shard of the samples; results are gathered, so the scores equal a single-process run. Rank
    zero writes ``eval.json`` in the run directory (``eval-1.json``, … if one exists: nothing is overwritten; nothing
    under ``fast_dev_run``, which evaluates all the same), logs
    the scalars at ``trainer.global_step`` and, with a TensorBoardLogger, ``num_text_samples`` prediction/reference
    pairs as text. A diverged model's non-finite loss and perplexities are kept (``inf``/``nan``, listed under
    ``nonfinite`` in ``eval.json``), never an error.

    Args:
        on_fit_end: Evaluate at the end of ``fit``.
        on_test_end: Evaluate at the end of ``test`` (and of ``lnstab evaluate``).
        num_text_samples: Prediction/reference pairs added to TensorBoard as text.
        **settings: The :class:`~lnstab.evaluation.settings.EvalSettings` fields (``protocol``, ``n_samples``,
            ``seed``, ``batch_size``, ``block_size``, ``prompt_tokens``, ``new_tokens``, ``greedy``, ``temperature``,
            ``top_k``, ``bertscore_model``, ``bertscore_layers``, ``bertscore_batch_size``).

    **Logged metrics**:
        ``eval/loss``, ``eval/ppl_exp_mean_loss`` (exp of the mean loss), ``eval/ppl_mean_seq`` (mean of per-window
        exp(loss), the authors' convention), ``eval/rouge1``, ``eval/rouge2``, ``eval/rougeL``,
        ``eval/bertscore_precision``, ``eval/bertscore_recall``, ``eval/bertscore_f1``, ``eval/copy_rate`` (the
        ``teacher_forced`` protocol only: the fraction of predictions that repeat their input token); text
        ``eval/sample_00`` ….

    Raises:
        ConfigError: A bad argument (in ``__init__``).
        LNStabError: A datamodule without ``validation_tokens`` or a BERTScore model that cannot be found (in
            ``setup``), zero samples (at evaluation).

    Example::

        trainer = Trainer(callbacks=[FinalEvaluation(n_samples=200)])
    """

    def __init__(
        self, on_fit_end: bool = True, on_test_end: bool = True, num_text_samples: int = 3, **settings: Any
    ) -> None:
        self.settings = EvalSettings(**settings)
        self.run_on = {"fit": bool(on_fit_end), "test": bool(on_test_end)}
        self.num_text_samples = require.integer("num_text_samples", num_text_samples, 0)
        self.result: dict[str, Any] | None = None
        self.path = None
        self.test_stage = "test"  # the stage recorded in eval.json at the end of test ("evaluate" for lnstab evaluate)

    def layout_sources(self, pl_module: Any) -> set[str]:
        """The dashboard's evaluation charts (:func:`lnstab.callbacks.layout.layout_sources`) where this evaluates at
        the end of fit or of test (``lnstab test`` of the run fills them later); none where it never does."""
        names = {cls.__name__ for cls in type(self).__mro__}
        return names if any(self.run_on.values()) else names - {"FinalEvaluation"}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(protocol=self.settings.protocol, seed=self.settings.seed)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        metrics.resolve_bertscore_model(self.settings.bertscore_model)  # fail before training, not after
        if self.run_on.get(stage) and not callable(getattr(trainer.datamodule, "validation_tokens", None)):
            raise LNStabError(
                f"data={type(trainer.datamodule).__name__} has no validation_tokens(); FinalEvaluation needs an lnstab "
                f"datamodule (or on_{getattr(stage, 'value', stage)}_end=False)"
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last hook of fit before the strategy tears down (``on_fit_end`` runs after the model went to the CPU).
        if self.run_on["fit"] and not interrupted(trainer):
            with stop_at_once_on_signal(trainer):  # no optimizer step to wait for: a signal ends the run now
                self.evaluate(trainer, pl_module, "fit")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run_on["test"]:
            self.evaluate(trainer, pl_module, self.test_stage)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> dict[str, Any]:
        """Run the evaluation now (every rank), write and log on rank zero; returns the result."""
        tokens = trainer.datamodule.validation_tokens()
        distributed = trainer.world_size > 1
        device = trainer.strategy.root_device
        with unsharded(trainer, pl_module) as module:  # FSDP: full parameters, every rank (one device/DDP: as is)
            result = evaluate_model(
                getattr(module, "model", module), tokens, self.settings,
                bertscore_device=str(device) if device.type == "cuda" else "cpu",
                rank=trainer.global_rank if distributed else 0, world_size=trainer.world_size if distributed else 1,
                forward_context=trainer.precision_plugin.forward_context,
            )
        self.result = result
        step = trained_steps(trainer, pl_module)
        if trainer.is_global_zero:
            if writes_files(trainer):  # fast_dev_run: evaluated, nothing written
                self.path = write_eval_json(run_dir(trainer), result, stage=stage, global_step=step)
                update_summary(trainer, eval={**result["metrics"], "protocol": result["protocol"],
                                              "file": self.path.name})
            self._log(trainer, result, step)
            note = ""
            if _data_source(trainer) == "synthetic":
                note = (" (synthetic token stream, not text: its ROUGE and BERTScore say nothing about language; "
                        "train on text, e.g. --data.source sample, for scores that mean something)")
            empty = sum(not s["prediction"].strip() for s in result["samples"])
            if empty:
                note += (f" ({empty} of {len(result['samples'])} predictions empty: their ROUGE and BERTScore are 0, "
                         "as the reference packages score an empty text)")
            where = self.path if writes_files(trainer) else "not written (fast_dev_run)"
            rank_zero_info(f"FinalEvaluation: {json.dumps(result['metrics'])} -> {where}{note}")
        return result

    def _log(self, trainer: pl.Trainer, result: dict[str, Any], step: int) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            logger.log_metrics(eval_scalars(result), step=step)
            if isinstance(logger, TensorBoardLogger):
                for i, s in enumerate(result["samples"][: self.num_text_samples]):
                    text = "".join(
                        f"**{k}**:\n\n    {s[k]!r}\n\n" for k in ("prompt", "prediction", "reference") if k in s
                    )
                    logger.experiment.add_text(f"eval/sample_{i:02d}", text, global_step=step)
                logger.experiment.flush()


def _data_source(trainer: pl.Trainer) -> str | None:
    """The source the run's data module read (``resolved_source``, else ``source``), where it records one."""
    hparams = getattr(trainer.datamodule, "hparams", None) or {}
    return hparams.get("resolved_source", hparams.get("source"))
