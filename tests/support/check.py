"""``lnstab check``'s test arguments (a tiny protocol, an lnstab GPT, an encoder factory), a check run in-process with
its exit status and report, and a tiny OLMo 2 built from a config."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from lnstab.cli import main

TINY = ["--steps", "6", "--measure-every", "3", "--batch-size", "4", "--seq-len", "16", "--seeds", "0",
        "--workers", "1", "--threads", "1", "--no-progress", "--data.source", "synthetic"]
GPT = ["--model.preset", "tiny", "--model.vocab_size", "128", "--model.block_size", "32"]
ENCODER = ["--factory", "check_factories:encoder_lm", "--layer-pattern", r"layers\.(\d+)$"]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=128,
             max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def check(out: Path, *args: str) -> tuple[int, dict]:
    """Run ``lnstab check … --out out``; its exit status and ``report.json``."""
    try:
        main(["check", *args, "--out", str(out)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return code, report


def rows(report: dict) -> dict[str, dict]:
    return {r["id"]: r for r in report["criteria"]}


def olmo2() -> nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**SHAPE))
