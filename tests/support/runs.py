"""An lnstab experiment small enough for a test (a 2-layer model on the synthetic stream, resuming exactly) and the
CLI helpers the run, signal, checkpoint, run lock, safeload and evaluation tests share: fit through the CLI, a
one-line error, saved weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lnstab.cli import cli_main, main

VOCAB = 64


def tiny_config(tmp_path: Path, name: str = "tiny", **overrides) -> Path:
    """A 2-layer experiment on the synthetic stream that resumes exactly, a few seconds per run on a CPU."""
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 4, "precision": "32-true",
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path / "runs")}},
            "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 1,
            "val_check_interval": 2, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
        },
        "checkpoint": {"save_last": True, "every_n_train_steps": 2, "save_top_k": -1},
        "instruments": {"every_n_steps": 2, "jacobian_every_n_steps": 0},
        "evaluation": {"n_samples": 2, "batch_size": 2},
        "model": {"preset": "tiny", "vocab_size": VOCAB, "block_size": 16, "warmup_steps": 1, "lr_decay_steps": 40,
                  "learning_rate": 3e-3, "min_lr": 3e-4},
        "data": {"class_path": "lnstab.datamodules.OpenWebTextDataModule",
                 "init_args": {"source": "synthetic", "batch_size": 4, "num_workers": 0, "val_tokens": 256,
                               "synthetic_tokens": 20_000, "synthetic_vocab_size": VOCAB}},
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        cfg[section] = {**cfg[section], field: value} if field else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit(*args: str) -> None:
    cli_main(["fit", *args])


def one_line_error(capsys, *args: str) -> str:
    """Run ``lnstab *args``; it must exit 2 with exactly one ``lnstab: error:`` line; that line."""
    capsys.readouterr()  # drop what earlier runs in this test printed
    with pytest.raises(SystemExit) as info:
        main(list(args))
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("lnstab: error: ") and "\n" not in err, err
    return err


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, weights_only=True)["state_dict"]
