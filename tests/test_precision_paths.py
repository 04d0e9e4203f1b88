"""Both precision paths on any machine: what depends on the resolved precision runs under ``32-true`` and under
``bf16-mixed`` explicitly, whichever ``auto`` picks here, and ``auto`` itself is checked on both kinds of CPU: this
one as it is, and the same CPU with oneDNN and ATen capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``), which is what a CPU without AVX-512 BF16 or AMX offers them."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lnstab.callbacks import Instruments
from lnstab.datamodules.synthetic import SyntheticDataModule
from lnstab.module import GPTModule
from lnstab.precision import cpu_has_native_bf16
from lnstab.rundir import read_hidden_series

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
PROBE = ("import json, torch; from lnstab.precision import resolve_precision; "
         "print(json.dumps([torch.ops.mkldnn._is_mkldnn_bf16_supported(), resolve_precision('auto', 'cpu')[0]]))")


def probe(env: dict[str, str]) -> tuple[bool, str]:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    native, value = json.loads(done.stdout.splitlines()[-1])
    return native, value


def test_auto_picks_fp32_on_an_avx2_cpu_and_follows_native_bf16_here() -> None:
    native, value = probe({})
    assert native == cpu_has_native_bf16() and value == ("bf16-mixed" if native else "32-true")
    assert probe(AVX2_ONLY) == (False, "32-true")


def fit(tmp_path, precision: str) -> tuple[GPTModule, dict]:
    pl.seed_everything(0)
    module = GPTModule(preset="tiny", norm_placement="peri", vocab_size=64, block_size=32, learning_rate=3e-3,
                       min_lr=3e-4, warmup_steps=2)
    data = SyntheticDataModule(block_size=32, batch_size=8, synthetic_vocab_size=64, train_tokens=20_000,
                               val_tokens=2_000, seed=0)
    trainer = pl.Trainer(accelerator="cpu", precision=precision, max_steps=6, default_root_dir=tmp_path,
                         logger=pl.loggers.CSVLogger(tmp_path, name="", version=""), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=2,
                         val_check_interval=6, num_sanity_val_steps=0, gradient_clip_val=1.0,
                         log_every_n_steps=2,
                         callbacks=Instruments(every_n_steps=2, jacobian_every_n_steps=3, jacobian_probe_size=1,
                                               jacobian_n_iter=3).callbacks())
    trainer.fit(module, data)
    last: dict = {}
    with open(tmp_path / "metrics.csv") as f:  # every logged value, the last of each key
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return module, {**last, "_series": read_hidden_series(tmp_path)}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_instruments_measure_in_float32_under_either_precision(tmp_path, precision: str) -> None:
    """Under bf16 autocast the activations the instruments see are bf16; their statistics are still accumulated
    and logged in float32, finite, and close to the fp32 run's (a bf16 forward differs by its rounding)."""
    module, got = fit(tmp_path / precision, precision)
    series = got.pop("_series")
    assert series["steps"] == [0, 2, 4]
    values = [v for per_tag in series["stats"].values() for vs in per_tag.values() for v in vs]
    assert values and all(math.isfinite(v) for v in values)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # mixed: the weights stay fp32
    for key in ("train/loss", "val/loss", "bound/ma_bound"):
        assert key in got and math.isfinite(got[key]), key
    if precision == "bf16-mixed":
        _, reference = fit(tmp_path / "ref", "32-true")
        reference.pop("_series")
        for key in ("val/loss", "hidden/mean_abs/L01_mlp", "bound/ma_bound"):
            assert got[key] == pytest.approx(reference[key], rel=5e-2), key


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_model_summary_counts_fp32_weights_without_a_warning_under_either_precision(
    tmp_path, precision: str, caplog
) -> None:
    """Lightning warns in every bf16-mixed fit that the summary's size "will not be accurate" and counts 32 bits;
    under mixed precision the weights are fp32, so that size is right: lnstab's summary says it without the warning.
    Lightning's own summary is run beside it, so the test notices if Lightning stops warning."""
    from lightning.pytorch.callbacks import ModelSummary

    from lnstab.callbacks.summary import ParameterSummary

    for summary in (ParameterSummary(), ModelSummary()):
        module = GPTModule(preset="tiny", vocab_size=64, block_size=16)
        data = SyntheticDataModule(block_size=16, batch_size=2, synthetic_vocab_size=64, train_tokens=2_000,
                                   val_tokens=200, seed=0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, callbacks=[summary])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        said = [str(w.message) for w in caught if "is not supported by the model summary" in str(w.message)]
        expected = 0 if isinstance(summary, ParameterSummary) or precision == "32-true" else 1
        assert len(said) == expected, (type(summary).__name__, said)
    size = 4 * sum(p.numel() for p in module.parameters()) / 1e6  # fp32 bytes: the weights' real size
    assert f"{size:,.3f}" in caplog.text
