"""``ParameterSummary``: Lightning's model summary without a FLOPs column and total that no forward measured."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override


class ParameterSummary(ModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` (layers, parameter counts, size, modes), as
    plain text, but without FLOPs where Lightning measured none.

    Lightning counts FLOPs only on a forward of the module's ``example_input_array``; lnstab's ``GPTModule`` has none,
    so the default summary printed a column of zeros and ``Total FLOPs: 0``. A module that sets
    ``example_input_array`` gets Lightning's summary with its FLOPs unchanged. Under mixed precision (``bf16-mixed``,
    ``16-mixed``) it counts the fp32 weights without Lightning's warning that the size "will not be accurate".
    ``LNStabTrainer`` uses this callback in place of Lightning's default one.

    Args:
        max_depth: As :class:`~lightning.pytorch.callbacks.ModelSummary` (``-1``: all layers, ``0``: no summary).
        **summarize_kwargs: Passed to Lightning's summary where FLOPs were measured.

    **Logged metrics**: none.

    Example::

        trainer = Trainer(enable_model_summary=False, callbacks=[ParameterSummary(max_depth=2)])
    """

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        # Under mixed precision the weights are kept in fp32, so the 32 bits Lightning then counts (with a warning that
        # it "will not be accurate", in every bf16-mixed fit: every fit on a bf16 GPU or CPU) are the right size.
        with warnings.catch_warnings():
            if str(trainer.precision).endswith("-mixed"):
                warnings.filterwarnings("ignore", message=r"Precision .*-mixed is not supported by the model summary")
            return super()._summary(trainer, pl_module)

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops, **summarize_kwargs)
            return
        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *map(len, values)]) for name, values in columns]
        rule = "-" * (sum(widths) + 3 * len(widths))
        rows = len(columns[0][1]) if columns else 0
        lines = [" | ".join(f"{name:<{w}}" for (name, _), w in zip(columns, widths, strict=True)), rule]
        lines += [" | ".join(f"{values[i]:<{w}}" for (_, values), w in zip(columns, widths, strict=True))
                  for i in range(rows)]
        lines.append(rule)
        counts = ((trainable_parameters, "Trainable params"),
                  (total_parameters - trainable_parameters, "Non-trainable params"), (total_parameters, "Total params"))
        lines += [f"{get_human_readable_count(int(n)):<10}{label}" for n, label in counts]
        lines.append(f"{get_formatted_model_size(model_size):<10}Total estimated model params size (MB)")
        lines += [f"{total_training_modes[mode]:<10}Modules in {mode} mode" for mode in ("train", "eval")]
        rank_zero_info("\n" + "\n".join(lines))
