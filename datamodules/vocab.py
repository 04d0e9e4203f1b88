"""Smaller vocabularies for small models: GPT-2 token ids relabelled onto the tokens a corpus uses.

One implementation serves the OpenWebText DataModule (``--data.vocab``) and ``lnstab check`` (its protocol
vocabulary, :func:`compact_vocabulary`):

- ``full``: GPT-2's ids as they are.
- ``compact``: an exact relabelling of the distinct tokens that occur, ``0 … V'−1`` in the order of the original ids;
  the text is unchanged, only ids that never occur are gone.
- ``top_k``: the ``K`` most frequent tokens of the *training* tokens (ties: the smaller id first), relabelled
  ``0 … K−1`` in the order of the original ids, and one UNK id ``K`` for every other token: ``K + 1`` ids.

Pure numpy and torch (no Lightning), so ``lnstab check``'s parent process imports it cheaply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

VOCABS = ("full", "compact", "top_k")


@dataclasses.dataclass(frozen=True)
class VocabMap:
    """A relabelling of token ids: new id ``i`` is original id ``kept[i]``; every other id becomes ``unk``.

    Attributes:
        kind: ``compact`` or ``top_k``.
        kept: The original ids kept, ascending (int64).
        unk: The new id of every token not kept (``len(kept)``), or ``None`` when every token is kept (``compact``).
    """

    kind: str
    kept: np.ndarray
    unk: int | None = None

    @property
    def size(self) -> int:
        """Ids of the relabelled vocabulary (the model's ``vocab_size``): kept tokens, plus one UNK if any."""
        return len(self.kept) + (self.unk is not None)

    def table(self, limit: int | None = None) -> np.ndarray:
        """The lookup table ``original id -> new id`` over ``[0, limit)`` (default: one past the largest kept id)."""
        limit = int(self.kept[-1]) + 1 if limit is None and len(self.kept) else int(limit or 0)
        out = np.full(limit, -1 if self.unk is None else self.unk, dtype=np.int64)
        out[self.kept] = np.arange(len(self.kept))
        return out

    def apply(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` relabelled (int64, same shape).

        Raises:
            ValueError: For ``compact``, if ``tokens`` holds an id the map does not know.
        """
        tokens = np.asarray(tokens)
        limit = max(int(tokens.max()) + 1 if tokens.size else 0, int(self.kept[-1]) + 1 if len(self.kept) else 0)
        out = self.table(limit)[tokens]
        if self.unk is None and tokens.size and (out < 0).any():
            bad = int(tokens[out < 0].flat[0])
            raise ValueError(f"token id {bad} is not in the compact vocabulary ({self.size} ids)")
        return out

    def restore(self, ids: np.ndarray) -> np.ndarray:
        """The original ids of relabelled ``ids`` (UNK maps to -1)."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.where(ids < len(self.kept), self.kept[np.minimum(ids, len(self.kept) - 1)], -1)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"kind", "size", "unk", "kept"}``."""
        return {"kind": self.kind, "size": self.size, "unk": self.unk, "kept": [int(i) for i in self.kept]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VocabMap:
        """The map :meth:`as_dict` wrote."""
        return cls(str(d["kind"]), np.asarray(d["kept"], dtype=np.int64), None if d["unk"] is None else int(d["unk"]))


def compact_map(*token_arrays: np.ndarray) -> VocabMap:
    """The ``compact`` map of the distinct ids of ``token_arrays`` together."""
    parts = [np.unique(np.asarray(a)) for a in token_arrays]
    kept = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
    return VocabMap("compact", kept.astype(np.int64))


def top_k_map(train_tokens: np.ndarray, k: int) -> VocabMap:
    """The ``top_k`` map: the ``k`` most frequent ids of ``train_tokens`` (ties: the smaller id), plus UNK ``k``.

    Exactly ``k`` ids are kept (ids that never occur fill up, smallest first, when fewer than ``k`` occur), so the
    vocabulary size, ``k + 1``, is known before the data is read.
    """
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64).ravel(), minlength=k)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then by id
    return VocabMap("top_k", np.sort(order[:k]).astype(np.int64), k)


def compact_vocabulary(tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The windows relabelled onto the distinct tokens they hold (``0 … V'−1`` in the order of the original ids), and
    ``V'``: the protocol vocabulary of ``lnstab check``. The text is the same; only the ids of tokens that never occur
    are gone, so a model with ``V'`` outputs learns the same sequence with a head ``V / V'`` times smaller."""
    vocab = compact_map(tokens.numpy())
    return torch.from_numpy(vocab.apply(tokens.numpy())).to(torch.long), vocab.size
