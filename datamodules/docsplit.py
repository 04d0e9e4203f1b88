"""A document-level train/validation split of local text (``--data.val_split documents``): whole documents on
each side, none in both, every document tokenized once and held in memory."""

from __future__ import annotations

import numpy as np

from lnstab.datamodules.text import DataError, DocStats, DocTokenizer, TextSpec, iter_documents, open_text_stream

VAL_SPLITS = ("head", "documents")


def validation_count(val_documents: int | float, total: int) -> int:
    """Documents validation takes of ``total``: ``val_documents`` itself (an int), or that fraction of ``total``
    (a float in (0, 1)) rounded to the nearest, at least 1.

    Raises:
        DataError: If that leaves no document to train on.
    """
    n = int(val_documents) if isinstance(val_documents, int) else max(1, round(float(val_documents) * total))
    if n >= total:
        raise DataError(
            f"--data.val_documents {val_documents!r} is not allowed for data of {total} documents; it must leave at "
            f"least one to train on (a count below {total}, or a fraction in (0, 1))"
        )
    return n


def split_documents(
    spec: TextSpec, tok: DocTokenizer, val_documents: int | float, stats: DocStats | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(train, validation)`` token arrays, one per document (each ending in EOT), in stream order: validation is
    the first :func:`validation_count` documents, training every later one."""
    docs: list[np.ndarray] = []
    for texts in iter_documents(open_text_stream(spec), spec, stats, batch_docs=256):
        docs += tok.encode(texts)
    n = validation_count(val_documents, len(docs))
    return docs[n:], docs[:n]
