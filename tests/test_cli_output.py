"""What ``lnstab fit`` shows a user: no Lightning advertisements or empty FLOPs, one training bar, and a last line that
names the run directory and the TensorBoard command; a synthetic stream's ROUGE is explained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub, which reads it once

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from lnstab.datamodules.synthetic import SyntheticDataModule  # noqa: E402
from lnstab.evaluation.callback import FinalEvaluation  # noqa: E402
from lnstab.module import GPTModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.system
def test_a_quickstart_fit_ends_with_its_run_directory_and_shows_no_lightning_noise(tmp_path) -> None:
    exe = Path(sys.executable).with_name("lnstab")
    cmd = [str(exe), "fit", "--config", str(ROOT / "experiments" / "quickstart.yaml"), "--trainer.max_steps", "2",
           "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--evaluation.n_samples", "2",
           "--instruments.jacobian_every_n_steps", "0", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart" / "version_0"
    last = done.stderr.strip().splitlines()[-1]  # below the working directory: relative to it, as a resume says too
    shown_run = "runs/quickstart/version_0"
    assert last == f"lnstab: run directory {shown_run}; to view it: tensorboard --logdir {shown_run}"
    shown = done.stdout + done.stderr
    assert "litlogger" not in shown and "💡 Tip" not in shown  # Lightning's cloud advertisement
    assert "FLOPs" not in shown and "Flops" not in shown  # Lightning measured none: no column of zeros, no total
    assert "LeafSpec" not in shown  # torch's deprecation of what Lightning builds on every batch
    assert "Trainable params" in done.stderr  # the model summary itself is still there
    assert "Epoch 0" not in done.stdout and "Training steps:   0%|          | 0/2" in done.stdout  # one bar, by steps
    evaluation = next(line for line in done.stderr.splitlines() if line.startswith("FinalEvaluation: "))
    assert "synthetic" not in evaluation  # the quickstart trained on the packaged OpenWebText sample
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["init_args"]["source"] == "sample"
    resumed = subprocess.run([*cmd[:-2], "--run_dir", str(run), "--ckpt_path", "last", "--trainer.max_steps", "3"],
                             cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.strip().splitlines()[-1] == last  # was the absolute path on a resume


def synthetic_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> str:
    """A tiny fit on a synthetic stream with a final evaluation of two samples; its ``FinalEvaluation`` line."""
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[FinalEvaluation(n_samples=2, batch_size=2)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
    )
    data = SyntheticDataModule(block_size=32, batch_size=4, synthetic_vocab_size=64, train_tokens=2_000,
                               val_tokens=1_000, seed=0)
    with caplog.at_level("INFO"):
        trainer.fit(GPTModule(preset="tiny", vocab_size=64, block_size=32, warmup_steps=1), data)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FinalEvaluation: ")]
    return line


def test_the_final_evaluation_says_scores_on_a_synthetic_stream_mean_nothing(tmp_path, caplog) -> None:
    # It said "ROUGE is expected to be ~0 there", and this very fit scores ROUGE-1 ~0.7 (64 ids, letters among them).
    line = synthetic_fit(tmp_path, caplog)
    assert line.endswith("(synthetic token stream, not text: its ROUGE and BERTScore say nothing about language; "
                         "train on text, e.g. --data.source sample, for scores that mean something)"), line


def test_the_final_evaluation_counts_empty_predictions_instead_of_bert_scores_print(tmp_path, caplog, capfd,
                                                                                   monkeypatch) -> None:
    """A prediction that decodes to nothing (early in training) made bert-score print "Warning: Empty candidate
    sentence detected" on its own; the evaluation line says how many there were and what they score."""
    from lnstab.evaluation import core

    real = core._score
    spaces = [220]  # GPT-2's " ": a prediction of spaces only decodes to an empty text for both scorers

    def predicts_spaces(samples, *args):
        return real([{**s, "pred": spaces * len(s["pred"])} for s in samples], *args)

    monkeypatch.setattr(core, "_score", predicts_spaces)
    line = synthetic_fit(tmp_path, caplog)
    assert "(2 of 2 predictions empty: their ROUGE and BERTScore are 0, as the reference packages score an empty " \
           "text)" in line, line
    assert "Empty candidate" not in capfd.readouterr().err


def test_a_one_process_fit_on_a_slurm_host_shows_no_srun_hint_and_a_multi_process_one_still_does() -> None:
    """Lightning hints "prepend your python command with srun" wherever srun is installed: in every fit on a login node
    (and in every test here). lnstab keeps the hint only where it helps, a fit of several processes."""
    import shutil
    import warnings

    from lnstab.trainer import LNStabTrainer

    if shutil.which("srun") is None:
        assert not os.environ.get("LNSTAB_REQUIRE_SLURM"), "srun is not on PATH (.ci/run installs SLURM)"
        pytest.skip("srun is not installed here, so Lightning has no hint to give")
    said = {}
    cases = (("one", {"devices": 1}), ("cpu-auto", {}), ("two", {"devices": 2, "strategy": "ddp"}),
             ("auto-auto", {"accelerator": "auto"}))  # base.yaml's devices and accelerator (it said the hint twice)
    for name, kwargs in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kwargs = {"accelerator": "cpu", **kwargs}
            trainer = LNStabTrainer(logger=False, enable_checkpointing=False, max_steps=1,
                                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                                    num_sanity_val_steps=0, **kwargs)
            if name != "two":  # Lightning looks again as a fit starts (the second process would be launched there)
                data = SyntheticDataModule(block_size=16, batch_size=2, synthetic_vocab_size=64, train_tokens=2_000,
                                           val_tokens=200, seed=0)
                trainer.fit(GPTModule(preset="tiny", vocab_size=64, block_size=16), data)
                assert trainer.global_step == 1
        said[name] = [str(w.message) for w in caught if "`srun` command is available" in str(w.message)]
    assert said["one"] == said["cpu-auto"] == [] and len(said["two"]) == 1, said
    assert said["auto-auto"] == [] or torch.cuda.device_count() > 1, said  # auto on a GPU node is every GPU
