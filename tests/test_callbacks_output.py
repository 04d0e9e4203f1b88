"""OutputLogitStatistics: log Z mean and standard deviation and the largest logit equal a direct computation on the
model's logits (lnstab's GPT, whose padded vocabulary rows never count, and Hugging Face GPT-2), without whole-batch
logits, pooled over micro-batches and over ranks like one process on the global batch."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from fsdp_cpu import CPUDDPSpawnStrategy
from hf_tiny import HFLM, hf_model
from support.callbacks import (
    STEPS,
    EncoderLM,
    LitLM,
    MaxNumel,
    Recorder,
    ShardedSGD,
    fit_fixed,
    gpt,
    lit,
    loader,
    trainer,
)

from lnstab.callbacks import OutputLogitStatistics
from lnstab.callbacks._views import LogitView
from lnstab.errors import ConfigError


def direct(logits: torch.Tensor) -> dict[str, float]:
    """The three statistics from logits ``(B, T, V)`` in float64 (population standard deviation over tokens)."""
    log_z = torch.logsumexp(logits.double().flatten(0, 1), dim=-1)  # (B·T,)
    return {"output/log_z_mean": log_z.mean().item(), "output/log_z_std": log_z.std(correction=0).item(),
            "output/max_logit": logits.max().item()}


def assert_close(got: dict[str, float], expected: dict[str, float], context=None) -> None:
    assert set(got) == set(expected), context
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (context, key)


def test_lnstab_gpt_from_the_final_norm_and_the_head_without_its_padded_rows(tmp_path):
    torch.manual_seed(0)
    model = gpt(pad_vocab_multiple=64)  # 100 tokens, 128 head rows
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20.0)  # log Z far from log V (tied head)
        model.transformer.wte.weight[100:] = 50.0  # padded rows: they would dominate log Z if they counted
    module = LitLM(model)
    callback = OutputLogitStatistics(every_n_steps=1, chunk_rows=5)
    values, data = fit_fixed(tmp_path, module, [callback])
    assert sorted(values) == [0, 1]
    for step in range(2):
        with torch.no_grad():
            logits = module(data[4 * step : 4 * step + 4])  # (4, T, 100): the step's two micro-batches, lr 0
        assert logits.shape[-1] == 100
        assert_close(values[step], direct(logits), step)
    assert values[0]["output/log_z_std"] > 0.1 and abs(values[0]["output/log_z_mean"] - 4.6) > 1


def test_hugging_face_gpt2_from_its_lm_head_output(tmp_path):
    hf = hf_model("gpt2")
    callback = OutputLogitStatistics(every_n_steps=1)
    values, data = fit_fixed(tmp_path, LitLM(HFLM(hf)), [callback], steps=1)
    assert callback.sites[0].name == "model.hf.lm_head"
    with torch.no_grad():
        assert_close(values[0], direct(hf(input_ids=data[:4], use_cache=False).logits))


def test_no_whole_batch_logits():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(128, 32, generator=g)
    whole = LogitView(hidden, weight, vocab_size=100, chunk_rows=1000).logits
    with MaxNumel() as spy:
        chunked = LogitView(hidden, weight, vocab_size=100, chunk_rows=8).logits
    assert spy.largest <= 8 * 100  # one chunk's logits at most, never the batch's 64 × 100
    torch.testing.assert_close(chunked.log_z, whole.log_z)
    assert chunked.max_logit == whole.max_logit and chunked.tokens == 64
    torch.testing.assert_close(whole.log_z, torch.logsumexp(hidden @ weight[:100].T, dim=-1))


class SGD(LitLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit_accumulated(tmp_path, name: str, batch_size: int, accumulate: int) -> list[dict[str, float]]:
    callback, rows = OutputLogitStatistics(every_n_steps=1), []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if callback.last:
                rows.append(callback.last)
                callback.last = {}

    torch.manual_seed(0)
    t = trainer(tmp_path / name, [callback, Keep()], max_steps=3, accumulate_grad_batches=accumulate)
    t.fit(SGD(gpt()), loader(n=24, batch_size=batch_size))
    return rows


def test_four_micro_batches_equal_one_batch(tmp_path):
    single = fit_accumulated(tmp_path, "single", batch_size=8, accumulate=1)
    micro = fit_accumulated(tmp_path, "micro", batch_size=2, accumulate=4)
    assert len(single) == len(micro) == 3
    for step, (expected, got) in enumerate(zip(single, micro, strict=True)):
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=2e-5, abs=1e-6), (step, key)


@pytest.mark.slow
def test_two_ddp_processes_pool_like_one_process(tmp_path):
    torch.set_num_threads(1)
    results = {}
    for name, kwargs in (("single", dict(devices=1)), ("ddp", dict(devices=2, strategy=CPUDDPSpawnStrategy()))):
        callback = OutputLogitStatistics(every_n_steps=1, chunk_rows=7)
        recorder = Recorder(str(tmp_path / f"{name}.json"), [callback])
        t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                       enable_checkpointing=False, max_steps=STEPS, callbacks=[callback, recorder],
                       use_distributed_sampler=False, **kwargs)
        torch.manual_seed(0)
        t.fit(ShardedSGD(1))
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())["steps"]
    assert sorted(results["ddp"]) == sorted(results["single"]) == ["0", "1", "2"]
    for step, expected in results["single"].items():
        assert_close(results["ddp"][step], expected, step)  # each rank saw half the batch: sums, moments, max


def test_a_model_without_a_head_and_bad_arguments_are_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        OutputLogitStatistics().setup(None, LitLM(EncoderLM()), "fit")
    assert str(info.value).startswith("model=LitLM is not allowed with OutputLogitStatistics; no module matches "
                                      "head_pattern") and "\n" not in str(info.value)
    head = OutputLogitStatistics(source="final_hidden", final_pattern=r"encoder$", head_pattern=r"head$")
    head.setup(None, LitLM(EncoderLM()), "fit")  # a user's final module and head
    assert head.sites[0].name == "model.encoder"
    head.teardown(None, None, "fit")
    with pytest.raises(ConfigError, match="source='final_hidden' is not allowed"):
        OutputLogitStatistics(source="final_hidden", final_pattern=r"nothing$").setup(None, lit("hf"), "fit")
    # a vocab_size above the head's rows was taken as all of them, with no word (lnstab's GPT and a head of its own)
    for module, rows in ((LitLM(gpt(pad_vocab_multiple=64)), 128), (lit("hf"), None)):
        rows = rows or next(m for n, m in module.named_modules() if n.endswith("lm_head")).weight.shape[0]
        with pytest.raises(ConfigError, match=rf"^vocab_size={rows + 1} is not allowed with OutputLogitStatistics; "
                                              rf"the output head gives {rows} logits per token, so it must be at most "
                                              rf"{rows}$"):
            OutputLogitStatistics(vocab_size=rows + 1).setup(None, module, "fit")
        taken = OutputLogitStatistics(vocab_size=rows)
        taken.setup(None, module, "fit")  # the head's own width is taken
        taken.teardown(None, None, "fit")
    for kwargs, match in (({"every_n_steps": 0}, "every_n_steps=0"), ({"source": "logits"}, "source='logits'"),
                          ({"chunk_rows": 0}, "chunk_rows=0"), ({"vocab_size": -3}, "vocab_size=-3"),
                          ({"head_pattern": None}, "head_pattern=None")):
        with pytest.raises(ConfigError, match=match):
            OutputLogitStatistics(**kwargs)
