"""Exploratory: DeepNet's model-update measure ||F(x, θ_t) − F(x, θ_0)|| / ||F(x, θ_0)|| (Wang et al. 2022, §3, Fig. 3),
F = the last block's output on a fixed held-out batch, for Post-LN, DeepNorm and Pre-LN in the deep-regime supplement's
protocol (18 layers × 128, no warmup, AdamW 0.9/0.95, wd 0.1, clip 1, cosine to 0.1×, 120 steps, batch 8 × 64 tokens of
the OWT sample on the protocol vocabulary). Plain PyTorch loop with the check's optimiser settings."""
import json
import math
import sys

import torch

from lnstab.check.cli import build_parser, make_protocol
from lnstab.check.protocol import compact_vocabulary, load_tokens
from lnstab.check.subjects import lnstab_subject
from lnstab.module import lr_at

DATA = sys.argv[1]
placements = sys.argv[2].split(",")
lrs = [float(x) for x in sys.argv[3].split(",")]
steps = int(sys.argv[4])
n_layer = int(sys.argv[5])
args = build_parser().parse_args(["--data.path", DATA, "--steps", str(steps), "--warmup-steps", "0"])
protocol = make_protocol(args, {})
seq = 64
tokens, _ = load_tokens(protocol, 50257, seq, own_vocab=False)
tokens, vocab = compact_vocabulary(tokens)
held = tokens[-8:]  # a fixed batch, also in training (as DeepNet's probe: the model's output on given inputs)
torch.set_num_threads(2)
out = {}
for placement in placements:
    for lr in lrs:
        for seed in (0, 1):
            subject, _ = lnstab_subject({"preset": "mini", "block_size": 128, "n_layer": n_layer,
                                         "norm_placement": placement, "vocab_size": vocab})
            torch.manual_seed(seed)
            model = subject.build().train()
            last = {}
            model.transformer.h[-1].register_forward_hook(lambda m, i, o: last.__setitem__("F", o.detach()))
            with torch.no_grad():
                model(held[:, :-1])
            f0 = last["F"].clone()
            decay = [p for p in model.parameters() if p.dim() >= 2]
            rest = [p for p in model.parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                    lr=lr, betas=(0.9, 0.95), eps=1e-8)
            order = torch.randperm(tokens.size(0), generator=torch.Generator().manual_seed(seed))
            data = tokens[order]
            updates, losses = [], []
            for step in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, max_lr=lr, min_lr=0.1 * lr, warmup_steps=0, decay_steps=steps)
                b = data[step * 8:(step + 1) * 8]
                logits = model(b[:, :-1])
                logits = logits[0] if isinstance(logits, tuple) else logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                losses.append(loss.item())
                with torch.no_grad():
                    model(held[:, :-1])
                updates.append(((last["F"] - f0).norm() / f0.norm()).item())
            key = f"{placement} lr{lr:g} seed{seed}"
            out[key] = {"update": updates, "loss": losses}
            pick = lambda i: updates[min(i, steps) - 1]  # noqa: E731
            print(f"{key}: update at step 1 {pick(1):.3g}, 5 {pick(5):.3g}, 10 {pick(10):.3g}, 30 {pick(30):.3g}, "
                  f"end {updates[-1]:.3g}; loss end {sum(losses[-10:]) / 10:.3f}", flush=True)
json.dump(out, open("/tmp/probe/model_update.json", "w"))
