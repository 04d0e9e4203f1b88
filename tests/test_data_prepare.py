"""``lnstab prepare`` and the ``prepared`` source: same tokens as ``files``, nanoGPT's split, resume, corruption."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lnstab.cli import main as cli_main
from lnstab.datamodules import DataError, OpenWebTextDataModule
from lnstab.datamodules.packing import ShardPlan
from lnstab.datamodules.prepare import prepare
from lnstab.datamodules.prepared import sha256_file
from lnstab.datamodules.text import DocTokenizer, TextSpec, iter_documents, open_text_stream
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding

SAMPLE = Path(
    os.environ.get(
        "LNSTAB_OWT_SAMPLE",
        Path(__file__).resolve().parents[1] / ".." / "shared/data/openwebtext/owt-sample-900.jsonl.gz",
    )
)
needs_sample = pytest.mark.skipif(not SAMPLE.is_file(), reason=f"OpenWebText sample {SAMPLE} is absent")


pytestmark = pytest.mark.usefixtures("offline")  # tests/conftest.py: the hub refused, whatever the environment


@pytest.fixture
def docs_file(tmp_path) -> tuple[Path, list[str]]:
    rng = random.Random(1)
    words = "red green blue cyan magenta yellow black white orange purple".split()
    docs = [f"Doc {i}. " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for i in range(80)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path, docs


def tokens_of(docs: list[str]) -> list[int]:
    enc = gpt2_encoding()
    return [t for d in docs for t in [*enc.encode_ordinary(d), EOT_TOKEN]]


def read_bin(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


@needs_sample
def test_prepare_on_the_sample_gives_the_same_tokens_as_files(tmp_path):
    out = tmp_path / "owt"
    cli_main(["prepare", "--source", "files", "--path", str(SAMPLE), "--out", str(out), "--split_method", "head",
              "--val_tokens", "20000", "--no_progress"])  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    dm = OpenWebTextDataModule(block_size=64, batch_size=4, source="files", path=str(SAMPLE), val_tokens=20000)
    dm.setup("fit")
    val = read_bin(out / "val.bin")
    assert val.astype(np.int64).tolist() == dm.validation_tokens().tolist()
    stream = dm.train_dataset(ShardPlan(), passes=1)
    train = np.concatenate(list(stream.shard_tokens(0, 1)))
    assert np.array_equal(read_bin(out / "train.bin"), train)
    assert meta["tokenizer"] == "gpt2" and meta["dtype"] == "uint16" and meta["eot"] == EOT_TOKEN
    s = meta["splits"]
    assert s["train"]["tokens"] == len(train) and s["val"]["tokens"] == len(val)
    cut = int(val[-1] != EOT_TOKEN)  # validation holds exactly 20000 tokens: its last document continues in train
    assert s["train"]["documents"] + s["val"]["documents"] == 900 - meta["blank_documents"] + cut
    assert s["train"]["documents"] == int((train == EOT_TOKEN).sum())
    assert s["train"]["sha256"] == sha256_file(out / "train.bin") and not (out / ".partial").exists()


def test_nanogpt_split_is_train_test_split_with_seed_2357(docs_file, tmp_path):
    path, docs = docs_file
    meta = prepare(TextSpec("files", str(path)), tmp_path / "p", test_size=0.25, show=False, cache_dir=tmp_path / "c")
    ds = open_text_stream(TextSpec("files", str(path)), streaming=False, cache_dir=str(tmp_path / "c2"))
    parts = ds.train_test_split(test_size=0.25, seed=2357, shuffle=True)  # what nanoGPT's prepare.py calls
    assert read_bin(tmp_path / "p" / "val.bin").tolist() == tokens_of(parts["test"]["text"])
    assert read_bin(tmp_path / "p" / "train.bin").tolist() == tokens_of(parts["train"]["text"])
    assert meta["splits"]["val"]["documents"] == 20 and meta["split"] == {"method": "nanogpt", "test_size": 0.25,
                                                                          "seed": 2357}  # fmt: skip
    assert parts["test"]["text"] != docs[:20]  # shuffled, not the head


def test_interrupted_prepare_resumes_to_identical_files(docs_file, tmp_path, monkeypatch):
    path, _ = docs_file
    spec = TextSpec("files", str(path))
    prepare(spec, tmp_path / "ref", split_method="head", val_tokens=50, batch_docs=8, show=False)
    calls = {"n": 0}
    real = DocTokenizer.encode_flat

    def flaky(self, texts):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(DocTokenizer, "encode_flat", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tmp_path / "out", split_method="head", val_tokens=50, batch_docs=8, show=False)
    assert not (tmp_path / "out" / "meta.json").exists() and not (tmp_path / "out" / "train.bin").exists()
    progress = json.loads((tmp_path / "out" / ".partial" / "progress.json").read_text())
    assert progress["train"]["documents"] == 16 and not progress["train"]["done"]
    prepare(spec, tmp_path / "out", split_method="head", val_tokens=50, batch_docs=8, show=False)
    for name in ("train.bin", "val.bin"):
        assert sha256_file(tmp_path / "out" / name) == sha256_file(tmp_path / "ref" / name)


def test_prepare_never_overwrites(docs_file, tmp_path, capsys):
    path, _ = docs_file
    spec = TextSpec("files", str(path))
    out = tmp_path / "out"
    prepare(spec, out, split_method="head", val_tokens=50, show=False)
    before = {p.name: sha256_file(p) for p in out.iterdir()}
    prepare(spec, out, split_method="head", val_tokens=50, show=False)  # same options: a no-op
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(DataError, match="already holds prepared data from other options"):
        prepare(spec, out, split_method="head", val_tokens=99, show=False)
    assert {p.name: sha256_file(p) for p in out.iterdir()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.bin").write_bytes(b"keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        prepare(spec, other, split_method="head", val_tokens=50, show=False)
    assert (other / "train.bin").read_bytes() == b"keep me"


def test_a_rerun_after_the_files_changed_is_refused_not_a_no_op(docs_file, tmp_path, capsys):
    """A file added to --path's directory since it was prepared: the same command said 'already prepared with these
    options; nothing to do' and the new file was never read; an unfinished prepare resumed on the changed files. A
    meta.json from before ``inputs`` was recorded is taken as it is."""
    path, docs = docs_file
    src = tmp_path / "src"
    src.mkdir()
    path.rename(src / "a.jsonl")
    spec, out = TextSpec("files", str(src)), tmp_path / "out"
    meta = prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert meta["inputs"]["files"] == 1 and json.loads((out / "meta.json").read_text())["inputs"] == meta["inputs"]
    before = {p.name: sha256_file(p) for p in out.iterdir()}
    added = (src / "b.jsonl").write_text(json.dumps({"text": "a document added later"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert str(e.value) == (f"--out {out} was prepared from --path {src} when it held 1 file(s) of "
                            f"{meta['inputs']['bytes']} bytes; it now holds 2 of {meta['inputs']['bytes'] + added}: "
                            f"files were added, removed or changed since; choose another --out, or remove {out} to "
                            "prepare them again")
    assert {p.name: sha256_file(p) for p in out.iterdir()} == before
    on_disk = json.loads((out / "meta.json").read_text())
    del on_disk["inputs"]  # as an earlier lnstab wrote it
    (out / "meta.json").write_text(json.dumps(on_disk))
    capsys.readouterr()
    prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert "nothing to do" in capsys.readouterr().out
    (out / ".partial").mkdir()  # an unfinished prepare of the one file, resumed after the second was added
    options = {k: meta[k] for k in ("source", "split", "tokenizer")}
    (out / ".partial" / "progress.json").write_text(json.dumps({"options": options, "inputs": meta["inputs"]}))
    (out / "meta.json").unlink()
    for name in ("train.bin", "val.bin"):
        (out / name).unlink()
    with pytest.raises(DataError, match=f"holds an unfinished prepare from --path {src} when it held 1 file"):
        prepare(spec, out, split_method="head", val_tokens=50, show=False)


def test_an_out_inside_the_path_is_not_read_as_text(docs_file, tmp_path, capsys):
    """``--path data --out data/prepared``: the rerun read the prepared meta.json as a document of data (refused as
    files added since), and so did a fit of --data.path data."""
    path, docs = docs_file
    src = tmp_path / "data"
    src.mkdir()
    path.rename(src / "a.jsonl")
    spec, out = TextSpec("files", str(src)), src / "prepared"
    prepare(spec, out, split_method="head", val_tokens=50, show=False)
    capsys.readouterr()
    prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert "nothing to do" in capsys.readouterr().out
    texts = [t for batch in iter_documents(open_text_stream(spec), spec) for t in batch]
    assert texts == docs


def test_files_meta_records_no_hub_fields_and_an_earlier_meta_with_them_is_the_same_options(docs_file, tmp_path,
                                                                                                 capsys):
    """``--source files`` never reads the hub's dataset, config, revision or data_files: meta.json left them out of
    its record only after stop 52 (it named stas/openwebtext-10k for a local file), and a directory prepared before,
    with their defaults, is still the same options (a no-op, not "other options")."""
    path, _ = docs_file
    spec, out = TextSpec("files", str(path)), tmp_path / "out"
    meta = prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert meta["source"] == {"source": "files", "path": str(path), "text_field": "text", "split": "train"}
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["source"] == meta["source"]
    on_disk["source"] = dict(vars(spec))  # as an earlier lnstab wrote it: the hub's defaults beside the files
    assert on_disk["source"]["dataset"] and on_disk["source"]["revision"]
    (out / "meta.json").write_text(json.dumps(on_disk))
    capsys.readouterr()
    prepare(spec, out, split_method="head", val_tokens=50, show=False)
    assert "nothing to do" in capsys.readouterr().out


@pytest.fixture
def prepared_dir(docs_file, tmp_path) -> Path:
    path, _ = docs_file
    prepare(TextSpec("files", str(path)), tmp_path / "prep", split_method="head", val_tokens=50, show=False)
    return tmp_path / "prep"


def prepared_module(path: Path, **kw) -> OpenWebTextDataModule:
    args = {"block_size": 8, "batch_size": 2, "source": "prepared", "path": str(path), "num_workers": 2}
    return OpenWebTextDataModule(**{**args, **kw})


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_prepared_file_is_a_one_line_error(prepared_dir, damage):
    train = prepared_dir / "train.bin"
    data = bytearray(train.read_bytes())
    if damage == "truncate":
        data = data[:-2]
    else:
        data[10] ^= 0xFF
    train.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        prepared_module(prepared_dir).setup("fit")
    msg = str(e.value)
    assert "\n" not in msg and "train.bin" in msg
    assert ("truncated" in msg) if damage == "truncate" else ("sha256" in msg)
    assert train.read_bytes() == bytes(data)  # nothing rewritten


def test_prepared_missing_meta_and_block_size_too_long(prepared_dir, tmp_path):
    with pytest.raises(DataError, match="has no meta.json"):
        prepared_module(tmp_path).setup("fit")
    dm = prepared_module(prepared_dir, block_size=4096)
    with pytest.raises(DataError, match="block_size 4096 is longer than the validation data"):
        dm.setup("fit")
    dm = prepared_module(prepared_dir, block_size=8, batch_size=4096, val_tokens=20)
    with pytest.raises(DataError, match="block_size=8 x batch_size=4096 is longer than the data"):
        dm.train_dataset()


def test_prepared_windows_are_disjoint_over_ranks_and_workers_and_resume(prepared_dir):
    dm = prepared_module(prepared_dir)
    dm.setup("fit")
    train = read_bin(prepared_dir / "train.bin").astype(np.int64)
    aligned = {tuple(train[o : o + 8].tolist()): o for o in range(0, len(train) - 8, 8)}
    starts = []
    for rank in range(2):
        ds = dm.train_dataset(ShardPlan(rank, 2, 2, 0), passes=1)
        for x, y in DataLoader(ds, batch_size=None, num_workers=2):
            for xi, yi in zip(x, y, strict=True):
                s = aligned[tuple(xi.tolist())]
                assert yi.tolist() == train[s + 1 : s + 9].tolist()
                starts.append(s)
    n_windows = (len(train) - 1) // 8
    assert len(starts) == len(set(starts)) == n_windows // 4 // 2 * 2 * 4  # each reader: whole batches of its share
    assert dm.validation_tokens().tolist() == read_bin(prepared_dir / "val.bin").tolist()
    full = iter(dm.train_dataloader())
    batches = [next(full) for _ in range(9)]
    dm2 = prepared_module(prepared_dir)
    dm2.load_state_dict(dm.state_dict() | {"batches_consumed": 5})
    resumed = iter(dm2.train_dataloader())
    for a, _ in batches[5:]:
        assert torch.equal(a, next(resumed)[0])


def test_cli_prepare_bad_input_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["prepare", "--source", "files", "--path", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.jsonl" in err and err.startswith("lnstab: error:")
    with pytest.raises(SystemExit) as e:
        cli_main(["prepare", "--source", "hf", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "HF_HUB_OFFLINE" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--path", "{missing}"], "--path {missing} does not exist"),  # prepare's own flag, not --data.path
        (["--path", "{doc}", "--split_method", "head", "--val_tokens", "100000000"], "val_tokens=100000000"),
        (["--path", "{doc}", "--split-method", "head"], "unrecognized arguments: --split-method"),  # one flag style
        (["--path", "{doc}", "--split_method", "random"], "argument --split_method: invalid choice"),
        (["--data.path", "{doc}"], "unrecognized arguments: --data.path {doc}; prepare's flags have no data. prefix: "
                                   "--path"),  # fit's spelling, said as typed, with prepare's
        # one document: nanoGPT's split would hold it out and leave none to train on (datasets' ValueError before)
        (["--path", "{doc}", "--no_progress"], "test_size=0.0005 is not allowed with 1 document in --path"),
    ],
)
def test_prepare_errors_are_one_line_name_its_flags_and_leave_no_partial(tmp_path, capsys, args, expected):
    doc = tmp_path / "d.jsonl"
    doc.write_text('{"text": "a short document"}\n')
    fill = {"missing": tmp_path / "missing.jsonl", "doc": doc}
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        cli_main(["prepare", "--source", "files", "--out", str(out), *[a.format(**fill) for a in args]])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("lnstab: error:") and "\n" not in err
    assert expected.format(**fill) in err and ("--data." not in err or args[0].startswith("--data."))
    assert not out.exists()  # no empty .partial/ left behind


def test_prepare_out_with_a_name_longer_than_the_filesystem_takes_is_one_line(docs_file, tmp_path, capsys):
    """It was OSError 'File name too long' as a traceback (exit 1)."""
    path, _ = docs_file
    with pytest.raises(SystemExit) as e:
        cli_main(["prepare", "--source", "files", "--path", str(path), "--out", str(tmp_path / ("a" * 300)),
                  "--no_progress"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    assert err.startswith("lnstab: error: --out is not allowed with a name of 300 bytes"), err


@pytest.mark.parametrize("under", [False, True])
def test_prepare_out_on_a_file_is_a_one_line_error_and_the_file_is_kept(docs_file, tmp_path, capsys, under):
    path, _ = docs_file
    existing = tmp_path / "notes.txt"
    existing.write_text("a user's file\n")
    out = existing / "sub" if under else existing
    with pytest.raises(SystemExit) as e:  # was a NotADirectoryError traceback, exit status 1
        cli_main(["prepare", "--source", "files", "--path", str(path), "--out", str(out), "--no_progress"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("lnstab: error: --out ") and "\n" not in err
    assert ("is not a directory" if not under else "cannot be created") in err
    assert existing.read_text() == "a user's file\n"
