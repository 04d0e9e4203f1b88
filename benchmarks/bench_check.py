"""A card's wall time: ``lnstab check`` as it was before issue 19 against as it is, for an lnstab-family model and for
a factory model of the same size, side by side in one run; prints each card's wall time and the ratio old / new.

"Before" is the source tree at ``--baseline`` (the commit before issue 19's work), extracted with ``git archive`` into
a temporary directory, callbacks and datamodules included, and run with ``PYTHONPATH`` pointing there; "now" is this
checkout. Both are whole ``lnstab check`` processes (start-up, data, every stress run, figures) at the check's default
shape and protocol: 4 × 128, context 128, the ladder 1e-3, 1e-2, 1e-1 × seeds 0, 1, 30 steps of 8 × 64 tokens, 18 runs
each, on the OpenWebText sample when it is found (else the synthetic stream). The lnstab-family model is OLMo 2's
output norm (``--model.norm_placement output``), which is neither reference. The factory model is a 4 × 128 Pre-LN
GPT with every norm replaced by DyT, written with ``torch.nn`` only (:func:`dyt_lm`); it takes ``vocab_size``, so the
check may build it with its protocol vocabulary. Goal: a card ≤ 60 s wall on 2 cores.

Issue 39's cards, now only (``--no-before``): ``factory-own`` is the same factory without a ``vocab_size`` argument
(:func:`dyt_lm_own`), so the check trains GPT-2's 50,257-wide head, and the line printed after the pair is its wall
time over the factory's; ``--tier proxy`` makes each card at the proxy tier (docs/proxy's shape and ladder, 16 runs a
subject), which the check before issue 19 does not have. ``--warm`` makes each card a second time, reusing the first
card's reference runs (``lnstab.check.cache``), and prints the first card's time over the second's.

    python benchmarks/bench_check.py                       # both subjects, old and new (~15 min on a shared 2-core CPU)
    python benchmarks/bench_check.py --only lnstab --data ../shared/data/openwebtext/owt-sample-900.jsonl.gz
    python benchmarks/bench_check.py --no-before --only factory,factory-own --data ...   # the cost of no vocab_size
    python benchmarks/bench_check.py --no-before --only lnstab --tier proxy --data ...   # a proxy-tier card
    python benchmarks/bench_check.py --no-before --only lnstab --warm --data ...   # a first card, then one reusing
                                                                                  # its reference runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "e708bed64dc25948ed0ceac5c22ac8139d68f1ab"  # main before issue 19 (lnstab check as issue 16 left it)
SAMPLE = ROOT.parent / "shared" / "data" / "openwebtext" / "owt-sample-900.jsonl.gz"
# A design that is neither reference, so its card has 18 runs like the factory's (6 checked, 6 + 6 references).
SHAPE = ["--model.preset", "mini", "--model.block_size", "128", "--model.norm_placement", "output"]
FACTORY = ["--factory", "bench_check:dyt_lm", "--layer-pattern", r"blocks\.(\d+)$"]
SUBJECTS = {"lnstab": SHAPE, "factory": FACTORY, "factory-own": ["--factory", "bench_check:dyt_lm_own", *FACTORY[2:]]}
# At the proxy tier the tier gives lnstab's GPT its shape (2 x 128, lnstab/check/tiers.yaml); a preset would win over it
# (a 4-layer card, twice the work: 2,234 s on 2 idle cores, measured so before this line).
PROXY_SUBJECTS = {**SUBJECTS, "lnstab": ["--model.norm_placement", "output"]}
PROXY_GOAL_S = 20 * 60  # issue 39: a proxy-tier card within 20 minutes on 2 cores


class DyT(nn.Module):
    """``γ·tanh(α·x) + β`` (Zhu et al. 2025) in place of a LayerNorm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), 0.5))
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class Block(nn.Module):
    """Pre-norm attention and MLP with DyT norms."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = DyT(width), DyT(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # True: may not attend
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]  # (B, T, C)
        return x + self.mlp(self.norm2(x))


class DyTLM(nn.Module):
    """A user's own 4 × 128 GPT with every LayerNorm replaced by DyT: token ids (B, T) → logits (B, T, V)."""

    def __init__(self, vocab_size: int = 50257, width: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = DyT(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V)


def dyt_lm(vocab_size: int = 50257) -> nn.Module:
    """The factory ``lnstab check --factory bench_check:dyt_lm`` calls (with ``vocab_size`` where it may)."""
    return DyTLM(vocab_size)


def dyt_lm_own() -> nn.Module:
    """The same model from a factory that takes no ``vocab_size``: the check trains its 50,257-wide head."""
    return DyTLM(50257)


def baseline_tree(commit: str, where: Path) -> Path:
    """The source tree at ``commit`` as an importable ``lnstab`` package (callbacks and datamodules inside it)."""
    archive = where / "tree.tar"
    with archive.open("wb") as handle:
        subprocess.run(["git", "archive", "--format=tar", commit, "lnstab", "callbacks", "datamodules"], cwd=ROOT,
                       stdout=handle, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(where / "src", filter="data")
    src = where / "src"
    (src / "callbacks").rename(src / "lnstab" / "callbacks")
    (src / "datamodules").rename(src / "lnstab" / "datamodules")
    return src


def card(args: list[str], out: Path, pythonpath: list[str], cache: Path) -> dict:
    """One whole ``lnstab check`` process; its wall seconds, exit code and verdict. It runs in ``out``'s parent, not
    in this checkout, whose ``lnstab/`` would otherwise shadow ``pythonpath`` (``python -c`` puts the working
    directory first on ``sys.path``). Its reference runs are kept in ``cache`` (the check before issue 19 keeps none),
    empty for the first card of a subject, so that card trains them as a user's first card does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "HF_HUB_OFFLINE": "1",
           "LNSTAB_CHECK_CACHE": str(cache)}
    code = ("import sys, lnstab; print('lnstab from', lnstab.__file__, file=sys.stderr); from lnstab.cli import main; "
            "sys.exit(main())")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "check", *args, "--no-progress", "--out", str(out)], env=env,
                          cwd=out.parent, capture_output=True, text=True)
    source = next((line.split(" ", 2)[2] for line in done.stderr.splitlines() if line.startswith("lnstab from")), "?")
    if not source.startswith(pythonpath[0]):
        raise SystemExit(f"the check ran lnstab from {source}, not from {pythonpath[0]}")
    wall = time.perf_counter() - started
    report = out / "report.json"
    verdict = json.loads(report.read_text())["status"] if report.is_file() else f"none ({done.stderr[-300:]})"
    return {"wall": wall, "exit": done.returncode, "verdict": verdict}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default=BASELINE, help="Commit of the 'before' check.")
    p.add_argument("--data", default=str(SAMPLE) if SAMPLE.is_file() else None, help="Text for --data.path.")
    p.add_argument("--only", default="lnstab,factory",
                   help=f"Comma-separated subjects, of {', '.join(SUBJECTS)} (default: lnstab,factory).")
    p.add_argument("--tier", choices=("quick", "proxy"), default="quick", help="The tier of the 'now' cards.")
    p.add_argument("--no-before", action="store_true", help="Only the check as it is now (implied by --tier proxy).")
    p.add_argument("--warm", action="store_true", help="Make each 'now' card twice: the second reuses the first's "
                   "reference runs (lnstab.check.cache), as a user's second card of that shape does.")
    p.add_argument("--extra", default="", help="More lnstab check arguments for both (e.g. '--steps 6').")
    opts = p.parse_args()
    names = [n for n in opts.only.split(",") if n]
    unknown = [n for n in names if n not in SUBJECTS]
    if unknown or not names:
        p.error(f"--only {opts.only} is not allowed; give a comma-separated list of {', '.join(SUBJECTS)}")
    before = not opts.no_before and opts.tier == "quick"
    data = ["--data.path", str(Path(opts.data).resolve())] if opts.data else ["--data.source", "synthetic"]
    extra = opts.extra.split()
    tier = ["--tier", opts.tier] if opts.tier != "quick" else []
    from bench_model import machine_line

    print(f"# {machine_line(torch.device('cpu'))}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")
    print(f"# before: {opts.baseline[:10] if before else 'not run'}; tier {opts.tier}; "
          f"data: {Path(opts.data).name if opts.data else 'synthetic'}")
    bench_dir = str(Path(__file__).resolve().parent)
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        old_src = baseline_tree(opts.baseline, Path(tmp)) if before else None
        for name in names:
            args = [*(PROXY_SUBJECTS if opts.tier == "proxy" else SUBJECTS)[name], *data, *extra]
            kept = Path(tmp) / f"cache-{name}"
            new = card([*args, *tier], Path(tmp) / f"new-{name}", [str(ROOT), bench_dir], kept)
            walls[name] = new["wall"]
            line = f"{name:11s} now {new['wall']:7.1f} s ({new['verdict']}, exit {new['exit']})"
            if old_src is not None:
                old = card(args, Path(tmp) / f"old-{name}", [str(old_src), bench_dir], kept)
                ratio = old["wall"] / new["wall"] if new["wall"] > 0 else math.nan
                line = (f"{name:11s} before {old['wall']:7.1f} s ({old['verdict']}, exit {old['exit']})   now "
                        f"{new['wall']:7.1f} s ({new['verdict']}, exit {new['exit']})   before/now {ratio:5.2f}x")
            limit = 60 if opts.tier == "quick" else PROXY_GOAL_S
            goal = (f"goal now <= {limit} s: " + ("met" if new["wall"] <= limit else "not met")
                    if new["exit"] in (0, 1) else "no card, no goal")
            print(f"{line}   {goal}; load {os.getloadavg()[0]:.1f}")
            if opts.warm:  # the same card again: its reference runs come from the first one's
                warm = card([*args, *tier], Path(tmp) / f"warm-{name}", [str(ROOT), bench_dir], kept)
                goal = (f"goal <= {limit} s: " + ("met" if warm["wall"] <= limit else "not met")
                        if warm["exit"] in (0, 1) else "no card, no goal")
                print(f"{name:11s} again, references reused {warm['wall']:7.1f} s ({warm['verdict']}, exit "
                      f"{warm['exit']})   first/again {new['wall'] / warm['wall']:5.2f}x   {goal}; "
                      f"load {os.getloadavg()[0]:.1f}")
    if "factory" in walls and "factory-own" in walls:
        print(f"factory without vocab_size / with it: {walls['factory-own'] / walls['factory']:.2f}x wall")


if __name__ == "__main__":
    main()
