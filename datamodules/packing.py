"""Packing documents into ``block_size + 1`` windows and sharding them over DDP ranks x dataloader workers.

Every dataset here is an ``IterableDataset`` that yields whole batches ``(x, y)`` of shape ``(B, T)``, so the
DataLoader runs with ``batch_size=None`` and batch ``k`` of a rank comes from worker ``k % num_workers`` (PyTorch's
in-order round robin). That makes the position exact and cheap to store: :class:`ShardPlan` turns "this rank has
consumed ``start_batch`` batches" into, for each worker, its shard of the stream and how many of that shard's batches
are already used; workers are rotated so that batch ``start_batch`` of the resumed run comes from the worker (role)
that would have produced it in the uninterrupted run.

Shards: ``num_shards = world_size * num_workers``; shard ``rank * num_workers + role``.

- Streams of documents (``hf``/``files``): document ``i`` of the training stream belongs to shard ``i % num_shards``;
  each shard packs its own documents into windows that overlap by one token (stride ``T``), so every token but a
  shard's last few is a target exactly once per pass and no window is seen twice.
- Token arrays (``prepared``/``synthetic``): the ``(len - 1) // T`` aligned windows are permuted once per pass by a
  generator seeded with ``(seed, pass)``; shard ``s`` takes every ``num_shards``-th window of the permutation.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lnstab.datamodules.text import DataError, DocTokenizer, TextSpec, iter_documents, open_text_stream

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which part of the data this process reads, and how far into it the run already is.

    Args:
        rank: DDP rank.
        world_size: Number of DDP ranks.
        num_workers: DataLoader workers per rank (0 counts as 1: the main process).
        start_batch: Training batches this rank consumed before (from the checkpoint).
    """

    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    start_batch: int = 0

    @property
    def workers(self) -> int:
        """Readers per rank."""
        return max(1, self.num_workers)

    @property
    def num_shards(self) -> int:
        """Readers over all ranks."""
        return self.world_size * self.workers

    def role(self, worker_id: int) -> int:
        """The reader role a worker plays, rotated so the resumed batch order equals the uninterrupted one."""
        return (worker_id + self.start_batch) % self.workers

    def shard(self, worker_id: int) -> tuple[int, int]:
        """``(shard index, batches of that shard already consumed)`` for ``worker_id``."""
        role = self.role(worker_id)
        done = max(0, (self.start_batch - role + self.workers - 1) // self.workers)
        return self.rank * self.workers + role, done

    def current(self) -> tuple[int, int]:
        """:meth:`shard` for the calling DataLoader worker (or the main process)."""
        info = get_worker_info()
        return self.shard(info.id if info is not None else 0)


def windows_of(tokens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(windows, rest)``: consecutive ``block_size + 1`` windows with stride ``block_size``, and the unused tail."""
    n = (len(tokens) - 1) // block_size if len(tokens) > block_size else 0
    if n == 0:
        return np.empty((0, block_size + 1), dtype=tokens.dtype), tokens
    idx = np.arange(n)[:, None] * block_size + np.arange(block_size + 1)  # (n, T+1)
    return tokens[idx], tokens[n * block_size :]


def to_batch(windows: np.ndarray) -> Batch:
    """``(x, y)`` int64 tensors of shape ``(B, T)`` from ``(B, T + 1)`` windows."""
    w = torch.from_numpy(windows.astype(np.int64, copy=False))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def pack_batches(token_chunks: Iterator[np.ndarray], block_size: int, batch_size: int) -> Iterator[np.ndarray]:
    """``(batch_size, block_size + 1)`` window arrays from a stream of token chunks (short tail dropped)."""
    carry: np.ndarray | None = None
    pending: list[np.ndarray] = []
    npending = 0
    for chunk in token_chunks:
        buf = np.concatenate([carry, chunk]) if carry is not None and len(carry) else chunk
        wins, carry = windows_of(buf, block_size)
        if len(wins):
            pending.append(wins)
            npending += len(wins)
        while npending >= batch_size:
            allw = np.concatenate(pending) if len(pending) > 1 else pending[0]
            yield allw[:batch_size]
            pending, npending = [allw[batch_size:]], npending - batch_size


class DocumentStream(IterableDataset):
    """Training batches packed from a text stream (``hf`` or ``files``), sharded by file or by document.

    Args:
        spec: The text source.
        block_size: Tokens per window (a window holds ``block_size + 1``).
        batch_size: Windows per batch.
        plan: Sharding and position.
        skip_docs: Documents at the head of the stream held out for validation.
        head_tokens: Tokens of the last held-out document that validation did not use (validation holds exactly
            ``val_tokens``): training document 0, read by shard 0, before document ``skip_docs``.
        tokenizer: tiktoken encoding name.
        tokenizer_threads: Threads per reader for ``encode_ordinary_batch``.
        passes: Passes over the data; ``None`` repeats forever (training ends at ``max_steps``).
        batch_docs: Documents tokenized together.
        file_sharding: Give each reader whole files (``datasets``' ``IterableDataset.shard``, contiguous blocks) so
            no reader downloads or parses another's data; needs at least ``num_shards`` files and all validation
            documents in the first file. Otherwise every reader parses the stream and keeps document ``i`` when
            ``i % num_shards`` is its shard.
    """

    def __init__(
        self,
        spec: TextSpec,
        block_size: int,
        batch_size: int,
        plan: ShardPlan,
        skip_docs: int = 0,
        head_tokens: np.ndarray | None = None,
        tokenizer: str = "gpt2",
        tokenizer_threads: int = 4,
        passes: int | None = None,
        batch_docs: int = 256,
        file_sharding: bool = False,
    ) -> None:
        self.spec, self.block_size, self.batch_size, self.plan = spec, block_size, batch_size, plan
        self.skip_docs, self.tokenizer, self.tokenizer_threads = skip_docs, tokenizer, tokenizer_threads
        self.passes, self.batch_docs, self.file_sharding = passes, batch_docs, file_sharding
        self.head_tokens = head_tokens if head_tokens is not None and len(head_tokens) else None

    def shard_tokens(self, shard: int, num_shards: int) -> Iterator[np.ndarray]:
        """Token chunks of one shard's documents for one pass, in stream order."""
        tok = DocTokenizer(self.tokenizer, self.tokenizer_threads)
        index = 0
        mine: list[str] = []
        stream = open_text_stream(self.spec)
        by_file = self.file_sharding and num_shards > 1
        if by_file:  # reader `shard` gets a contiguous block of files; block 0 starts with the validation documents
            stream = stream.shard(num_shards, shard, contiguous=True)
        skip = self.skip_docs if shard == 0 or not by_file else 0
        offset = 1 if self.head_tokens is not None and (shard == 0 or not by_file) else 0
        if offset and shard == 0:  # training document 0: the rest of the document validation cut
            yield self.head_tokens
        for texts in iter_documents(stream, self.spec, batch_docs=self.batch_docs):
            for text in texts:
                j = index - skip + offset
                if j >= offset and (by_file or j % num_shards == shard):
                    mine.append(text)
                index += 1
            if len(mine) >= self.batch_docs:
                yield tok.encode_flat(mine)
                mine = []
        if mine:
            yield tok.encode_flat(mine)

    def __iter__(self) -> Iterator[Batch]:
        shard, done = self.plan.current()
        num_shards = self.plan.num_shards
        for p in itertools.count() if self.passes is None else range(self.passes):
            served = 0
            for wins in pack_batches(self.shard_tokens(shard, num_shards), self.block_size, self.batch_size):
                served += 1
                if done > 0:
                    done -= 1
                    continue
                yield to_batch(wins)
            if done >= served > 0:  # passes repeat exactly: skip whole passes without tokenizing them again
                done %= served
            if served == 0:
                raise DataError(
                    f"block_size={self.block_size} x batch_size={self.batch_size} is longer than the data: reader "
                    f"{shard} of {num_shards} got no full batch from {self.spec.describe()} in pass {p}"
                )


class ArrayWindows(IterableDataset):
    """Training batches of aligned windows of a token array (``prepared`` memmap or ``synthetic``), shuffled per pass.

    Args:
        tokens: The token array, or ``None`` when ``path`` names a raw file to memory-map in each reader.
        block_size: Tokens per window.
        batch_size: Windows per batch.
        plan: Sharding and position.
        seed: Seed of the per-pass permutations.
        path: Raw token file (``dtype``), opened lazily with ``np.memmap``.
        dtype: dtype of ``path``.
        passes: Passes over the windows; ``None`` repeats forever.
    """

    def __init__(
        self,
        tokens: np.ndarray | None,
        block_size: int,
        batch_size: int,
        plan: ShardPlan,
        seed: int = 0,
        path: str | None = None,
        dtype: str = "uint16",
        passes: int | None = None,
    ) -> None:
        self.tokens, self.path, self.dtype = tokens, path, dtype
        self.block_size, self.batch_size, self.plan, self.seed, self.passes = block_size, batch_size, plan, seed, passes
        n = len(tokens) if tokens is not None else np.memmap(path, dtype=dtype, mode="r").shape[0]
        self.num_windows = max(0, (n - 1) // block_size)
        self.batches_per_pass = self.num_windows // plan.num_shards // batch_size
        if self.batches_per_pass == 0:
            name = path or "the synthetic stream"
            raise DataError(
                f"block_size={block_size} x batch_size={batch_size} is longer than the data: {name} holds {n} "
                f"tokens, {self.num_windows} windows, fewer than one batch for each of {plan.num_shards} readers"
            )

    def offsets(self, shard: int, p: int) -> np.ndarray:
        """Start offsets of shard ``shard``'s windows in pass ``p`` (length ``batches_per_pass * batch_size``)."""
        perm = np.random.default_rng([self.seed, p]).permutation(self.num_windows)
        return perm[shard :: self.plan.num_shards][: self.batches_per_pass * self.batch_size] * self.block_size

    def __iter__(self) -> Iterator[Batch]:
        shard, done = self.plan.current()
        data = self.tokens if self.tokens is not None else np.memmap(self.path, dtype=self.dtype, mode="r")
        span = np.arange(self.block_size + 1)
        p, start = divmod(done, self.batches_per_pass)
        while self.passes is None or p < self.passes:
            off = self.offsets(shard, p)
            for b in range(start, self.batches_per_pass):
                starts = off[b * self.batch_size : (b + 1) * self.batch_size]
                yield to_batch(data[starts[:, None] + span])  # (B, T+1) gather
            p, start = p + 1, 0
