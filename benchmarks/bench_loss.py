"""Head + loss (forward and backward) alone: lnstab.loss.lm_head_loss by chunk size against whole-batch logits.

The head dominates a small GPT's step at GPT-2's vocabulary (at 6 × 384 it is ~65 % of the FLOPs), so this isolates
the chunked loss's effect from the rest of the step. Calls take turns so machine drift hits all alike; medians and
the ratio reference / row (> 1: faster) are printed. On a machine that others share, ``--threads 1 --clock cpu``
times the process's own CPU seconds, which other processes do not stretch.

    python benchmarks/bench_loss.py --rows 2048 --chunks 64,128,256,512,2048 --threads 1
    python benchmarks/bench_loss.py --chunks 512 --z-loss 1e-4 --reps 5   # the z-loss's cost in the head pass
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lnstab.loss import DEFAULT_CHUNK_ROWS, lm_head_loss, reference_lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048, help="tokens per step (batch x context)")
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--pad", type=int, default=64)
    ap.add_argument("--chunks", default="64,128,256,512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--z-loss", type=float, default=0.0, help="also time the default chunk size with this z-loss "
                    "coefficient (e.g. 1e-4) and print its ratio to the same chunks without")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the process's CPU time (user + sys), steady on a shared machine with --threads 1")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    padded = (args.vocab + args.pad - 1) // args.pad * args.pad
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.rows, args.width, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(padded, args.width, generator=g)).requires_grad_()
    y = torch.randint(0, args.vocab, (args.rows,), generator=g)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; rows {args.rows}, "
          f"width {args.width}, vocab {args.vocab} padded to {padded}")
    rows = {"whole-batch logits (reference)": lambda: reference_lm_loss(h, w, y, args.vocab)}
    unpadded = w.detach()[: args.vocab].clone().requires_grad_()
    rows["whole-batch logits, unpadded weight"] = lambda: reference_lm_loss(h, unpadded, y, args.vocab)
    for c in map(int, args.chunks.split(",")):
        rows[f"chunked, {c} rows"] = lambda c=c: lm_head_loss(h, w, y, args.vocab, chunk_rows=c)
    plain, with_z = f"chunked, {DEFAULT_CHUNK_ROWS} rows", f"chunked, {DEFAULT_CHUNK_ROWS} rows, z-loss {args.z_loss:g}"
    if args.z_loss:
        rows.setdefault(plain, lambda: lm_head_loss(h, w, y, args.vocab))
        rows[with_z] = lambda: lm_head_loss(h, w, y, args.vocab, z_loss=args.z_loss)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in rows}
    for rep in range(args.reps + 1):
        for label, fn in rows.items():
            t0 = clock()
            fn().backward()
            seconds = clock() - t0
            h.grad = w.grad = unpadded.grad = None
            if rep:
                times[label].append(seconds)
    ref = statistics.median(times["whole-batch logits (reference)"])
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:38s} {med * 1e3:8.1f} ms  ref/row {ref / med:6.3f}  min-max {min(ts) * 1e3:.0f}-"
              f"{max(ts) * 1e3:.0f} ms")
    if args.z_loss:
        ratio = statistics.median(times[with_z]) / statistics.median(times[plain])
        print(f"z-loss / no z-loss, head + loss time: {ratio:.3f}")


if __name__ == "__main__":
    main()
