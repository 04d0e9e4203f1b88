"""Compact and top-K vocabularies and the document-level split (``--data.vocab``, ``--data.val_split documents``):
exact relabelling both ways, UNK counts, disjoint documents in exact numbers, the map recorded in the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lnstab.datamodules import DataError, OpenWebTextDataModule
from lnstab.datamodules.sample import sample_path
from lnstab.datamodules.vocab import VocabMap, compact_map, compact_vocabulary, top_k_map
from lnstab.module import GPTModule
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding

OWT_900 = Path(
    os.environ.get(
        "LNSTAB_OWT_SAMPLE",
        Path(__file__).resolve().parents[1] / ".." / "shared/data/openwebtext/owt-sample-900.jsonl.gz",
    )
)


pytestmark = pytest.mark.usefixtures("offline")  # tests/conftest.py: the hub refused, whatever the environment


def documents_of(tokens: np.ndarray, eot: int) -> list[tuple[int, ...]]:
    """The documents of a token stream in which every document ends with ``eot``."""
    ends = np.flatnonzero(tokens == eot)
    assert len(ends) and ends[-1] == len(tokens) - 1
    return [tuple(d) for d in np.split(tokens, ends[:-1] + 1)]


def split_module(path: Path, **kwargs) -> OpenWebTextDataModule:
    kw = dict(block_size=32, batch_size=4, source="files", path=str(path), val_split="documents", num_workers=0,
              tokenizer_threads=1)
    kw.update(kwargs)
    dm = OpenWebTextDataModule(**kw)
    dm.setup("fit")
    return dm


def test_compact_map_relabels_exactly_and_round_trips() -> None:
    tokens = np.array([50256, 11, 11, 7, 30000, 7, 50256])
    vocab = compact_map(tokens[:4], tokens[4:])
    assert vocab.size == 4 and vocab.unk is None
    assert vocab.apply(tokens).tolist() == [3, 1, 1, 0, 2, 0, 3]  # 7 < 11 < 30000 < 50256
    np.testing.assert_array_equal(vocab.restore(vocab.apply(tokens)), tokens)
    with pytest.raises(ValueError, match="token id 12 is not in the compact vocabulary"):
        vocab.apply(np.array([12]))


def test_the_check_relabels_with_the_shared_map_as_before() -> None:
    # lnstab check's protocol vocabulary: torch.unique's inverse, which is what the check computed before
    tokens = torch.randint(0, 50257, (40, 65), generator=torch.Generator().manual_seed(0))
    relabelled, size = compact_vocabulary(tokens)
    distinct, inverse = torch.unique(tokens, return_inverse=True)
    assert size == distinct.numel() and relabelled.dtype == torch.long
    torch.testing.assert_close(relabelled, inverse.view_as(tokens), rtol=0, atol=0)


def test_top_k_keeps_the_most_frequent_training_tokens_and_one_unk() -> None:
    train = np.array([5, 5, 5, 7, 7, 9, 2, 2, 40])  # counts: 5 x3, 7 x2, 2 x2, 9 x1, 40 x1
    vocab = top_k_map(train, 3)
    assert vocab.kept.tolist() == [2, 5, 7] and vocab.unk == 3 and vocab.size == 4
    assert vocab.apply(train).tolist() == [1, 1, 1, 2, 2, 3, 0, 0, 3]
    assert vocab.apply(np.array([9, 40, 50256, 5])).tolist() == [3, 3, 3, 1]  # unseen and rare ids: UNK
    # ties go to the smaller id; fewer distinct ids than K: unseen ids fill up, so the size is always K + 1
    assert top_k_map(np.array([8, 8, 3, 3, 6]), 1).kept.tolist() == [3]
    assert top_k_map(np.array([4, 4]), 3).kept.tolist() == [0, 1, 4] and top_k_map(np.array([4]), 3).size == 4
    again = VocabMap.from_dict(json.loads(json.dumps(vocab.as_dict())))
    assert again.as_dict() == vocab.as_dict()


def test_document_split_is_disjoint_and_exact_and_vocab_full_keeps_gpt2_ids(tmp_path) -> None:
    docs = [f"Document number {i}: " + "word " * (i + 3) for i in range(10)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = split_module(path, val_documents=3, block_size=8)
    val, train = dm.validation_tokens().numpy(), dm.train_dataset().tokens
    val_docs, train_docs = documents_of(val, EOT_TOKEN), documents_of(train, EOT_TOKEN)
    assert (len(val_docs), len(train_docs)) == (3, 7) == (dm.validation_documents, dm._train_docs)
    assert not set(val_docs) & set(train_docs)
    enc = gpt2_encoding()
    assert [enc.decode(list(d[:-1])) for d in val_docs] == docs[:3]  # validation: the first documents, whole
    assert sorted(enc.decode(list(d[:-1])) for d in train_docs) == sorted(docs[3:])
    assert split_module(path, val_documents=0.2, block_size=8).validation_documents == 2  # 0.2 of 10 documents
    # jsonargparse on Python 3.12 hands `3` for `int | float` over as 3.0: the same count, recorded as an int
    as_float = split_module(path, val_documents=3.0, block_size=8)
    assert as_float.validation_documents == 3 and type(as_float.hparams.val_documents) is int
    assert torch.equal(as_float.validation_tokens(), dm.validation_tokens())
    with pytest.raises(DataError, match="--data.val_documents 10 is not allowed for data of 10 documents") as info:
        split_module(path, val_documents=10, block_size=8)
    assert "\n" not in str(info.value)


def test_top_k_module_relabels_counts_unk_and_records_the_map() -> None:
    path = sample_path()
    full = split_module(path, val_documents=25)
    dm = split_module(path, val_documents=25, vocab="top_k", vocab_top_k=255)
    vocab = dm.vocab_map
    assert vocab.size == 256 == dm.token_id_limit() and dm.state_dict()["vocab"] == vocab.as_dict()
    raw_train, raw_val = full.train_dataset().tokens, full.validation_tokens().numpy()
    train, val = dm.train_dataset().tokens, dm.validation_tokens().numpy()
    # the kept ids are the 255 most frequent training ids, counted independently here
    ids, counts = np.unique(raw_train, return_counts=True)
    top = set(ids[np.lexsort((ids, -counts))][:255].tolist())
    assert set(vocab.kept.tolist()) == top
    for raw, mapped in ((raw_train, train), (raw_val, val)):
        assert int((mapped == 255).sum()) == int((~np.isin(raw, list(top))).sum())  # UNK count, exactly
        kept = mapped != 255
        np.testing.assert_array_equal(vocab.restore(mapped[kept]), raw[kept])  # exact round trip of kept tokens
    compact = split_module(path, val_documents=25, vocab="compact")
    distinct = np.unique(np.concatenate([raw_train, raw_val]))
    assert compact.vocab_map.size == len(distinct) == compact.token_id_limit()
    np.testing.assert_array_equal(compact.vocab_map.restore(compact.train_dataset().tokens), raw_train)


def test_the_model_vocab_must_match_and_the_map_lands_in_the_run_dir(tmp_path) -> None:
    def fit(vocab_size: int, run: Path) -> None:
        dm = OpenWebTextDataModule(block_size=32, batch_size=4, source="files", path=str(sample_path()),
                                   val_split="documents", val_documents=25, vocab="top_k", vocab_top_k=127,
                                   num_workers=0, tokenizer_threads=1)
        model = GPTModule(preset="tiny", vocab_size=vocab_size, block_size=32, warmup_steps=1, lr_decay_steps=2)
        logger = pl.loggers.TensorBoardLogger(str(run), name="", version="")
        pl.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, logger=logger,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, dm)

    fit(128, tmp_path / "ok")
    recorded = json.loads((tmp_path / "ok" / "vocab.json").read_text())
    assert recorded["kind"] == "top_k" and recorded["size"] == 128 and recorded["unk"] == 127
    assert len(recorded["kept"]) == 127
    with pytest.raises(DataError, match=r"model.vocab_size=50257 is not allowed with --data.vocab top_k: .* 128 ids"):
        fit(50257, tmp_path / "bad")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab="top_k", vocab_top_k=10), "--data.vocab top_k is not allowed with --data.val_split head"),
        (dict(val_split="documents", val_documents=5, vocab="top_k"), "data.vocab_top_k=None"),
        (dict(val_split="documents", val_documents=0), "--data.val_documents 0 is not allowed"),
        (dict(val_split="documents", val_documents=1.5), "--data.val_documents 1.5 is not allowed"),
        (dict(val_split="documents"), "--data.val_documents None is not allowed"),
        (dict(val_documents=5), "--data.val_documents 5 is not used with --data.val_split head"),
        (dict(val_split="documents", val_documents=5, vocab_top_k=9), "--data.vocab_top_k 9 is not used"),
        (dict(vocab="tiny"), "data.vocab='tiny'"),
        (dict(val_split="random"), "data.val_split='random'"),
    ],
)
def test_bad_split_and_vocab_options_are_one_line(kwargs: dict, match: str, tmp_path) -> None:
    with pytest.raises(DataError, match=match) as info:
        OpenWebTextDataModule(source="files", path=str(tmp_path / "x.jsonl"), **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not OWT_900.is_file(), reason=f"OpenWebText sample {OWT_900} is absent")
def test_the_proxy_split_of_the_900_document_sample_is_810_and_90() -> None:
    dm = split_module(OWT_900, block_size=128, val_documents=90, vocab="top_k", vocab_top_k=4095)
    assert (dm.validation_documents, dm._train_docs) == (90, 810) and dm.vocab_map.size == 4096
    eot = int(dm.vocab_map.apply(np.array([EOT_TOKEN]))[0])
    assert len(documents_of(dm.validation_tokens().numpy(), eot)) == 90
    assert len(documents_of(dm.train_dataset().tokens, eot)) == 810


def test_the_split_needs_local_text() -> None:
    for source in ("hf", "prepared", "synthetic"):
        with pytest.raises(DataError, match=f"--data.val_split documents is not allowed with --data.source {source}"):
            OpenWebTextDataModule(source=source, path="x" if source == "prepared" else None, val_split="documents",
                                  val_documents=5)
    dm = OpenWebTextDataModule(block_size=32, source="sample", val_split="documents", val_documents=25,
                               num_workers=0, tokenizer_threads=1)  # the packaged sample is local text too
    dm.setup("fit")
    assert dm.validation_documents == 25 and dm._train_docs == 225
