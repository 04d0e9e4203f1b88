"""``lnstab prepare``: tokenize a text source into nanoGPT-style ``train.bin`` / ``val.bin`` / ``meta.json``.

    lnstab prepare --source hf --out data/openwebtext                   # the paper's data (nanoGPT's split)
    lnstab prepare --source files --path docs.jsonl.gz --out DIR --split_method head --val_tokens 65536

``--split_method nanogpt`` loads the whole split (not streamed) and applies nanoGPT's
``train_test_split(test_size=0.0005, seed=2357, shuffle=True)``; on the full OpenWebText this reproduces nanoGPT's
8,009,762 / 4,007 documents. ``--split_method head`` holds out exactly the first ``--val_tokens`` tokens of the
stream (the last of those documents is cut; the rest of it starts ``train.bin``), exactly as the ``files``/``hf``
DataModule sources do. ``documents`` in ``meta.json`` counts the documents with tokens in a split (a cut one counts
in both).

Writes go to ``DIR/.partial/`` with a ``progress.json`` updated after every fsync'ed chunk, so an interrupted run
resumes where it stopped; the finished files are moved into place and ``meta.json`` is written last (atomically).
An existing prepared directory is never overwritten; rerun with the same options it is a no-op, unless ``--source
files``'s files were added, removed or changed in size since (``meta.json``'s ``inputs``): that is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lnstab.datamodules.prepared import META_FORMAT, read_meta, sha256_file
from lnstab.datamodules.text import (
    DEFAULT_HF_CONFIG,
    DEFAULT_HF_DATASET,
    DEFAULT_HF_REVISION,
    DataError,
    DocStats,
    DocTokenizer,
    TextSpec,
    TooLittleData,
    iter_documents,
    open_text_stream,
    resolve_files,
)
from lnstab.rundir import check_name_lengths


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _flat_docs(batches: Iterator[list[str]]) -> Iterator[str]:
    for batch in batches:
        yield from batch


def _write_split(
    name: str,
    docs: Iterator[str],
    partial: Path,
    progress: dict,
    tok: DocTokenizer,
    batch_docs: int,
    show: bool,
    total: int | None,
    prefix: np.ndarray | None = None,
    limit: int | None = None,
) -> None:
    """Append the tokens of ``docs`` (after the ``progress[name]['documents']`` already written) to ``partial``.

    ``prefix``: tokens written before the first document (the rest of a document that validation cut);
    ``limit``: keep only the first ``limit`` tokens (validation holds exactly ``val_tokens``).
    """
    from tqdm import tqdm

    state = progress.setdefault(name, {"documents": 0, "tokens": 0, "done": False})
    if state["done"]:
        return
    path = partial / f"{name}.bin"
    itemsize = tok.dtype.itemsize
    mode = "r+b" if path.exists() else "wb"
    with open(path, mode) as f, tqdm(total=total, desc=f"prepare {name}", unit="doc", disable=not show) as bar:
        f.truncate(state["tokens"] * itemsize)  # drop any chunk written after the last progress record
        f.seek(state["tokens"] * itemsize)
        skip = state["documents"]
        bar.update(skip)
        batch: list[str] = []
        head = prefix if prefix is not None and len(prefix) and state["tokens"] == 0 else None

        def flush() -> None:
            nonlocal head
            arr = tok.encode_flat(batch) if batch else np.empty(0, dtype=tok.dtype)
            if head is not None:
                arr, head = np.concatenate([head.astype(tok.dtype), arr]), None
            if limit is not None:
                arr = arr[: max(0, limit - state["tokens"])]
            f.write(arr.tobytes())
            f.flush()
            os.fsync(f.fileno())
            state["documents"] += len(batch)
            state["tokens"] += int(arr.size)
            _atomic_json(partial / "progress.json", progress)
            bar.update(len(batch))
            batch.clear()

        for i, text in enumerate(docs):
            if i < skip:
                continue
            batch.append(text)
            if len(batch) >= batch_docs:
                flush()
        if batch or head is not None:
            flush()
    state["done"] = True
    state["sha256"] = sha256_file(path)
    _atomic_json(partial / "progress.json", progress)


def prepare(
    spec: TextSpec,
    out: str | os.PathLike,
    split_method: str = "nanogpt",
    val_tokens: int = 4_000_000,
    test_size: float = 0.0005,
    split_seed: int = 2357,
    tokenizer: str = "gpt2",
    num_threads: int | None = None,
    batch_docs: int = 1024,
    show: bool = True,
    cache_dir: str | None = None,
) -> dict:
    """Prepare ``out`` from ``spec``; returns the meta dict. See the module docstring.

    Raises:
        DataError: For bad options or input, or an ``out`` that already holds other data.
    """
    if split_method not in ("nanogpt", "head"):
        raise DataError(f"split_method={split_method!r} is not allowed; allowed: 'nanogpt', 'head'")
    if split_method == "head" and val_tokens < 1:
        raise DataError(f"val_tokens={val_tokens} is not allowed; it must be >= 1")
    if split_method == "nanogpt" and not 0 < test_size < 1:
        raise DataError(f"test_size={test_size} is not allowed; it must be in (0, 1)")
    out = Path(out)
    check_name_lengths(out, "--out")  # exists() raised 'File name too long' as a traceback
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is not a directory; give a new directory, or one prepared before")
    split = {"method": split_method}
    split.update({"val_tokens": val_tokens} if split_method == "head" else {"test_size": test_size, "seed": split_seed})
    options = {"source": recorded_source(dataclasses.asdict(spec)), "split": split, "tokenizer": tokenizer}
    inputs = input_files(spec)
    if (out / "meta.json").exists():
        meta = read_meta(out)
        if {k: meta.get(k) for k in options} | {"source": recorded_source(meta.get("source"))} != options:
            raise DataError(f"--out {out} already holds prepared data from other options; choose another --out")
        _check_inputs(meta.get("inputs"), inputs, spec.path, f"--out {out} was prepared", f"or remove {out}")
        print(f"lnstab prepare: {out} is already prepared with these options; nothing to do")
        return meta
    for name in ("train.bin", "val.bin"):
        if (out / name).exists():
            raise DataError(f"--out {out} already has {name} but no meta.json; refusing to overwrite it")
    partial = out / ".partial"
    progress: dict = {"options": options, "inputs": inputs}
    if (partial / "progress.json").exists():
        progress = json.loads((partial / "progress.json").read_text(encoding="utf-8"))
        kept = progress.get("options")
        if not isinstance(kept, dict) or {**kept, "source": recorded_source(kept.get("source"))} != options:
            raise DataError(f"--out {out} holds an unfinished prepare with other options; remove {partial} first")
        _check_inputs(progress.get("inputs"), inputs, spec.path, f"--out {out} holds an unfinished prepare",
                      f"or remove {partial}")
        print(f"lnstab prepare: resuming in {partial}")
    tok = DocTokenizer(tokenizer, num_threads or os.cpu_count() or 1)
    # open the source before creating anything under out, so bad input leaves no trace
    ds = open_text_stream(spec, streaming=split_method == "head", cache_dir=cache_dir)
    if split_method == "nanogpt" and len(ds) - math.ceil(test_size * len(ds)) < 1:  # datasets' own rule
        n = len(ds)
        raise DataError(f"test_size={test_size} is not allowed with {n} document{'s' * (n != 1)} in --path: it holds "
                        "out every one and leaves none to train on; give more documents or --split_method head")
    created = not out.exists(), not partial.exists()
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way, a read-only or full disk: the path's fault, said in one line
        raise DataError(f"--out {out} cannot be created: {exc.strerror or exc}") from None
    try:
        stats = DocStats()
        if split_method == "nanogpt":
            parts = ds.train_test_split(test_size=test_size, seed=split_seed, shuffle=True)
            vstats = DocStats()
            for name, part, st in (("train", parts["train"], stats), ("val", parts["test"], vstats)):
                docs = _flat_docs(iter_documents(part, spec, st))
                _write_split(name, docs, partial, progress, tok, batch_docs, show, len(part))
            stats.invalid_utf8 += vstats.invalid_utf8
            stats.blank += vstats.blank
        else:
            # validation: exactly the first val_tokens tokens (the last document cut); training starts with its rest
            n_val, arrays, _ = head_documents(spec, tok, val_tokens)
            rest = np.concatenate(arrays)[val_tokens:]
            val_docs = _take(_flat_docs(iter_documents(open_text_stream(spec), spec)), n_val)
            _write_split("val", val_docs, partial, progress, tok, batch_docs, show, n_val, limit=val_tokens)
            train_docs = _flat_docs(iter_documents(open_text_stream(spec), spec, stats))
            _write_split("train", _drop(train_docs, n_val), partial, progress, tok, batch_docs, show, None, prefix=rest)
        meta = {"format": META_FORMAT, **options, "dtype": tok.dtype.name, "eot": tok.eot, "splits": {}}
        if inputs:
            meta["inputs"] = inputs
        if split_method == "head" and len(rest):
            progress["train"]["documents"] += 1  # the cut document's rest opens train.bin
        meta.update(invalid_utf8_documents=stats.invalid_utf8, blank_documents=stats.blank)
        for name in ("train", "val"):
            st = progress[name]
            meta["splits"][name] = {
                "file": f"{name}.bin",
                "tokens": st["tokens"],
                "documents": st["documents"],
                "bytes": st["tokens"] * tok.dtype.itemsize,
                "sha256": st["sha256"],
            }
        for name in ("train", "val"):
            if (partial / f"{name}.bin").exists():
                os.replace(partial / f"{name}.bin", out / f"{name}.bin")
        _atomic_json(out / "meta.json", meta)
        shutil.rmtree(partial, ignore_errors=True)
        t, v = meta["splits"]["train"], meta["splits"]["val"]
        print(
            f"lnstab prepare: {out}: train {t['documents']} docs / {t['tokens']} tokens, val {v['documents']} docs / "
            f"{v['tokens']} tokens; {stats.invalid_utf8} docs with invalid UTF-8 (replaced), {stats.blank} blank "
            f"skipped"
        )
    except BaseException:
        if created[1] and not (partial / "progress.json").exists():  # nothing resumable: leave no trace
            shutil.rmtree(partial, ignore_errors=True)
            if created[0] and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
        raise
    return meta


def _take(it: Iterator[str], n: int) -> Iterator[str]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def _drop(it: Iterator[str], n: int) -> Iterator[str]:
    for i, x in enumerate(it):
        if i >= n:
            yield x


HUB_FIELDS = ("dataset", "dataset_config", "revision", "data_files")  # what only --source hf reads


def input_files(spec: TextSpec) -> dict | None:
    """What ``--source files`` reads, as ``meta.json`` records it (``inputs``): how many files, their bytes, and a
    digest of their names and sizes, so a file added, removed, renamed or grown since shows (an edit that keeps the
    size does not); None for ``hf``."""
    if spec.source != "files":
        return None
    digest, total = hashlib.sha256(), 0
    files = resolve_files(spec.path)[1]
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{name}\0{size}\n".encode())
        total += size
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def _check_inputs(was: Any, now: dict | None, path: str | None, what: str, remedy: str) -> None:
    """Refuses, in one line, files that are not those ``was`` records (a directory prepared before ``inputs`` was
    recorded has none: it is taken as it is)."""
    if not isinstance(was, dict) or now is None or was == now:
        return
    raise DataError(f"{what} from --path {path} when it held {was.get('files')} file(s) of {was.get('bytes')} bytes; "
                    f"it now holds {now['files']} of {now['bytes']}: files were added, removed or changed since; "
                    f"choose another --out, {remedy} to prepare them again")


def recorded_source(source: Any) -> Any:
    """The source as ``meta.json`` records it: for ``files``, without the hub's fields, which it never reads (a
    directory prepared before they were left out, with their defaults, compares equal)."""
    if isinstance(source, dict) and source.get("source") == "files":
        return {k: v for k, v in source.items() if k not in HUB_FIELDS}
    return source


def head_documents(
    spec: TextSpec, tok: DocTokenizer, val_tokens: int, stats: DocStats | None = None, train: bool = True
) -> tuple[int, list, bool]:
    """``(n, token arrays, ended)`` of the first documents of the stream holding at least ``val_tokens`` tokens;
    ``ended``: they are the whole stream (the training data is then the rest of the last one only). With ``train``
    False (a validate, test or evaluate, which read no training data) a stream of ``val_tokens`` tokens or fewer is
    returned whole.

    Raises:
        TooLittleData: If ``train`` and the whole stream holds ``val_tokens`` tokens or fewer (nothing would be left
            to train on).
    """
    arrays, total = [], 0
    for texts in iter_documents(open_text_stream(spec), spec, stats, batch_docs=64):
        for arr in tok.encode(texts):
            if total >= val_tokens:
                return len(arrays), arrays, False
            arrays.append(arr)
            total += len(arr)
    if total > val_tokens or not train:  # the last document is longer than validation needs: its rest trains
        return len(arrays), arrays, True
    raise TooLittleData(
        f"val_tokens={val_tokens} is not allowed for {spec.describe()}: the data holds only {total} tokens "
        f"({len(arrays)} documents); it must be below {total} so that some are left to train on"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``lnstab prepare`` argument parser."""
    p = _Parser(prog="lnstab prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=("hf", "files"), required=True)
    p.add_argument("--path", help="files: a file, directory, glob, or comma-separated list")
    p.add_argument("--dataset", default=DEFAULT_HF_DATASET, help="hf: dataset id or local dataset directory")
    p.add_argument("--dataset_config", default=DEFAULT_HF_CONFIG)
    p.add_argument("--revision", default=DEFAULT_HF_REVISION)
    p.add_argument("--data_files", nargs="*", default=None)
    p.add_argument("--text_field", default="text")
    p.add_argument("--split", default="train", help="input split to read")
    p.add_argument("--out", required=True, help="output directory (train.bin, val.bin, meta.json)")
    p.add_argument("--split_method", choices=("nanogpt", "head"), default="nanogpt")
    p.add_argument("--val_tokens", type=int, default=4_000_000, help="head: tokens held out for validation")
    p.add_argument("--test_size", type=float, default=0.0005, help="nanogpt: fraction of documents for val")
    p.add_argument("--split_seed", type=int, default=2357)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--num_threads", type=int, default=None, help="tokenizer threads (default: all cores)")
    p.add_argument("--batch_docs", type=int, default=1024, help="documents per tokenized, fsync'ed chunk")
    p.add_argument("--cache_dir", default=None, help="datasets cache for --split_method nanogpt")
    p.add_argument("--no_progress", action="store_true")
    return p


class ParseError(DataError):
    """A command-line mistake, named as the user typed it (not rewritten to prepare's flag names)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through the CLI's LNStabError handler, exit 2
        typed = re.findall(r"--data\.(\w+)", message)
        hint = f"; prepare's flags have no data. prefix: --{typed[0]}" if typed else ""
        raise ParseError(f"lnstab prepare: {message}{hint}")


def main(argv: list[str]) -> None:
    """Entry point of ``lnstab prepare`` (dispatched by :func:`lnstab.cli.main`); errors name prepare's own flags."""
    try:
        _main(argv)
    except ParseError:
        raise
    except DataError as exc:  # the data options' messages say --data.<name>; prepare's flags are --<name>
        raise DataError(str(exc).replace("--data.", "--")) from None


def _main(argv: list[str]) -> None:
    a = build_parser().parse_args(argv)
    if a.source == "files" and not a.path:
        raise DataError("--path is required with --source files")
    data_files = a.data_files[0] if a.data_files and len(a.data_files) == 1 else a.data_files
    spec = TextSpec(
        a.source, a.path, a.dataset, a.dataset_config or None, a.revision or None, data_files, a.text_field, a.split
    )
    import datasets  # lazily, as text.py imports it

    quiet = a.no_progress and not datasets.are_progress_bars_disabled()
    if quiet:  # --no_progress silences datasets' "Generating train split" bars too
        datasets.disable_progress_bars()
    try:
        prepare(spec, a.out, a.split_method, a.val_tokens, a.test_size, a.split_seed, a.tokenizer, a.num_threads,
                a.batch_docs, show=not a.no_progress, cache_dir=a.cache_dir)
    finally:
        if quiet:
            datasets.enable_progress_bars()
