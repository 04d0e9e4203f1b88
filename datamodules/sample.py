"""The OpenWebText sample shipped with lnstab (``source: sample``): where it is installed, and how it was cut.

``lnstab/datamodules/data/owt-sample-250.jsonl.gz`` holds the first 250 documents of the 900-document OpenWebText
sample (``owt-sample-900.jsonl.gz``; provenance and licence in ``data/README.md`` beside it), so a fresh install
trains on English offline. It was written by::

    python -m lnstab.datamodules.sample owt-sample-900.jsonl.gz

which copies the first ``SAMPLE_DOCUMENTS`` lines unchanged (each one JSON object ``{"text": ...}``) into a gzip
stream without a file name or time stamp, so the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
from importlib.resources import files
from pathlib import Path

SAMPLE_FILE = "owt-sample-250.jsonl.gz"
SAMPLE_DOCUMENTS = 250


def sample_path() -> Path:
    """The installed sample file (package data of ``lnstab.datamodules``; an editable install: the checkout's).

    Raises:
        DataError: If the file is missing (an install without its package data).
    """
    from lnstab.datamodules.text import DataError

    path = Path(str(files("lnstab.datamodules") / "data" / SAMPLE_FILE))
    if not path.is_file():
        raise DataError(f"--data.source sample: the packaged sample {path} is missing; reinstall lnstab, or use "
                        f"--data.source files --data.path <local .jsonl/.txt/.parquet>")
    return path


def write_sample(source: Path, out: Path, documents: int = SAMPLE_DOCUMENTS) -> int:
    """Copy the first ``documents`` lines of the gzipped JSONL ``source`` into ``out`` (gzip, reproducible bytes).

    Each line must be a JSON object with a non-blank string ``text``. Returns the number of bytes written.

    Raises:
        ValueError: If ``source`` holds fewer documents, or a line is not such an object.
    """
    lines: list[bytes] = []
    with gzip.open(source, "rb") as f:
        for number, line in enumerate(f, 1):
            if len(lines) == documents:
                break
            doc = json.loads(line)
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or not doc["text"].strip():
                raise ValueError(f"{source} line {number} is not a JSON object with a non-blank string 'text'")
            lines.append(line)
    if len(lines) < documents:
        raise ValueError(f"{source} holds {len(lines)} documents; {documents} were asked for")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        gz.write(b"".join(lines))
    return out.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write lnstab's packaged OpenWebText sample from a larger one.")
    parser.add_argument("source", type=Path, help="gzipped JSONL of OpenWebText documents (owt-sample-900.jsonl.gz)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data" / SAMPLE_FILE)
    parser.add_argument("--documents", type=int, default=SAMPLE_DOCUMENTS)
    opts = parser.parse_args(argv)
    size = write_sample(opts.source, opts.out, opts.documents)
    print(f"{opts.out}: {opts.documents} documents, {size} bytes")


if __name__ == "__main__":
    main()
