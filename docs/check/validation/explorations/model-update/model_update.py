"""DeepNet's early model update for Post-LN, DeepNorm and the check's references (see README.md beside this file).

Trains lnstab's GPT on the check's windows as a stress run does (outside Lightning, no instruments), and after every
update measures on a fixed probe the RMS change of the head's input since initialisation. Prints a Markdown table and,
with ``--json``, writes the per-step series. An exploration: it changes no verdict of ``lnstab check``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from lnstab.check.protocol import Protocol
from lnstab.check.runner import load_data
from lnstab.check.subjects import lnstab_subject
from lnstab.check.training import Optimisation, batches
from lnstab.module import lr_at

PLACEMENTS = ("post", "deepnorm", "pre", "peri")
REGIMES = {  # the main set's protocol and deep-regime's (docs/check/validation/README.md)
    "default": {"n_layer": 4, "steps": 30, "warmup": 3, "lrs": (1e-3, 1e-2, 1e-1)},
    "deep": {"n_layer": 18, "steps": 120, "warmup": 0, "lrs": (5e-4, 1e-3)},
}
PROBE = 4  # windows in the fixed probe


def head_input(model: torch.nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """The output head's input on ``probe`` (eval mode, no grad): ``ln_f``'s output, an identity for Post-LN."""
    seen: list[torch.Tensor] = []
    hook = model.transformer.ln_f.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
    finally:
        hook.remove()
        model.train(was_training)
    return seen[0]  # (P, T, C)


def train(placement: str, n_layer: int, tokens: torch.Tensor, vocab: int, lr: float, seed: int, steps: int,
          warmup: int, opt: Optimisation, batch_size: int) -> tuple[list[float], float]:
    """The RMS of h_t − h_0 on the probe after each of ``steps`` updates (index 0: initialisation, 0), and the last
    step's training loss."""
    subject, _ = lnstab_subject({"preset": "mini", "block_size": 128, "n_layer": n_layer,
                                 "norm_placement": placement})
    subject = subject.with_vocab(vocab)
    torch.manual_seed(seed)
    model = subject.build()
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=lr, betas=opt.betas, eps=opt.eps)
    probe = tokens[:PROBE, :-1]
    h0 = head_input(model, probe)
    updates, last = [0.0], math.nan
    for step, (x, y) in enumerate(batches(tokens, seed, batch_size)):
        if step == steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, max_lr=lr, min_lr=lr * opt.min_lr_ratio, warmup_steps=max(1, warmup),
                                decay_steps=steps)
        loss = model(x, y)
        last = loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if opt.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
        h = head_input(model, probe)
        updates.append((h - h0).pow(2).mean().sqrt().item())
    return updates, last


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data.path", dest="data_path", required=True)
    parser.add_argument("--regimes", default="default,deep")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--json", help="Write every series here.")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, dict] = {}
    for regime in args.regimes.split(","):
        spec = REGIMES[regime]
        steps = spec["steps"]
        protocol = Protocol(lrs=spec["lrs"], seeds=tuple(seeds), data_path=args.data_path, measure_every=steps,
                            optimisation=Optimisation(steps=steps, warmup_steps=spec["warmup"]))
        subject, _ = lnstab_subject({"preset": "mini", "block_size": 128})
        data, compacted = load_data(protocol, subject, protocol.seq_len, "protocol")
        vocab = data.vocab["size"]
        opt = protocol.optimisation
        print(f"\n## {regime}: {spec['n_layer']} layers, {steps} steps, warmup {spec['warmup']}, vocabulary {vocab}, "
              f"seeds {seeds}\n")
        print("| placement | lr | update at step 3 | largest, steps 1–10 | at step "
              f"{steps} | final loss |")
        print("|---|---|---|---|---|---|")
        for placement in args.placements.split(","):
            for lr in spec["lrs"]:
                started = time.perf_counter()
                runs = [train(placement, spec["n_layer"], data.tokens, vocab, lr, seed, steps, spec["warmup"], opt,
                              protocol.batch_size) for seed in seeds]
                series = [r[0] for r in runs]
                loss = sum(r[1] for r in runs) / len(runs)
                mean = [sum(s[t] for s in series) / len(series) for t in range(len(series[0]))]
                results.setdefault(regime, {}).setdefault(placement, {})[f"{lr:g}"] = {"update": mean,
                                                                                       "final_loss": loss}
                early = max(mean[1:11])
                print(f"| {placement} | {lr:g} | {mean[3]:.3g} | {early:.3g} | {mean[-1]:.3g} | {loss:.3f} |",
                      flush=True)
                print(f"  ({placement}, lr {lr:g}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if any(not math.isfinite(v) for r in results.values() for p in r.values() for s in p.values()
           for v in s["update"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
