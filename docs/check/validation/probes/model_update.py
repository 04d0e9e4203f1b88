"""Exploratory probe (README.md beside it): DeepNet's model-update measure ‖F(x, θ_t) − F(x, θ_0)‖_F / ‖F(x, θ_0)‖_F
(Wang et al. 2022, §3, Fig. 3), F the last block's output on a fixed batch, in the deep-regime supplement's protocol
(18 layers × 128, no warmup, AdamW 0.9/0.95, weight decay 0.1, clip 1, cosine to 0.1× over the steps, batches of
8 × 64 tokens of the OpenWebText sample on the protocol vocabulary). A plain PyTorch loop with the check's optimiser
settings, schedule and batches (its StressModule and batches()); not part of ``lnstab check``.

With ``--site head`` F is the output head's input instead (after the final norm, an identity for Post-LN and DeepNorm),
where every placement's F is normalised and the references compare; ``--warmup N`` warms up as a stress run does.

Usage: python model_update.py DATA PLACEMENTS LRS STEPS N_LAYER [OUT.json] [--warmup N] [--site block|head]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from lnstab.check.cli import build_parser, make_protocol
from lnstab.check.protocol import load_tokens
from lnstab.check.subjects import lnstab_subject
from lnstab.check.training import Optimisation, StressModule, batches
from lnstab.datamodules.vocab import compact_vocabulary

BATCH, SEQ = 8, 64


def run(tokens: torch.Tensor, vocab: int, placement: str, lr: float, seed: int, optimisation: Optimisation,
        n_layer: int, site: str = "block") -> dict[str, list[float]]:
    """One run's relative model update and training loss after each step, with the stress run's optimiser,
    schedule and batches (:class:`StressModule`, :func:`batches`); F at the last block (``site='block'``) or at the
    head's input (``'head'``)."""
    subject, _ = lnstab_subject({"preset": "mini", "block_size": 128, "n_layer": n_layer,
                                 "norm_placement": placement, "vocab_size": vocab})
    torch.manual_seed(seed)
    model = subject.build().train()
    last: dict[str, torch.Tensor] = {}
    where = model.transformer.h[-1] if site == "block" else model.transformer.ln_f
    where.register_forward_hook(  # a block returns (x, cache)
        lambda m, i, o: last.__setitem__("F", (o[0] if isinstance(o, tuple) else o).detach()))
    held = tokens[-BATCH:, :-1]  # a fixed batch: DeepNet's probe is the model's output on given inputs
    with torch.no_grad():
        model(held)
    f0 = last["F"].clone()
    configured = StressModule(model, lr, optimisation).configure_optimizers()
    opt, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    updates, losses = [], []
    for x, y in itertools.islice(batches(tokens, seed, BATCH), optimisation.steps):
        logits = model(x)  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optimisation.grad_clip)
        opt.step()
        schedule.step()
        losses.append(loss.item())
        with torch.no_grad():
            model(held)
        updates.append(((last["F"] - f0).norm() / f0.norm()).item())
    return {"update": updates, "loss": losses}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("data", "placements", "lrs", "steps", "n_layer"):
        parser.add_argument(name)
    parser.add_argument("out", nargs="?", default="model_update.json")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--site", choices=("block", "head"), default="block")
    args = parser.parse_args(argv)
    data_path, placements, lrs, steps = args.data, args.placements.split(","), args.lrs, int(args.steps)
    n_layer, out_path = int(args.n_layer), args.out
    protocol = make_protocol(build_parser().parse_args(
        ["--data.path", data_path, "--steps", str(steps), "--warmup-steps", str(args.warmup)]), {})
    tokens, _ = load_tokens(protocol, 50257, SEQ, own_vocab=False)
    tokens, vocab = compact_vocabulary(tokens)
    results = {}
    for placement in placements:
        for lr in (float(x) for x in lrs.split(",")):
            for seed in (0, 1):
                key = f"{placement} lr {lr:g} seed {seed}"
                r = results[key] = run(tokens, vocab, placement, lr, seed, protocol.optimisation, n_layer,
                                       args.site)
                u = r["update"]
                print(f"{key}: update after step 1 {u[0]:.3g}, 3 {u[2]:.3g}, 5 {u[4]:.3g}, 10 {u[9]:.3g}, "
                      f"{steps} {u[-1]:.3g}; mean over steps 1-10 {sum(u[:10]) / 10:.3g}; "
                      f"loss over the last 10 steps {sum(r['loss'][-10:]) / 10:.3f}", flush=True)
    with open(out_path, "w", encoding="utf-8") as f:
        shown = [os.path.basename(a) if a == data_path else a for a in argv]  # no path of this machine
        json.dump({"argv": shown, "vocab": vocab, "runs": results}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
