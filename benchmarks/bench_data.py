"""Data pipeline benchmark: every figure is a ratio against a reference measured in the same run.

    python benchmarks/bench_data.py [--sample PATH] [--threads N] [--repeat R]

1. tokenize+pack: ``DocTokenizer.encode_flat`` + ``pack_batches`` + ``to_batch`` on the sample's texts, as a fraction
   of raw ``encode_ordinary_batch`` on the same texts with the same threads (goal >= 0.8).
2. prepared windows: ``ArrayWindows`` batches from a ``train.bin`` against nanoGPT's ``get_batch`` (a fresh
   ``np.memmap`` and a Python loop of random windows per batch) (goal >= 1.0).
3. loader vs training: tokens/s the training loader delivers (files source, streamed, 2 workers; and prepared) over the
   tokens/s a training step of the quickstart model consumes on this machine (goal >= 1.0: never the bottleneck).

Without the OpenWebText sample (``LNSTAB_OWT_SAMPLE``) it falls back to generated English-like text.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lnstab.datamodules import OpenWebTextDataModule
from lnstab.datamodules.packing import ArrayWindows, ShardPlan, pack_batches, to_batch
from lnstab.datamodules.text import DocTokenizer
from lnstab.tokenizer import gpt2_encoding

DEFAULT_SAMPLE = Path(__file__).resolve().parents[1] / ".." / "shared/data/openwebtext/owt-sample-900.jsonl.gz"


def load_texts(path: Path) -> list[str]:
    if path.is_file():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]
    rng = random.Random(0)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(200, 2000))) + "." for _ in range(600)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_pair(ref, ours, repeat: int) -> tuple[float, float]:
    """Best-of-``repeat`` times of two functions run alternately, so load from other processes hits both alike."""
    t_ref, t_ours = [], []
    for _ in range(repeat):
        t_ref.append(best(ref, 1))
        t_ours.append(best(ours, 1))
    return min(t_ref), min(t_ours)


def bench_tokenize(texts: list[str], threads: int, repeat: int) -> float:
    enc = gpt2_encoding()
    tok = DocTokenizer("gpt2", threads)
    chunks = [texts[i : i + 256] for i in range(0, len(texts), 256)]

    def raw() -> None:
        for c in chunks:
            enc.encode_ordinary_batch(c, num_threads=threads)

    def ours() -> None:
        for wins in pack_batches((tok.encode_flat(c) for c in chunks), 1024, 8):
            to_batch(wins)

    n_tokens = sum(len(t) for c in chunks for t in enc.encode_ordinary_batch(c, num_threads=threads))
    t_raw, t_ours = best_pair(raw, ours, repeat)
    ratio = t_raw / t_ours
    print(f"[1] tokenize+pack  {n_tokens / t_ours / 1e6:6.2f} M tok/s  vs raw encode_ordinary_batch "
          f"{n_tokens / t_raw / 1e6:6.2f} M tok/s  -> ratio {ratio:.3f} (goal >= 0.8)")  # fmt: skip
    return ratio


def nanogpt_get_batch(path: str, block_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's train.py get_batch (CPU part), verbatim in substance."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


def bench_prepared(tokens: np.ndarray, tmp: Path, repeat: int, n_batches: int = 400) -> float:
    path = tmp / "train.bin"
    np.tile(tokens.astype(np.uint16), max(1, 20_000_000 // len(tokens) + 1)).tofile(path)  # ~40 MB
    block, bsz = 1024, 32

    def ref() -> None:
        for _ in range(n_batches):
            nanogpt_get_batch(str(path), block, bsz)

    ds = ArrayWindows(None, block, bsz, ShardPlan(), seed=0, path=str(path))

    def ours() -> None:
        it = iter(ds)
        for _ in range(n_batches):
            next(it)

    t_ref, t_ours = best_pair(ref, ours, repeat)
    ratio = t_ref / t_ours
    tok = n_batches * bsz * block
    print(f"[2] prepared windows {tok / t_ours / 1e6:6.1f} M tok/s  vs nanoGPT get_batch {tok / t_ref / 1e6:6.1f} "
          f"M tok/s  -> ratio {ratio:.2f} (goal >= 1.0)")  # fmt: skip
    return ratio


def loader_rate(dm: OpenWebTextDataModule, n_batches: int) -> float:
    it = iter(dm.train_dataloader())
    next(it)  # worker start-up and first tokenization excluded
    t0 = time.perf_counter()
    for _ in range(n_batches):
        x, _ = next(it)
    return n_batches * x.numel() / (time.perf_counter() - t0)


def train_rate(block_size: int, batch_size: int, steps: int = 6) -> float:
    from lnstab.module import GPTModule

    model = GPTModule(preset="mini", block_size=block_size, norm_placement="peri")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 50257, (batch_size, block_size))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the quickstart (bf16-mixed)
            loss = model.loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    t = best(step, steps)
    return batch_size * block_size / t


def bench_loader(sample: Path, tokens: np.ndarray, tmp: Path, threads: int) -> float:
    block, bsz = 128, 8  # the quickstart's shapes
    rates = {}
    if sample.is_file():
        dm = OpenWebTextDataModule(block_size=block, batch_size=bsz, source="files", path=str(sample),
                                   val_tokens=65536, num_workers=2, tokenizer_threads=threads)  # fmt: skip
        dm.setup("fit")
        rates["files (streamed, 2 workers)"] = loader_rate(dm, 300)
    prep = tmp / "prep"
    prep.mkdir()
    from lnstab.datamodules.prepared import META_FORMAT, sha256_file

    (tmp / "train.bin").rename(prep / "train.bin")
    tokens[:100_000].astype(np.uint16).tofile(prep / "val.bin")
    splits = {}
    for name in ("train", "val"):
        n = (prep / f"{name}.bin").stat().st_size // 2
        splits[name] = {"file": f"{name}.bin", "tokens": n, "documents": 0, "bytes": 2 * n,
                        "sha256": sha256_file(prep / f"{name}.bin")}  # fmt: skip
    meta = {"format": META_FORMAT, "dtype": "uint16", "tokenizer": "gpt2", "eot": 50256, "splits": splits}
    (prep / "meta.json").write_text(json.dumps(meta))
    dm = OpenWebTextDataModule(block_size=block, batch_size=bsz, source="prepared", path=str(prep), num_workers=2)
    dm.setup("fit")
    rates["prepared (2 workers)"] = loader_rate(dm, 2000)
    need = train_rate(block, bsz)
    worst = min(rates.values()) / need
    for name, r in rates.items():
        print(f"[3] loader {name:28s} {r / 1e3:9.1f} k tok/s  vs training step {need / 1e3:7.1f} k tok/s "
              f"-> ratio {r / need:8.1f} (goal >= 1.0)")  # fmt: skip
    # paper shapes (block 1024 x batch 32 per rank): rates to compare with a GPU's measured step rate
    paper = {}
    dm = OpenWebTextDataModule(block_size=1024, batch_size=32, source="prepared", path=str(prep), num_workers=2)
    dm.setup("fit")
    paper["prepared"] = loader_rate(dm, 200)
    if sample.is_file():
        dm = OpenWebTextDataModule(block_size=1024, batch_size=32, source="files", path=str(sample),
                                   val_tokens=65536, num_workers=2, tokenizer_threads=threads)  # fmt: skip
        dm.setup("fit")
        paper["files (streamed)"] = loader_rate(dm, 120)
    for name, r in paper.items():
        print(f"[3] paper shapes, loader {name:17s} {r / 1e6:6.2f} M tok/s per rank (2 workers on this machine); "
              f"compare with the GPU's tokens/s per rank")  # fmt: skip
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=Path, default=Path(os.environ.get("LNSTAB_OWT_SAMPLE", DEFAULT_SAMPLE)))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = load_texts(a.sample)
    print(f"data: {a.sample if a.sample.is_file() else 'generated text'} ({len(texts)} docs), threads {a.threads}")
    r1 = bench_tokenize(texts, a.threads, a.repeat)
    tokens = DocTokenizer("gpt2", a.threads).encode_flat(texts)
    with tempfile.TemporaryDirectory() as d:
        r2 = bench_prepared(tokens, Path(d), a.repeat)
        r3 = bench_loader(a.sample, tokens, Path(d), a.threads)
    ok = r1 >= 0.8 and r2 >= 1.0 and r3 >= 1.0
    print(
        f"summary: tokenize+pack {r1:.3f}, prepared windows {r2:.2f}, loader/training {r3:.1f} -> "
        f"{'all goals met' if ok else 'a goal is missed'}"
    )


if __name__ == "__main__":
    main()
