"""Wall time of lnstab's evaluation against the reference packages called directly on the same texts.

Two ratios (goal ≤ 1.2×), best of ``--repeats`` runs each, both with the BERTScore model already loaded:

* ``scoring``: :func:`lnstab.evaluation.metrics.rouge_scores` + :func:`~.bertscore_scores` against
  ``rouge_score.RougeScorer`` in a loop + one batched ``bert_score.BERTScorer.score`` on the same texts.
* ``end to end``: :func:`lnstab.evaluation.evaluate_model` (teacher_forced) against a hand-written loop that does
  the same work (forward, argmax, decode, the two reference packages).

Also printed once: a cold ``bert_score.score`` call (it loads the model each call) against lnstab's cached scorer.
The validation text is the docstrings of the standard library (offline, deterministic). Run::

    HF_HUB_OFFLINE=1 python benchmarks/bench_eval.py --n_samples 64 --block_size 128
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lnstab.evaluation import evaluate_model, select_windows  # noqa: E402
from lnstab.evaluation import metrics as text_metrics  # noqa: E402
from lnstab.model import GPT, GPTConfig  # noqa: E402
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding  # noqa: E402


def stdlib_tokens(min_tokens: int) -> torch.Tensor:
    """GPT-2 tokens of standard-library module docstrings, one document each, until ``min_tokens``."""
    enc, ids = gpt2_encoding(), []
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith("_") or len(ids) >= min_tokens:
            continue
        try:
            doc = importlib.import_module(info.name).__doc__
        except Exception:  # noqa: BLE001 - some modules do not import here; skip them
            continue
        if doc:
            ids += enc.encode_ordinary(doc) + [EOT_TOKEN]
    return torch.tensor(ids)


def best(fn, repeats: int) -> tuple[float, object]:  # noqa: ANN001
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from bert_score import BERTScorer
    from bert_score import score as bert_score_fn
    from rouge_score import rouge_scorer

    torch.manual_seed(0)
    tokens = stdlib_tokens(20 * args.block_size * 4)
    model = GPT(GPTConfig.preset("mini", vocab_size=50257, block_size=args.block_size)).to(args.device).eval()
    bs_model = text_metrics.default_bertscore_model()
    kw = dict(n_samples=args.n_samples, seed=0, batch_size=args.batch_size, bertscore_device=args.device)
    evaluate_model(model, tokens, **kw)  # warm: loads lnstab's cached scorer
    ref_bert = BERTScorer(model_type=bs_model, num_layers=6, device=args.device)  # the reference, loaded once

    t_ours, res = best(lambda: evaluate_model(model, tokens, **kw), args.repeats)
    preds = [s["prediction"] for s in res["samples"]]
    refs = [s["reference"] for s in res["samples"]]

    def reference_scoring() -> tuple:
        rs = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        rouge = [rs.score(r, c) for c, r in zip(preds, refs, strict=True)]
        return rouge, ref_bert.score(preds, refs, batch_size=64)

    def our_scoring() -> tuple:
        return text_metrics.rouge_scores(preds, refs), text_metrics.bertscore_scores(preds, refs, device=args.device)

    @torch.no_grad()
    def reference_end_to_end() -> tuple:
        enc = gpt2_encoding()
        starts = select_windows(tokens, "teacher_forced", args.n_samples, 0, args.block_size + 1)
        w = torch.stack([tokens[s : s + args.block_size + 1] for s in starts.tolist()]).to(args.device)
        cands, targets, losses = [], [], []
        for b in range(0, len(w), args.batch_size):
            x, y = w[b : b + args.batch_size, :-1], w[b : b + args.batch_size, 1:]
            logits = model(x).float()
            losses += F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1).tolist()
            cands += [enc.decode(row) for row in logits.argmax(-1).tolist()]
            targets += [enc.decode(row) for row in y.tolist()]
        rs = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        rouge = [rs.score(r, c) for c, r in zip(cands, targets, strict=True)]
        return losses, rouge, ref_bert.score(cands, targets, batch_size=64)

    t_ref_score, _ = best(reference_scoring, args.repeats)
    t_our_score, _ = best(our_scoring, args.repeats)
    t_ref_e2e, _ = best(reference_end_to_end, args.repeats)
    t0 = time.perf_counter()
    bert_score_fn(preds, refs, model_type=bs_model, num_layers=6, device=args.device)
    t_cold = time.perf_counter() - t0

    print(f"device={args.device} samples={args.n_samples} block_size={args.block_size} repeats={args.repeats}")
    for name, ours, ref in (("scoring", t_our_score, t_ref_score), ("end to end", t_ours, t_ref_e2e)):
        print(f"{name:<11} lnstab {ours:7.3f}s  reference {ref:7.3f}s  ratio {ours / ref:.2f}x  (goal <= 1.2x)")
    print(f"bert_score.score cold (loads its model each call) {t_cold:.3f}s; lnstab cached scoring {t_our_score:.3f}s")


if __name__ == "__main__":
    main()
