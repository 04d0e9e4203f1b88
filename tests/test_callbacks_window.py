"""The instruments count the forwards of ``training_step`` only: a validation run between two micro-batches of an
accumulated step, and a forward another callback runs after a step (sampling text, say), are not measured."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from support.callbacks import SEQ, lit, loader, trainer

from lnstab.callbacks import DivergenceMonitor, GrowthBoundMonitor, HiddenStateStatistics, OutputLogitStatistics


class NaNValidation(type(lit("gpt"))):
    """Its validation forwards put NaN in the residual stream; its training forwards never do."""

    def validation_step(self, batch, batch_idx):
        hook = self.model.transformer.wte.register_forward_hook(lambda m, a, out: out * float("nan"))
        try:
            return self.training_step(batch, batch_idx)
        finally:
            hook.remove()


class Sampler(Callback):
    """Runs the model on a prompt of zeros after every training micro-batch, as a text-sampling callback would."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            pl_module(torch.zeros(1, SEQ, dtype=torch.long))


def instruments() -> list:
    return [HiddenStateStatistics(every_n_steps=1), GrowthBoundMonitor(every_n_steps=1),
            OutputLogitStatistics(every_n_steps=1), DivergenceMonitor(attention_logit_threshold=None,
                                                                      collapse_fraction=None, stats_every_n_steps=1)]


def test_validation_inside_an_accumulated_step_is_not_measured(tmp_path) -> None:
    module = NaNValidation.__new__(NaNValidation)
    module.__dict__.update(lit("gpt").__dict__)  # the same weights as lit("gpt"), with NaN validation
    hidden, bound, output, monitor = callbacks = instruments()
    t = trainer(tmp_path, callbacks, max_steps=4, accumulate_grad_batches=2, val_check_interval=3,
                limit_val_batches=1)  # validation after the first micro-batch of step 1
    t.fit(module, loader(32), loader(8))
    assert t.global_step == 4 and monitor.diverged_step is None and monitor.events == []  # before: stopped at 2
    assert hidden.steps == [0, 1, 2, 3] and bound.violations == 0 and all(v == v for v in bound.last.values())
    values = [v for by_tag in hidden.values.values() for series in by_tag.values() for v in series]
    assert all(v == v for v in values)  # no NaN: before, step 1 pooled the validation's
    assert output.steps == [0, 1, 2, 3]


@pytest.mark.parametrize("first", [True, False])
def test_a_forward_another_callback_runs_is_not_measured(tmp_path, first) -> None:
    plain = instruments()
    trainer(tmp_path / "plain", plain, max_steps=3).fit(lit("gpt"), loader(16))
    sampled = instruments()
    callbacks = [Sampler(), *sampled] if first else [*sampled, Sampler()]
    trainer(tmp_path / "sampled", callbacks, max_steps=3).fit(lit("gpt"), loader(16))
    assert sampled[0].values == plain[0].values  # before: with the sampler first its prompt joined every step
    assert sampled[2].last == plain[2].last
