"""Training-step time of lnstab's GPT against Hugging Face's GPT2LMHeadModel of the same shape, same run.

Both models: Pre-LN, biases, tied embeddings, GPT-2 BPE vocabulary, the same batch, AdamW, fp32 or bf16 autocast.
Steps alternate between the two models so drift in machine speed hits both alike; the median of each is reported
and the ratio HF / lnstab (> 1 means lnstab is faster).

    python benchmarks/bench_model.py --preset small --batch 8 --seq 256 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from lnstab.model import GPT, GPTConfig


def step_fn(model: torch.nn.Module, logits_of, dtype: torch.dtype | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = logits_of(model, x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    cfg = GPTConfig.preset(args.preset, block_size=args.seq)
    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    print(f"shape: {args.preset} (L={cfg.n_layer}, d={cfg.n_embd}, V={cfg.vocab_size}), batch {args.batch}x{args.seq},"
          f" torch {torch.__version__}, threads {torch.get_num_threads()}")
    for label, dtype in (("fp32", None), ("bf16-autocast", torch.bfloat16)):
        ours = step_fn(GPT(cfg).train(), lambda m, i: m(i), dtype)
        hf_model = GPT2LMHeadModel(hf_cfg).train()
        theirs = step_fn(hf_model, lambda m, i: m(i).logits, dtype)
        t_ours, t_hf = [], []
        for i in range(args.warmup + args.steps):
            a, b = ours(x, y), theirs(x, y)
            if i >= args.warmup:
                t_ours.append(a)
                t_hf.append(b)
        mo, mh = statistics.median(t_ours), statistics.median(t_hf)
        tok = args.batch * args.seq
        print(f"{label:14s} lnstab {mo * 1e3:8.1f} ms/step ({tok / mo:8.0f} tok/s)   "
              f"HF GPT-2 {mh * 1e3:8.1f} ms/step ({tok / mh:8.0f} tok/s)   ratio HF/lnstab {mh / mo:.3f}")


if __name__ == "__main__":
    main()
