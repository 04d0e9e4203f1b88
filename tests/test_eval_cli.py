"""FinalEvaluation in a Lightning fit/test and ``lnstab evaluate``: eval.json, TensorBoard tags, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub, which reads it once
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from lnstab.cli import main as cli  # noqa: E402
from lnstab.datamodules.synthetic import SyntheticDataModule  # noqa: E402
from lnstab.errors import LNStabError  # noqa: E402
from lnstab.eval_callback import FinalEvaluation  # noqa: E402
from lnstab.evaluation import METRICS  # noqa: E402
from lnstab.module import GPTModule  # noqa: E402

VOCAB = 64
MODEL = dict(preset="tiny", vocab_size=VOCAB, block_size=32, warmup_steps=1)
DATA = dict(block_size=32, batch_size=4, synthetic_vocab_size=VOCAB, train_tokens=2_000, val_tokens=1_000, seed=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Fit 3 steps and test once with FinalEvaluation and a TensorBoardLogger; save a checkpoint."""
    from lightning.pytorch.loggers import TensorBoardLogger

    root = tmp_path_factory.mktemp("run")
    callback = FinalEvaluation(n_samples=4, batch_size=2, num_text_samples=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=TensorBoardLogger(root, name="tb"), callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
        limit_test_batches=1,
    )
    module, data = GPTModule(**MODEL), SyntheticDataModule(**DATA)
    trainer.fit(module, data)
    fit_result = json.loads((Path(trainer.log_dir) / "eval.json").read_text())
    trainer.test(module, data)
    ckpt = Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    return {"dir": Path(trainer.log_dir), "fit": fit_result, "ckpt": ckpt, "callback": callback}


def test_callback_writes_eval_json_after_fit_and_test(run) -> None:
    rec = run["fit"]
    assert rec["stage"] == "fit" and rec["global_step"] == 3 and rec["protocol"] == "teacher_forced"
    assert rec["n_samples"] == 4 and len(rec["samples"]) == 4
    assert set(rec["metrics"]) == set(METRICS)
    assert list(rec) == ["schema", "protocol", "n_samples", "metrics", "bertscore", "rouge", "tokenizer", "settings",
                         "samples", "stage", "global_step"]
    assert rec["rouge"]["use_stemmer"] is True and rec["settings"]["seed"] == 1337
    assert rec["bertscore"]["num_layers"] == 6 and "minilm" in rec["bertscore"]["name"]
    assert {"prediction", "reference", "loss", "start", "rouge1", "bertscore_f1"} <= set(rec["samples"][0])
    test = json.loads((run["dir"] / "eval-1.json").read_text())  # the test stage did not overwrite eval.json
    assert test["stage"] == "test" and test["metrics"] == rec["metrics"]  # same model, same seeded windows


def test_callback_logs_eval_scalars_and_text_to_tensorboard(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["dir"]), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {f"eval/{m}" for m in METRICS} <= scalars
    assert acc.Scalars("eval/rouge1")[0].value == pytest.approx(run["fit"]["metrics"]["rouge1"], abs=1e-6)
    assert {"eval/sample_00/text_summary", "eval/sample_01/text_summary"} <= set(acc.Tags()["tensors"])


def test_callback_rejects_bad_arguments() -> None:
    with pytest.raises(LNStabError, match="protocol='x' is not allowed"):
        FinalEvaluation(protocol="x")
    with pytest.raises(LNStabError, match="n_samples=0 is not allowed"):
        FinalEvaluation(n_samples=0)


def write_configs(tmp_path: Path, **model) -> Path:
    base = {"model": {**MODEL, **model}, "data": {"class_path": "lnstab.datamodules.synthetic.SyntheticDataModule",
                                                  "init_args": {k: v for k, v in DATA.items() if k != "block_size"}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    child = {"extends": "base.yaml", "trainer": {"callbacks": [
        {"class_path": "lnstab.eval_callback.FinalEvaluation", "init_args": {"n_samples": 3, "batch_size": 2}}]}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(child))
    return tmp_path / "exp.yaml"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_cli_evaluate_writes_next_to_the_checkpoint_without_overwriting(run, tmp_path, capsys) -> None:
    cfg = write_configs(tmp_path)
    before = snapshot(run["dir"])
    cli(["evaluate", "--config", str(cfg), "--ckpt", str(run["ckpt"]), "--protocol", "generation",
         "--prompt_tokens", "8", "--new_tokens", "8"])
    new = sorted(set(snapshot(run["dir"])) - set(before))
    assert len(new) == 1 and new[0].startswith("eval-")  # eval.json and eval-1.json were there already
    assert all(snapshot(run["dir"])[k] == v for k, v in before.items())
    rec = json.loads((run["dir"] / new[0]).read_text())
    assert rec["stage"] == "evaluate" and rec["protocol"] == "generation" and rec["global_step"] == 3
    assert rec["n_samples"] == 3  # from the config's FinalEvaluation init_args
    assert rec["settings"]["prompt_tokens"] == 8 and all("prompt" in s for s in rec["samples"])
    assert json.loads(capsys.readouterr().out)["rouge1"] == rec["metrics"]["rouge1"]


@pytest.mark.parametrize(
    ("extra", "model", "match"),
    [
        ([], {"n_layer": 3}, r"the checkpoint's n_layer=2 does not match the config's n_layer=3"),
        ([], {"norm_placement": "peri"}, r"norm_placement='pre' does not match the config's norm_placement='peri'"),
        (["--bertscore_model", "/nonexistent/minilm"], {}, r"bertscore_model='/nonexistent/minilm' is not a dir"),
        (["--bertscore_model", "lnstab-test/unreachable"], {}, r"bertscore_model='lnstab-test/unreachable' could"),
        (["--n_samples", "0"], {}, r"n_samples=0 is not allowed"),
        (["--protocol", "generation", "--prompt_tokens", "20", "--new_tokens", "20"], {}, r"prompt_tokens \+ new"),
        (["--protocol", "beam"], {}, r"--protocol: invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line_and_leaves_the_run_directory_alone(run, tmp_path, capsys, extra, model, match):
    cfg = write_configs(tmp_path, **model)
    before = snapshot(run["dir"])
    with pytest.raises(SystemExit) as info:
        cli(["evaluate", "--config", str(cfg), "--ckpt", str(run["ckpt"]), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lnstab: error:")
    assert __import__("re").search(match, err), err
    assert snapshot(run["dir"]) == before


def test_cli_rejects_a_file_that_is_not_a_checkpoint(tmp_path, capsys) -> None:
    cfg = write_configs(tmp_path)
    bogus = tmp_path / "bogus.ckpt"
    bogus.write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        cli(["evaluate", "--config", str(cfg), "--ckpt", str(bogus)])
    assert "is not a readable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_callback_under_two_process_ddp_equals_single_process(tmp_path) -> None:
    from test_eval_model import assert_same_evaluation

    from lnstab.evaluation import evaluate_model

    module, data = GPTModule(**MODEL), SyntheticDataModule(**DATA)
    callback = FinalEvaluation(n_samples=5, batch_size=2, on_fit_end=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, callbacks=[callback],
        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False, limit_test_batches=1,
    )
    trainer.test(module, data)
    ddp = json.loads((tmp_path / "eval.json").read_text())
    assert ddp["stage"] == "test" and ddp["settings"]["world_size"] == 2
    assert sorted(p.name for p in tmp_path.glob("eval*.json")) == ["eval.json"]  # rank zero alone wrote
    data.setup("test")
    single = evaluate_model(module.model, data.validation_tokens(), n_samples=5, batch_size=2, rank=0, world_size=1)
    single = json.loads(json.dumps(single))
    assert_same_evaluation(ddp, single)
