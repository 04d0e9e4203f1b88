"""Evaluation of real models: a memorised text scores ROUGE ≈ 1; two DDP processes equal one process."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from support.evaluation import assert_same_evaluation

from lnstab.evaluation import evaluate_model  # noqa: E402
from lnstab.model import GPT, GPTConfig  # noqa: E402
from lnstab.tokenizer import gpt2_encoding  # noqa: E402

VOCAB = 1024  # GPT-2 ids below 1024 only, so a tiny model trains in seconds and its ids still decode as GPT-2 BPE
BLOCK = 32


def whole_word_ids(n: int = 30) -> list[int]:
    """``n`` distinct GPT-2 tokens below ``VOCAB`` that are whole words with a leading space (' the', ' and', …)."""
    enc = gpt2_encoding()
    words = [i for i in range(256, VOCAB) if (w := enc.decode([i])).startswith(" ") and w[1:].isalpha() and len(w) > 3]
    return words[:n]


DOC = whole_word_ids()
EOT = VOCAB - 1  # the model's vocabulary is small: its last id separates the documents (evaluate's eot_token)
TEXT = gpt2_encoding().decode(DOC)


def memorised_model(steps: int = 150) -> tuple[GPT, torch.Tensor]:
    """A tiny GPT trained in plain torch on one text repeated (documents split by EOT) until it reproduces it."""
    stream = torch.tensor((DOC + [EOT]) * 12)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=BLOCK))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ix = torch.randint(stream.numel() - BLOCK, (8,), generator=g)
        x = torch.stack([stream[i : i + BLOCK] for i in ix])  # (8, T)
        y = torch.stack([stream[i + 1 : i + 1 + BLOCK] for i in ix])  # (8, T)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval(), stream


@pytest.fixture(scope="module")
def memorised() -> tuple[GPT, torch.Tensor]:
    return memorised_model()


def test_teacher_forced_on_a_memorised_text_gives_rouge_one(memorised) -> None:
    model, stream = memorised
    res = evaluate_model(model, stream, n_samples=8, seed=0, batch_size=4)
    m = res["metrics"]
    assert m["rouge1"] >= 0.95 and m["rouge2"] >= 0.95 and m["rougeL"] >= 0.95
    assert m["bertscore_f1"] >= 0.95
    assert m["loss"] < 0.1 and m["ppl_exp_mean_loss"] < 1.2
    assert all(s["prediction"] == s["reference"] for s in res["samples"])
    assert res["copying"]["rate"] == 0  # it predicts the next word of the text, never the word it reads
    # An untrained model on the same windows: high loss and wrong tokens, and its ROUGE is high all the same: a
    # random tied-embedding GPT predicts its input token, i.e. the reference shifted by one. eval.json says so.
    torch.manual_seed(1)
    fresh = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=BLOCK))
    other = evaluate_model(fresh, stream, n_samples=8, seed=0, batch_size=4)
    assert other["metrics"]["loss"] > 5 and not any(s["prediction"] == s["reference"] for s in other["samples"])
    copying = other["copying"]
    assert copying["rate"] > 0.9 and other["metrics"]["rouge1"] > 0.5
    # the rule's own ROUGE, from the windows alone: the same for both models, below 1 only at the window's two ends
    assert copying["baseline"] == res["copying"]["baseline"] and 0.9 < copying["baseline"]["rouge1"] < 1
    assert evaluate_model(model, stream, protocol="generation", n_samples=2, prompt_tokens=8, new_tokens=4,
                          eot_token=EOT)["copying"] is None


def test_generation_continues_a_memorised_text(memorised) -> None:
    model, stream = memorised
    res = evaluate_model(
        model, stream, protocol="generation", n_samples=4, seed=0, batch_size=2, prompt_tokens=8, new_tokens=12,
        eot_token=EOT,
    )
    assert res["metrics"]["rouge1"] >= 0.95
    for s in res["samples"]:
        assert s["prompt"] + s["reference"] in TEXT  # prompt and true continuation come from one document
        assert s["prediction"] == s["reference"]


def _ddp_worker(rank: int, world: int, port: int, state_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state = torch.load(state_path)
        model = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, block_size=BLOCK))
        model.load_state_dict(state["model"])
        results = [evaluate_model(model, state["stream"], **kw) for kw in ddp_cases()]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def ddp_cases() -> list[dict]:
    return [
        dict(n_samples=5, seed=3, batch_size=2),  # 3 batches on 2 ranks: uneven, one padding batch
        dict(protocol="generation", n_samples=5, seed=4, batch_size=2, prompt_tokens=6, new_tokens=10,
             eot_token=EOT, greedy=False, temperature=1.5, top_k=50),
    ]


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(memorised, tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    model, stream = memorised
    state_path = str(tmp_path / "state.pt")
    torch.save({"model": model.state_dict(), "stream": stream}, state_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, state_path, str(tmp_path)), nprocs=2, join=True)
    single = [evaluate_model(model, stream, **kw) for kw in ddp_cases()]
    single = json.loads(json.dumps(single))  # same float/tuple round trip as the workers' files
    for rank in (0, 1):
        ddp = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for a, b in zip(ddp, single, strict=True):
            assert_same_evaluation(a, b)
            assert a["settings"]["world_size"] == 2 and b["settings"]["world_size"] == 1
    assert single[1]["samples"][0]["prediction"] != ""  # sampling ran
