"""The OpenWebText sample shipped with lnstab (``source: sample``): real text, what the quickstart reads offline."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from lnstab.datamodules import OpenWebTextDataModule
from lnstab.datamodules.packing import ShardPlan, windows_of
from lnstab.datamodules.sample import SAMPLE_DOCUMENTS, sample_path, write_sample
from lnstab.lightning_cli import cli_main
from lnstab.tokenizer import EOT_TOKEN, gpt2_encoding

ROOT = Path(__file__).resolve().parents[1]
OWT_900 = Path(
    os.environ.get("LNSTAB_OWT_SAMPLE", ROOT / ".." / "shared/data/openwebtext/owt-sample-900.jsonl.gz")
)
needs_900 = pytest.mark.skipif(not OWT_900.is_file(), reason=f"OpenWebText sample {OWT_900} is absent")


pytestmark = pytest.mark.usefixtures("offline")  # tests/conftest.py: the hub refused, whatever the environment


def packaged_lines() -> list[bytes]:
    with gzip.open(sample_path(), "rb") as f:
        return f.read().splitlines(keepends=True)


def test_the_packaged_sample_is_openwebtext_english_in_gpt2_bpe():
    path = sample_path()
    assert path.parent.name == "data" and path.parent.parent.name == "datamodules"  # package data, not the shared dir
    assert path.stat().st_size <= 500_000
    docs = [json.loads(line)["text"] for line in packaged_lines()]
    assert len(docs) == SAMPLE_DOCUMENTS == 250 and all(d.strip() for d in docs)
    enc = gpt2_encoding()
    ref = np.array([t for d in docs for t in [*enc.encode_ordinary(d), EOT_TOKEN]], dtype=np.int64)
    dm = OpenWebTextDataModule(source="sample", block_size=128, batch_size=8, val_tokens=65_536, num_workers=0)
    dm.setup("fit")
    val = dm.validation_tokens()
    assert val.tolist() == ref[:65_536].tolist()  # the documents in order, each ended by EOT
    assert (val == EOT_TOKEN).sum().item() == dm.validation_documents - 1  # the last one is cut
    # training reads the rest, consecutive windows, in one pass
    xs = torch.cat([x for x, _ in dm.train_dataset(ShardPlan(), passes=1)])
    want, _ = windows_of(ref[65_536:], 128)
    assert torch.equal(xs, torch.from_numpy(want[: len(want) // 8 * 8, :-1]))
    # English web text: GPT-2's BPE takes 3.5-5.5 characters per token (a random id stream decodes to far fewer),
    # and " the", "," and "." are among its ten most frequent tokens
    chars_per_token = sum(len(d) for d in docs) / (len(ref) - len(docs))
    assert 3.5 < chars_per_token < 5.5, chars_per_token
    common = {t for t, _ in Counter(ref.tolist()).most_common(10)}
    assert {enc.encode_ordinary(w)[0] for w in (" the", ",", ".")} <= common
    assert enc.decode(ref[: ref.tolist().index(EOT_TOKEN)].tolist()) == docs[0]


@needs_900
def test_the_packaged_sample_is_the_head_of_the_900_document_sample_and_rebuilds_from_it(tmp_path):
    with gzip.open(OWT_900, "rb") as f:
        head = [f.readline() for _ in range(SAMPLE_DOCUMENTS)]
    assert packaged_lines() == head  # the same documents, the same bytes, the same order
    out = tmp_path / "rebuilt.jsonl.gz"
    write_sample(OWT_900, out)
    with gzip.open(out, "rb") as f:
        assert f.read().splitlines(keepends=True) == head
    with pytest.raises(ValueError, match="holds 900 documents; 901 were asked for"):
        write_sample(OWT_900, tmp_path / "more.jsonl.gz", 901)


@pytest.mark.parametrize("extra, source", [([], "sample"), (["--data.source", "synthetic"], "synthetic")])
def test_the_quickstart_reads_the_sample_offline_and_the_synthetic_stream_only_when_asked(tmp_path, extra, source):
    cli = cli_main(["--config", str(ROOT / "experiments" / "quickstart.yaml"), "--trainer.logger.init_args.save_dir",
                    str(tmp_path), *extra], run=False)
    assert cli.datamodule.hparams_initial["resolved_source"] == source
    assert cli.config.data.init_args.source == source  # what the run's config.yaml records
