"""Text sources (Hugging Face hub or local files, both streamed through ``datasets``) and GPT-2 tokenization.

One code path serves ``hf`` and ``files``: :func:`open_text_stream` calls ``datasets.load_dataset(...,
streaming=True)`` with a hub id (or a local dataset directory) for ``hf`` and with ``datasets``' own ``json`` /
``text`` / ``parquet`` builders for ``files``. :func:`iter_documents` reads the stream as Arrow batches, so invalid
UTF-8 is decoded with replacement and counted instead of crashing, and whitespace-only documents are skipped and
counted. :class:`DocTokenizer` turns documents into ``encode_ordinary(text) + [EOT]`` token arrays, batched and
multi-threaded, as nanoGPT's ``prepare.py`` does.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lnstab.errors import LNStabError, folded
from lnstab.hub import hub_error
from lnstab.tokenizer import EOT_TOKEN, get_encoding

SOURCES = ("hf", "files", "prepared", "sample", "synthetic", "auto")
DEFAULT_HF_DATASET = "Skylion007/openwebtext"
DEFAULT_HF_REVISION = "refs/convert/parquet"
DEFAULT_HF_CONFIG = "plain_text"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_OFFLINE_HINT = (
    "prepare the data on a machine with network (`lnstab prepare --source hf --out DIR`) and copy DIR here "
    "for --data.source prepared, or use --data.source files --data.path <local .jsonl/.txt/.parquet>"
)


class DataError(LNStabError):
    """Bad data or data options: a missing, empty or corrupt file, an unknown field, data shorter than a window."""


class TooLittleData(DataError):
    """Data holding fewer tokens than validation and one training batch take (said in ``lnstab fit``'s options;
    ``lnstab check``, whose options are others, says it in its own)."""


@dataclasses.dataclass
class DocStats:
    """Counts of what :func:`iter_documents` saw (per process)."""

    documents: int = 0
    invalid_utf8: int = 0
    blank: int = 0


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """Where the text comes from (the options ``--data.*`` and ``lnstab prepare`` share).

    Args:
        source: ``hf`` (hub id or local dataset directory) or ``files`` (local files).
        path: For ``files``: a file, a directory, or a glob (comma-separated for several); for ``hf``: unused.
        dataset: For ``hf``: the dataset id (or a local dataset directory).
        dataset_config: For ``hf``: the config name.
        revision: For ``hf``: the git revision (``refs/convert/parquet`` avoids loading scripts).
        data_files: For ``hf``: optional ``data_files`` inside the dataset repository.
        text_field: Column that holds each document's text.
        split: Split to read.
    """

    source: str = "hf"
    path: str | None = None
    dataset: str = DEFAULT_HF_DATASET
    dataset_config: str | None = DEFAULT_HF_CONFIG
    revision: str | None = DEFAULT_HF_REVISION
    data_files: str | list[str] | None = None
    text_field: str = "text"
    split: str = "train"

    def describe(self) -> str:
        """A short human-readable name of the input, for error messages."""
        if self.source == "files":
            return f"--data.path {self.path}"
        return f"--data.dataset {self.dataset}"


def resolve_files(path: str | None) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the sorted file list for ``path`` (file, directory, glob, comma list).

    Raises:
        DataError: If nothing matches, a file is empty, or the files mix or use unsupported formats.
    """
    if not path:
        raise DataError("--data.path is not set; source 'files' needs a .txt/.jsonl/.json/.parquet file, dir or glob")
    files: list[str] = []
    for part in (p.strip() for p in str(path).split(",") if p.strip()):
        if os.path.isfile(os.path.join(part, "meta.json")) and os.path.isfile(os.path.join(part, "train.bin")):
            raise DataError(f"--data.path {part} is a directory lnstab prepare wrote (meta.json, train.bin), not text "
                            "files; give --data.source prepared with it")  # its meta.json was read as a document
        if os.path.isdir(part):
            found = sorted(str(p) for p in Path(part).rglob("*")
                           if p.is_file() and _builder_of(str(p)) and not _prepared_below(p, Path(part)))
        else:
            found = sorted(glob.glob(part)) if glob.has_magic(part) else ([part] if os.path.exists(part) else [])
        if not found:
            raise DataError(f"--data.path {part} does not exist or matches no .txt/.jsonl/.json/.parquet file")
        files += found
    seen: dict[str, str] = {}
    for f in files:  # one file twice (a comma list, a glob overlapping a name) would be tokenized twice
        key = os.path.realpath(f)
        if key in seen:
            raise DataError(f"--data.path {path} names {f} twice (also as {seen[key]}); give each file once"
                            if f != seen[key] else f"--data.path {path} names {f} twice; give each file once")
        seen[key] = f
    builders = {_builder_of(f) for f in files}
    if None in builders:
        bad = next(f for f in files if _builder_of(f) is None)
        raise DataError(f"--data.path {bad} has an unsupported extension; allowed: .txt .jsonl .json .parquet (+.gz)")
    if len(builders) > 1:
        raise DataError(f"--data.path {path} mixes formats {sorted(builders)}; point it at files of one format")
    for f in files:
        if os.path.getsize(f) == 0:
            raise DataError(f"--data.path {f} is empty (0 bytes); it must hold at least one document")
        if (wide := _wide_encoding(f)) is not None:  # read as UTF-8 it was every other byte a NUL, counted as text
            raise DataError(f"--data.path {f} is {wide} text (it begins with that byte-order mark); lnstab reads "
                            "UTF-8: save it as UTF-8")
    return builders.pop(), files


_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))


def _wide_encoding(path: str) -> str | None:
    """``UTF-16``/``UTF-32`` for a text or JSON file that begins with their byte-order mark (gzipped too), else None."""
    if _builder_of(path) == "parquet":
        return None
    import gzip

    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as fh:
            head = fh.read(4)
    except (OSError, EOFError):  # unreadable or not gzip after all: the reader says so in its own words
        return None
    return next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)


def _prepared_below(path: Path, top: Path) -> bool:
    """Whether ``path`` lies in a directory below ``top`` that lnstab prepare wrote, or is writing (``--out`` inside
    ``--path``): its meta.json and progress.json are not text, and were read as documents."""
    for parent in path.parents:
        if parent == top:
            return False
        if ((parent / "meta.json").is_file() and (parent / "train.bin").is_file()) or \
                (parent.name == ".partial" and (parent / "progress.json").is_file()):
            return True
    return False


def _builder_of(name: str) -> str | None:
    base = name[:-3] if name.endswith(".gz") else name
    return _BUILDERS.get(os.path.splitext(base)[1].lower())


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read at call time, not only at import)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - huggingface_hub ships with datasets
        return True


def check_hub(dataset: str, revision: str | None, timeout: float = 5.0) -> None:
    """Fail within seconds, in one line, when the hub is unreachable or the dataset unknown.

    Raises:
        DataError: If offline, unreachable, or the dataset/revision does not exist.
    """
    if hub_offline():
        raise DataError(f"--data.dataset {dataset}: HF_HUB_OFFLINE is set, the hub cannot be used; {_OFFLINE_HINT}")
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    exc = hub_error(dataset, "dataset", revision, timeout)
    if isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
        raise DataError(f"--data.dataset {dataset} (revision {revision}) is not on the hub: {type(exc).__name__}")
    if exc is not None:  # any other failure means "unreachable"
        raise DataError(
            f"--data.dataset {dataset}: the Hugging Face hub cannot be reached ({type(exc).__name__}); {_OFFLINE_HINT}"
        )


def hub_reachable(dataset: str, revision: str | None, timeout: float = 3.0) -> bool:
    """True when :func:`check_hub` passes."""
    try:
        check_hub(dataset, revision, timeout)
    except DataError:
        return False
    return True


def open_text_stream(spec: TextSpec, streaming: bool = True, cache_dir: str | None = None):  # noqa: ANN201 - datasets (Iterable)Dataset
    """``datasets.load_dataset`` for ``spec``: the one loader behind ``hf`` and ``files`` (never remote code).

    Raises:
        DataError: For a bad source, missing/empty files, or an unreachable hub.
    """
    import datasets

    if spec.source == "files":
        builder, files = resolve_files(spec.path)
        kwargs = {"encoding_errors": "replace", "sample_by": "document"} if builder == "text" else {}
        args, kwargs = (builder,), {"data_files": files, **kwargs}
    elif spec.source == "hf":
        local = os.path.isdir(spec.dataset)
        if not local:
            check_hub(spec.dataset, spec.revision)
        kwargs = {"data_files": spec.data_files} if spec.data_files else {}
        if not local:
            kwargs["revision"] = spec.revision
        args = (spec.dataset, spec.dataset_config) if spec.dataset_config and not local else (spec.dataset,)
    else:
        raise DataError(f"--data.source {spec.source!r} is not a text source; allowed here: 'hf', 'files'")
    try:
        return datasets.load_dataset(*args, split=spec.split, streaming=streaming, cache_dir=cache_dir, **kwargs)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever datasets raised
        msg = _reason(exc) or type(exc).__name__
        raise DataError(f"{spec.describe()} could not be loaded (split {spec.split!r}): {msg[:300]}") from None


def _reason(exc: BaseException) -> str:
    """What ``datasets`` says went wrong, in one line: its cause where it wraps one (a ``DatasetGenerationError``
    says only 'An error occurred while generating the dataset'), every line of the message (a ``CastError`` gives
    its reason, the column names, on its last)."""
    if exc.__cause__ is not None and type(exc).__name__ == "DatasetGenerationError":
        exc = exc.__cause__
    return folded(str(exc))


def _decode(values: list[bytes | None], stats: DocStats) -> list[str]:
    out = []
    for b in values:
        if b is None:
            b = b""
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = b.decode("utf-8", errors="replace")
            stats.invalid_utf8 += 1
        out.append(text)
    return out


def _tables(stream, spec: TextSpec, batch_docs: int) -> Iterator:  # noqa: ANN001
    """Arrow tables from ``stream``; a read or parse failure becomes one :class:`DataError` line."""
    it = iter(stream.with_format("arrow").iter(batch_size=batch_docs))
    while True:
        try:
            table = next(it)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - malformed JSON, bad parquet, gzip errors, ...
            msg = _reason(exc)
            raise DataError(f"{spec.describe()} could not be read: {type(exc).__name__}: {msg[:300]}") from None
        yield table


def iter_documents(stream, spec: TextSpec, stats: DocStats | None = None, batch_docs: int = 256) -> Iterator[list[str]]:  # noqa: ANN001
    """Batches of non-blank document texts from a ``datasets`` (Iterable)Dataset, in stream order.

    Raises:
        DataError: If ``spec.text_field`` is not a column, or the stream holds no non-blank document.
    """
    import pyarrow as pa

    stats = stats if stats is not None else DocStats()
    text_builder = spec.source == "files" and _builder_of(resolve_files(spec.path)[1][0]) == "text"
    seen = kept_total = 0
    for table in _tables(stream, spec, batch_docs):
        if spec.text_field not in table.column_names:
            raise DataError(
                f"--data.text_field {spec.text_field!r} is not a field of {spec.describe()}; "
                f"fields: {table.column_names}"
            )
        col = table.column(spec.text_field)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise DataError(f"--data.text_field {spec.text_field!r} of {spec.describe()} holds {col.type}, not text")
        raw = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary()).to_pylist()
        texts = _decode(raw, stats)
        if text_builder:  # the text builder already replaced invalid bytes while reading: count U+FFFD docs
            stats.invalid_utf8 += sum(1 for b in raw if b and b"\xef\xbf\xbd" in b)
            texts = [t.removeprefix("\ufeff") for t in texts]  # a UTF-8 byte-order mark (Notepad's) is not text
        seen += len(texts)
        kept = [t for t in texts if t.strip()]
        stats.blank += len(texts) - len(kept)
        stats.documents += len(kept)
        kept_total += len(kept)
        if kept:
            yield kept
    if seen and kept_total == 0:
        raise DataError(f"{spec.describe()} holds only empty or whitespace-only documents ({seen} read)")
    if not seen:
        raise DataError(f"{spec.describe()} holds no documents")


class DocTokenizer:
    """``encode_ordinary(doc) + [EOT]`` for batches of documents, multi-threaded, as uint16/int32 arrays.

    Args:
        name: tiktoken encoding name; ``gpt2`` is built offline (:func:`lnstab.tokenizer.gpt2_encoding`).
        num_threads: Threads for ``encode_ordinary_batch``.
    """

    def __init__(self, name: str = "gpt2", num_threads: int = 4) -> None:
        try:
            self.encoding = get_encoding(name)
        except Exception as exc:  # noqa: BLE001 - unknown name or no network for a non-gpt2 encoding
            raise DataError(
                f"--data.tokenizer {name!r} is not available ({type(exc).__name__}); 'gpt2' works offline"
            ) from None
        self.name = name
        self.num_threads = max(1, int(num_threads))
        self.eot = self.encoding.eot_token if name != "gpt2" else EOT_TOKEN
        self.dtype = np.dtype(np.uint16) if self.encoding.n_vocab <= 65536 else np.dtype(np.uint32)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """One token array (ending in EOT) per document."""
        ids = self.encoding.encode_ordinary_batch(texts, num_threads=self.num_threads)
        out = []
        for doc in ids:
            doc.append(self.eot)
            out.append(np.array(doc, dtype=self.dtype))
        return out

    def encode_flat(self, texts: list[str]) -> np.ndarray:
        """All documents' tokens concatenated (each followed by EOT)."""
        ids = self.encoding.encode_ordinary_batch(texts, num_threads=self.num_threads)
        total = sum(len(d) for d in ids) + len(ids)
        out = np.empty(total, dtype=self.dtype)
        pos = 0
        for doc in ids:
            n = len(doc)
            out[pos : pos + n] = doc
            out[pos + n] = self.eot
            pos += n + 1
        return out
