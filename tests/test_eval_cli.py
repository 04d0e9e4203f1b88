"""FinalEvaluation in a Lightning fit/test and ``lnstab evaluate``: eval.json, TensorBoard tags, one-line errors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub, which reads it once
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from fsdp_cpu import CPUDDPSpawnStrategy  # noqa: E402

from lnstab.cli import main as cli  # noqa: E402
from lnstab.datamodules.synthetic import SyntheticDataModule  # noqa: E402
from lnstab.errors import LNStabError  # noqa: E402
from lnstab.evaluation import METRICS  # noqa: E402
from lnstab.evaluation.callback import FinalEvaluation  # noqa: E402
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
    assert list(rec) == ["schema", "protocol", "n_samples", "metrics", "nonfinite", "bertscore", "rouge", "tokenizer",
                         "copying", "settings", "samples", "stage", "global_step"]
    assert rec["nonfinite"] == []
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
    assert acc.Scalars("eval/copy_rate")[0].value == pytest.approx(run["fit"]["copying"]["rate"], abs=1e-6)
    assert {"eval/sample_00/text_summary", "eval/sample_01/text_summary"} <= set(acc.Tags()["tensors"])


def test_fast_dev_run_evaluates_and_writes_no_file(tmp_path, monkeypatch) -> None:
    """Under fast_dev_run (a DummyLogger: the run directory is the current one) the evaluation runs and neither
    eval.json nor the summary (val from GPTModule, eval, status from RunStatus) is written there."""
    from lnstab.callbacks import RunStatus

    monkeypatch.chdir(tmp_path)
    callback = FinalEvaluation(n_samples=2, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", fast_dev_run=True, callbacks=[callback, RunStatus()],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPTModule(**MODEL), SyntheticDataModule(**DATA))
    assert callback.result is not None and set(callback.result["metrics"]) == set(METRICS)
    assert list(tmp_path.iterdir()) == []


def test_callback_rejects_bad_arguments() -> None:
    with pytest.raises(LNStabError, match="protocol='x' is not allowed"):
        FinalEvaluation(protocol="x")
    with pytest.raises(LNStabError, match="n_samples=0 is not allowed"):
        FinalEvaluation(n_samples=0)


def write_configs(tmp_path: Path, **model) -> Path:
    base = {"model": {**MODEL, **model}, "data": {"class_path": "lnstab.datamodules.synthetic.SyntheticDataModule",
                                                  "init_args": {k: v for k, v in DATA.items() if k != "block_size"}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    child = {"extends": "base.yaml", "evaluation": {"n_samples": 3, "batch_size": 2},
             "trainer": {"accelerator": "cpu", "enable_progress_bar": False, "enable_model_summary": False}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(child))
    return tmp_path / "exp.yaml"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_cli_evaluate_writes_next_to_the_checkpoint_without_overwriting(run, tmp_path, capsys) -> None:
    cfg = write_configs(tmp_path)
    before = snapshot(run["dir"])
    cli(["evaluate", "--config", str(cfg), "--ckpt_path", str(run["ckpt"]), "--evaluation.protocol", "generation",
         "--evaluation.prompt_tokens", "8", "--evaluation.new_tokens", "8"])
    after = snapshot(run["dir"])
    assert [k for k, v in before.items() if after[k] != v] == ["summary.json"]  # nothing else rewritten
    old, now = json.loads(before["summary.json"]), json.loads(after["summary.json"])
    assert {k for k in now if now[k] != old.get(k)} == {"eval"}  # the summary's latest evaluation, and only that
    new = sorted(set(after) - set(before))
    evals = [n for n in new if n.startswith("eval")]
    assert len(evals) == 1 and evals[0].startswith("eval-")  # eval.json and eval-1.json were there already
    assert "config.yaml" not in new  # config.yaml stays the training config; this one is config-evaluate-1.yaml
    rec = json.loads((run["dir"] / evals[0]).read_text())
    assert rec["stage"] == "evaluate" and rec["protocol"] == "generation" and rec["global_step"] == 3
    assert rec["n_samples"] == 3  # from the config's evaluation group
    assert rec["settings"]["prompt_tokens"] == 8 and all("prompt" in s for s in rec["samples"])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--model.n_layer", "3"], r"--model.n_layer 3 contradicts the checkpoint's n_layer=2"),
        (["--evaluation.bertscore_model", "/nonexistent/minilm"], r"bertscore_model='/nonexistent/minilm' is not a"),
        (["--evaluation.bertscore_model", "lnstab-test/unreachable"], r"bertscore_model='lnstab-test/unreachable' c"),
        (["--evaluation.n_samples", "0"], r"n_samples=0 is not allowed"),
        (["--evaluation.protocol", "generation", "--evaluation.prompt_tokens", "20", "--evaluation.new_tokens", "20"],
         r"prompt_tokens \+ new_tokens = 40 is not allowed"),
        (["--evaluation.protocol", "beam"], r"protocol='beam' is not allowed; choose one of: teacher_forced, gen"),
    ],
)
def test_cli_bad_input_is_one_line_and_leaves_the_run_directory_alone(run, tmp_path, capsys, extra, match):
    cfg = write_configs(tmp_path)
    before = snapshot(run["dir"])
    with pytest.raises(SystemExit) as info:
        cli(["evaluate", "--config", str(cfg), "--ckpt_path", str(run["ckpt"]), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lnstab: error:")
    assert __import__("re").search(match, err), err
    assert snapshot(run["dir"]) == before


def test_cli_evaluate_refused_by_its_data_leaves_no_event_file(tmp_path, capsys):
    """Data refused at its setup, after the TensorBoard logger opened its file in the run's directory: each refused
    ``lnstab evaluate --ckpt_path <run>/checkpoints/last.ckpt --data.*`` left an empty event file (its header alone)
    there."""
    from support.runs import fit, tiny_config

    run = tmp_path / "run"
    fit("--config", str(tiny_config(tmp_path)), "--run_dir", str(run))
    before = snapshot(run)
    with pytest.raises(SystemExit) as info:  # a validation set shorter than one window, refused at the data's setup
        cli(["evaluate", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--data.init_args.val_tokens", "4"])
    assert info.value.code == 2 and "is longer than the validation data" in capsys.readouterr().err
    assert snapshot(run) == before


class UsersOwn(pl.LightningModule):
    """A module of a user's own project: a checkpoint of it is not lnstab's GPT."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, width)


def test_a_checkpoint_of_another_project_or_of_weights_only_for_a_fit_is_one_line_and_writes_nothing(
        run, tmp_path, capsys) -> None:
    """A user's own Lightning checkpoint gave 'Error(s) in loading state_dict for GPTModule' as a traceback (exit 1)
    after config-test-1.yaml and an event file were written, or LightningCLI's 'Parsing of ckpt_path
    hyperparameters failed!'; a weights-only checkpoint resumed a fit into a KeyError traceback and a 'failed' run."""
    cfg = write_configs(tmp_path)
    users = tmp_path / "users.ckpt"
    module = UsersOwn()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "optimizer_states": [{}], "global_step": 3}, users)
    weights_only = tmp_path / "weights.ckpt"
    torch.save({k: v for k, v in torch.load(run["ckpt"], weights_only=True).items() if k != "optimizer_states"},
               weights_only)
    for command in ("evaluate", "validate", "test", "fit"):
        out = tmp_path / f"out-{command}"
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli([command, "--config", str(cfg), "--ckpt_path", str(users), "--run_dir", str(out)])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"--ckpt_path {users} is not a checkpoint of lnstab's GPT (its weights are layer.weight, layer.bias)" \
            in err, err
        assert not out.exists()
    with pytest.raises(SystemExit) as info:
        cli(["fit", "--config", str(cfg), "--ckpt_path", str(weights_only), "--run_dir", str(tmp_path / "resumed")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "holds the weights only" in err, err
    assert not (tmp_path / "resumed").exists()


def test_cli_rejects_a_file_that_is_not_a_checkpoint(tmp_path, capsys) -> None:
    cfg = write_configs(tmp_path)
    bogus = tmp_path / "bogus.ckpt"
    bogus.write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        cli(["evaluate", "--config", str(cfg), "--ckpt_path", str(bogus)])
    assert "is not a readable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_callback_under_two_process_ddp_equals_single_process(tmp_path) -> None:
    from support.evaluation import assert_same_evaluation

    from lnstab.evaluation import evaluate_model

    module, data = GPTModule(**MODEL), SyntheticDataModule(**DATA)
    callback = FinalEvaluation(n_samples=5, batch_size=2, on_fit_end=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=CPUDDPSpawnStrategy(), logger=False, callbacks=[callback],
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


def test_validate_and_test_of_a_checkpoint_log_at_its_step(run, tmp_path) -> None:
    """``lnstab validate``/``test`` (a fresh trainer, ``ckpt_path``) log val/loss and test/loss at the checkpoint's
    step, beside the run's training curve and its ``eval/`` scalars: Lightning logged them at 0."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = pl.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="tb"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                         limit_test_batches=1)
    module, data = GPTModule(**MODEL), SyntheticDataModule(**DATA)
    trainer.validate(module, data, ckpt_path=run["ckpt"], verbose=False)
    trainer.test(module, data, ckpt_path=run["ckpt"], verbose=False)
    acc = EventAccumulator(trainer.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    steps = {tag: [s.step for s in acc.Scalars(tag)] for tag in ("val/loss", "test/loss", "test/ppl")}
    assert steps == {"val/loss": [3], "test/loss": [3], "test/ppl": [3]}


def test_validation_inside_a_fit_logs_at_the_step_it_scores(tmp_path) -> None:
    """A validation after the 2nd and 4th optimizer steps logs val/loss and val/ppl at steps 2 and 4, the step of the
    weights it scores (as summary.json, the instruments and eval/ do): Lightning logged them at 1 and 3. Nothing is
    logged for the sanity check, and val/loss stays in callback_metrics for EarlyStopping and the progress bar."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = pl.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="tb"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=4, val_check_interval=2,
                         limit_val_batches=1, num_sanity_val_steps=1, log_every_n_steps=1)
    trainer.fit(GPTModule(**MODEL), SyntheticDataModule(**DATA))
    acc = EventAccumulator(trainer.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    steps = {tag: [s.step for s in acc.Scalars(tag)] for tag in ("train/loss", "val/loss", "val/ppl")}
    assert steps == {"train/loss": [0, 1, 2, 3], "val/loss": [2, 4], "val/ppl": [2, 4]}
    last = acc.Scalars("val/loss")[-1].value
    assert acc.Scalars("val/ppl")[-1].value == pytest.approx(math.exp(last), rel=1e-6)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(last, rel=1e-6)
