"""Training-step time of lnstab's GPT against Hugging Face's GPT2LMHeadModel (sdpa, fused AdamW), same run.

Every model gets the same batch and the same step (forward, loss, backward, clip 1.0, AdamW, zero_grad). The levers
are added one at a time, each row keeping the ones above it, so each row's change is that lever's effect:

    lnstab, as before   logits for the whole batch, padded columns sliced off, fp32 cross-entropy; foreach AdamW;
                        vocabulary unpadded (50257, the model presets' default)
    + vocab pad 64      embedding/head rows rounded up to 50304 (base.yaml's pad_vocab_multiple: 64)
    + chunked loss      lnstab.loss.lm_head_loss: head and loss in 512-row chunks, gradients formed in the same pass
    + fused AdamW       torch.optim.AdamW(fused=True)
    + compile           torch.compile of the model (only with --compile; its compile time is reported apart)
    Peri-LN (all)       the last row's levers with norm_placement=peri, for the Peri-LN / Pre-LN ratio
    + qk_norm           the last Pre-LN row with qk_norm=True (LayerNorm of q and k per head), for qk_norm / Pre-LN
    + z_loss 1e-4       the last Pre-LN row with z_loss=1e-4 (in the chunked head pass), for z_loss / Pre-LN

Steps take turns model by model so drift in machine speed hits all alike; medians are reported with the ratio of the
reference's step time to each row's (> 1: faster than the reference), and min-max spread so a noisy run shows. On a
machine that others share, ``--threads 1 --clock cpu`` times the process's own CPU seconds, which other processes do
not stretch (with more threads, CPU time counts threads waiting for each other).

    python benchmarks/bench_model.py                      # 6 x 384, context 256, batch 8, fp32 on the CPU
    python benchmarks/bench_model.py --compile --steps 20
    python benchmarks/bench_model.py --only 4,6,7 --steps 5   # Pre-LN, + qk_norm, + z_loss (and the reference)
    python benchmarks/bench_model.py --device cuda --precision bf16-mixed --preset gpt2 --seq 1024 --batch 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lnstab.model import GPT, GPTConfig


def machine_line(device: torch.device) -> str:
    """One line naming the machine: CPU model and vector flags (or the GPU), threads, torch version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name, flags = platform.processor() or "cpu", set()
        with contextlib.suppress(OSError):
            for line in open("/proc/cpuinfo", encoding="utf-8"):
                if line.startswith("model name") and name in ("", "cpu", platform.processor()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
        name += f" [{' '.join(f for f in wanted if f in flags) or 'no avx2'}]"
        name += f", native bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    return f"{name}; torch {torch.__version__}, {torch.get_num_threads()} threads"


class Stepper:
    """One model with its optimizer; ``step(x, y)`` runs a whole training step and returns its seconds."""

    def __init__(self, model: torch.nn.Module, loss_of: Callable, fused: bool, device: torch.device,
                 dtype: torch.dtype | None) -> None:
        self.model, self.loss_of, self.device, self.dtype = model.to(device).train(), loss_of, device, dtype
        kind = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, **kind)
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = clock()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.loss_of(self.model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync()
        return clock() - t0


def lnstab_old(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss as lnstab computed it before: whole-batch logits, slice, fp32 cross-entropy."""
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def lnstab_new(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)


def hf_loss(model: GPT2LMHeadModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None) -> list[tuple[str, Stepper]]:
    def gpt(**kw) -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig.preset(args.preset, block_size=args.seq, **kw))

    cfg = GPTConfig.preset(args.preset, block_size=args.seq)
    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                        n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa")
    rows = [
        ("HF GPT-2 sdpa, fused AdamW (reference)", Stepper(hf, hf_loss, True, device, dtype)),
        ("lnstab, as before", Stepper(gpt(), lnstab_old, False, device, dtype)),
        ("+ vocab pad 64", Stepper(gpt(pad_vocab_multiple=64), lnstab_old, False, device, dtype)),
        ("+ chunked loss", Stepper(gpt(pad_vocab_multiple=64), lnstab_new, False, device, dtype)),
        ("+ fused AdamW", Stepper(gpt(pad_vocab_multiple=64), lnstab_new, True, device, dtype)),
    ]
    if dtype is not None:  # the goal for native bf16: bf16-mixed lnstab >= 1.8x the reference in fp32
        torch.manual_seed(0)
        hf32 = GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa")
        rows.append(("HF GPT-2 in fp32", Stepper(hf32, hf_loss, True, device, None)))
    peri = gpt(pad_vocab_multiple=64, norm_placement="peri")
    if args.compile:
        compiled = gpt(pad_vocab_multiple=64)
        compiled.compile()
        peri.compile()
        rows.append(("+ compile", Stepper(compiled, lnstab_new, True, device, dtype)))
    rows.append(("Peri-LN, same levers", Stepper(peri, lnstab_new, True, device, dtype)))
    for label, option in (("+ qk_norm", dict(qk_norm=True)), ("+ z_loss 1e-4", dict(z_loss=1e-4))):
        model = gpt(pad_vocab_multiple=64, **option)
        if args.compile:
            model.compile()
        rows.append((label, Stepper(model, lnstab_new, True, device, dtype)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--compile", action="store_true", help="add the torch.compile row (compile time reported apart)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice); 1 is the "
                    "stable choice on a machine that others share, where threads wait for each other")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the process's CPU time (user + sys), steady on a shared machine with --threads 1")
    ap.add_argument("--out", default=None, help="folder to write bench_model.json into (ms/step per row)")
    ap.add_argument("--only", default=None, help="comma-separated row numbers to keep (0 = reference, always kept)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else None
    cfg = GPTConfig.preset(args.preset, block_size=args.seq)
    print(f"machine: {machine_line(device)}")
    print(f"shape: {args.preset} (L={cfg.n_layer}, d={cfg.n_embd}, V={cfg.vocab_size}), batch {args.batch}x{args.seq},"
          f" {args.precision}, {args.steps} timed steps after {args.warmup} warm-up, {args.clock} clock")
    rows = build(args, device, dtype)
    if args.only:
        keep = {0, *map(int, args.only.split(","))}
        rows = [r for i, r in enumerate(rows) if i in keep]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    first: dict[str, float] = {}
    for i in range(args.warmup + args.steps):
        for label, stepper in rows:
            seconds = stepper.step(x, y, clock)
            if i == 0:
                first[label] = seconds
            elif i >= args.warmup:
                stepper.times.append(seconds)
    ref = statistics.median(rows[0][1].times)
    tokens = args.batch * args.seq
    print(f"{'':40s} {'ms/step':>9s} {'tok/s':>8s} {'ref/row':>8s} {'min-max ms':>14s}")
    for label, stepper in rows:
        med = statistics.median(stepper.times)
        spread = f"{min(stepper.times) * 1e3:.0f}-{max(stepper.times) * 1e3:.0f}"
        print(f"{label:40s} {med * 1e3:9.1f} {tokens / med:8.0f} {ref / med:8.3f} {spread:>14s}")
        if "compile" in label or ("Peri" in label and args.compile):
            print(f"{'':40s} (first step incl. compile: {first[label]:.1f} s)")
    pre = next((s for lbl, s in rows if lbl in ("+ compile", "+ fused AdamW") and args.compile == (lbl == "+ compile")),
               None)
    for label, name in (("Peri-LN, same levers", "Peri-LN"), ("+ qk_norm", "qk_norm"), ("+ z_loss 1e-4", "z_loss")):
        other = dict(rows).get(label)
        if pre is not None and other is not None:
            ratio = statistics.median(other.times) / statistics.median(pre.times)
            print(f"{name} / Pre-LN step time: {ratio:.3f}")
    fp32 = dict(rows).get("HF GPT-2 in fp32")
    if fp32 is not None and pre is not None:
        print(f"{args.precision} lnstab / fp32 reference speed: "
              f"{statistics.median(fp32.times) / statistics.median(pre.times):.3f} (goal >= 1.8 where bf16 is native)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        result = {label: statistics.median(s.times) * 1e3 for label, s in rows}
        (Path(args.out) / "bench_model.json").write_text(json.dumps({"ms_per_step": result, "args": vars(args)}))


if __name__ == "__main__":
    main()
