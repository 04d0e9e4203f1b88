"""Evaluation scores: parity with rouge-score and bert-score, perplexity conventions, sampling, eval.json, bad input."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from lnstab.errors import LNStabError  # noqa: E402
from lnstab.evaluation import evaluate_model, select_windows, write_eval_json  # noqa: E402
from lnstab.evaluation import metrics as text_metrics  # noqa: E402
from lnstab.model import GPT, GPTConfig  # noqa: E402
from lnstab.tokenizer import EOT_TOKEN  # noqa: E402

PREDS = [
    "The cats were running quickly across the garden.",
    "A stock market rally lifted shares of banks on Tuesday",
    "",
    "completely unrelated words here",
]
REFS = [
    "The cat runs quickly across gardens.",
    "Shares of banks rose on Tuesday as the stock market rallied",
    "something",
    "the model predicted these words",
]


def test_rouge_equals_rouge_score_directly() -> None:
    from rouge_score import rouge_scorer

    ref_scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    ours = text_metrics.rouge_scores(PREDS, REFS)
    for i, (p, r) in enumerate(zip(PREDS, REFS, strict=True)):
        s = ref_scorer.score(r, p)
        for k in ("rouge1", "rouge2", "rougeL"):
            assert ours[k][i] == pytest.approx(s[k].fmeasure, abs=1e-6)
    assert ours["rouge1"][0] > ours["rouge1"][3]  # the stemmer matches cats/cat, running/runs
    assert 0 < ours["rouge1"][0] < 1


def test_bertscore_equals_bert_score_directly() -> None:
    import bert_score

    model = text_metrics.default_bertscore_model()
    preds, refs = [p for p in PREDS if p], [r for p, r in zip(PREDS, REFS, strict=True) if p]
    p, r, f = bert_score.score(preds, refs, model_type=model, num_layers=6)
    ours = text_metrics.bertscore_scores(preds, refs, model=None, num_layers=6)
    torch.testing.assert_close(torch.tensor(ours["bertscore_precision"]), p, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(ours["bertscore_recall"]), r, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(ours["bertscore_f1"]), f, atol=1e-6, rtol=0)
    assert len(set(ours["bertscore_f1"])) == len(preds)  # distinct pairs, distinct scores
    # The scorer is loaded once per (model, layers, device, batch size).
    assert text_metrics.load_bertscore(None, 6) is text_metrics.load_bertscore(model, 6)


def test_bertscore_of_an_empty_prediction_is_zero(capsys) -> None:
    # bert-score 0.3.13 raises on empty sentences under transformers 5; lnstab restores its documented 0 score.
    ours = text_metrics.bertscore_scores(PREDS, REFS)
    assert "Empty candidate" not in capsys.readouterr().err  # bert-score's print; FinalEvaluation counts them instead
    assert [ours[k][2] for k in ("bertscore_precision", "bertscore_recall", "bertscore_f1")] == [0.0, 0.0, 0.0]
    assert min(ours["bertscore_f1"][i] for i in (0, 1, 3)) > 0


def tiny_model(seed: int = 0, block_size: int = 16) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", vocab_size=50257, block_size=block_size)).eval()


def test_losses_and_perplexity_conventions_match_hand_computation() -> None:
    model = tiny_model()
    tokens = torch.randint(0, 50257, (500,), generator=torch.Generator().manual_seed(3))
    res = evaluate_model(model, tokens, n_samples=6, seed=11, batch_size=4)
    starts = select_windows(tokens, "teacher_forced", 6, 11, 17)
    assert [s["start"] for s in res["samples"]] == starts.tolist()
    losses = []
    for s in starts.tolist():
        x, y = tokens[s : s + 16], tokens[s + 1 : s + 17]
        with torch.no_grad():
            losses.append(F.cross_entropy(model(x[None])[0], y).item())
    for rec, loss in zip(res["samples"], losses, strict=True):
        assert rec["loss"] == pytest.approx(loss, abs=1e-5)
    mean = sum(losses) / len(losses)
    m = res["metrics"]
    assert m["loss"] == pytest.approx(mean, abs=1e-5)
    assert m["ppl_exp_mean_loss"] == pytest.approx(math.exp(mean), rel=1e-5)
    assert m["ppl_mean_seq"] == pytest.approx(sum(math.exp(x) for x in losses) / len(losses), rel=1e-5)
    assert m["ppl_mean_seq"] > m["ppl_exp_mean_loss"]  # Jensen: the conventions differ when losses differ
    assert res["n_samples"] == 6 and res["protocol"] == "teacher_forced"
    assert res["bertscore"]["num_layers"] == 6 and "minilm" in res["bertscore"]["name"]


def test_teacher_forced_texts_are_the_argmax_and_the_shifted_targets() -> None:
    from lnstab.tokenizer import gpt2_encoding

    model = tiny_model(1)
    tokens = torch.randint(0, 50257, (300,), generator=torch.Generator().manual_seed(4))
    res = evaluate_model(model, tokens, n_samples=2, seed=5, batch_size=2)
    enc = gpt2_encoding()
    for rec in res["samples"]:
        s = rec["start"]
        with torch.no_grad():
            pred = model(tokens[None, s : s + 16])[0].argmax(-1).tolist()
        assert rec["prediction"] == enc.decode(pred)
        assert rec["reference"] == enc.decode(tokens[s + 1 : s + 17].tolist())


def test_generation_windows_stay_inside_one_document_and_are_seeded() -> None:
    doc = torch.arange(100, 120)
    tokens = torch.cat([doc, torch.tensor([EOT_TOKEN]), torch.arange(200, 205), torch.tensor([EOT_TOKEN]), doc])
    starts = select_windows(tokens, "generation", 50, seed=0, window=12)
    for s in starts.tolist():
        assert EOT_TOKEN not in tokens[s : s + 12].tolist()
    assert torch.equal(starts, select_windows(tokens, "generation", 50, seed=0, window=12))
    assert not torch.equal(starts, select_windows(tokens, "generation", 50, seed=1, window=12))
    with pytest.raises(LNStabError, match="zero samples"):
        select_windows(tokens, "generation", 3, seed=0, window=21)  # no document holds 21 tokens


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_samples=0), r"n_samples=0 is not allowed"),
        (dict(protocol="beam"), r"protocol='beam' is not allowed; choose one of"),
        (dict(bertscore_model="/no/such/dir"), r"bertscore_model='/no/such/dir' is not a directory"),
        (dict(bertscore_model="lnstab-test/no-such-model"), r"bertscore_model='lnstab-test/no-such-model' could not"),
        (dict(protocol="generation", prompt_tokens=10, new_tokens=10), r"prompt_tokens \+ new_tokens = 20"),
        (dict(block_size=64), r"block_size=64 is not allowed"),
    ],
)
def test_bad_input_is_one_line_error(kwargs, match) -> None:
    tokens = torch.randint(0, 50257, (200,))
    with pytest.raises(LNStabError, match=match) as info:
        evaluate_model(tiny_model(), tokens, **kwargs)
    assert "\n" not in str(info.value)


def test_token_ids_beyond_the_model_vocabulary_are_an_error() -> None:
    model = GPT(GPTConfig.preset("tiny", vocab_size=100, block_size=16))
    with pytest.raises(LNStabError, match=r"validation tokens hold id 150, .* \[0, vocab_size=100\)"):
        evaluate_model(model, torch.tensor([1, 2, 150] * 20), n_samples=2)


def test_too_few_tokens_is_zero_samples_error() -> None:
    with pytest.raises(LNStabError, match="zero samples") as info:
        evaluate_model(tiny_model(), torch.arange(10), n_samples=3)
    assert "\n" not in str(info.value)


def test_eval_json_is_never_overwritten(tmp_path) -> None:
    (tmp_path / "eval.json").write_text("precious")
    first = write_eval_json(tmp_path, {"metrics": {"loss": 1.0}}, stage="fit")
    second = write_eval_json(tmp_path, {"metrics": {"loss": 2.0}})
    assert (tmp_path / "eval.json").read_text() == "precious"
    assert first.name == "eval-1.json" and second.name == "eval-2.json"
    assert json.loads(first.read_text()) == {"metrics": {"loss": 1.0}, "stage": "fit"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-1.json", "eval-2.json", "eval.json"]  # no temp left


def test_loading_the_bertscore_model_draws_no_progress_bar(capfd) -> None:
    """Every fit's final evaluation wrote transformers' 'Loading weights' bar, cursor codes and all, into its log."""
    import transformers

    bars = transformers.utils.logging
    before = bars.is_progress_bar_enabled()  # another test in this process may have switched them off
    bars.enable_progress_bar()
    try:
        text_metrics._scorer.cache_clear()
        capfd.readouterr()
        text_metrics.load_bertscore()
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "\x1b[A" not in err, err
        assert bars.is_progress_bar_enabled()  # given back as it was
    finally:
        if not before:
            bars.disable_progress_bar()


def test_an_error_a_dataloader_worker_raised_is_its_own_one_line() -> None:
    from lnstab.errors import one_line

    worker = LNStabError("Caught LNStabError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                         "last):\n  File \"w.py\", line 3, in f\n    raise LNStabError(\"x\")\n"
                         "lnstab.errors.LNStabError: block_size=128 x batch_size=8 is longer than the data\n")
    assert one_line(worker) == "block_size=128 x batch_size=8 is longer than the data"
    assert one_line(LNStabError("two\nlines")) == "two lines"
