"""The per-GPU memory estimate: parameter counts, the activations autograd really saves, sharding and checkpointing."""

from __future__ import annotations

import pytest
import torch
from support.module import saved_bytes

from lnstab.memory import estimate_memory, total_params
from lnstab.model import GPT, NORM_PLACEMENTS, GPTConfig


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-large", "gpt2-xl"])
@pytest.mark.parametrize("placement", ["pre", "peri", "post"])
def test_parameter_count_matches_the_model(preset: str, placement: str) -> None:
    config = GPTConfig.preset(preset, norm_placement=placement, bias=False, pad_vocab_multiple=64)
    with torch.device("meta"):
        assert total_params(config) == GPT(config).num_params()


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_activation_estimate_equals_what_autograd_saves(placement: str, norm_type: str) -> None:
    config = GPTConfig.preset("tiny", vocab_size=97, block_size=32, n_layer=3, norm_placement=placement,
                              norm_type=norm_type, pad_vocab_multiple=64)
    x = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    estimate = estimate_memory(config, 4, precision="32-true", strategy="single")
    assert estimate.activations + estimate.head == saved_bytes(GPT(config), x)


def test_sharding_checkpointing_and_the_chunked_head() -> None:
    config = GPTConfig.preset("gpt2-xl", bias=False, pad_vocab_multiple=64)
    n = total_params(config)
    ddp = estimate_memory(config, 8, strategy="ddp")
    fsdp = estimate_memory(config, 8, strategy="fsdp", world_size=8)
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.gradient_buckets) == (4 * n, 4 * n, 8 * n, 4 * n)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer, fsdp.gradient_buckets) == (4 * n // 8, 4 * n // 8, n, 0)
    assert fsdp.activations == ddp.activations  # sharding splits state, not a GPU's own activations
    checkpointed = estimate_memory(config, 8, strategy="fsdp", world_size=8, activation_checkpointing=True)
    tokens, width = 8 * 1024, config.n_embd
    assert checkpointed.activations < fsdp.activations / 5
    assert checkpointed.activations >= config.n_layer * 4 * tokens * width  # every block's input is kept
    logits = estimate_memory(config, 8, strategy="fsdp", world_size=8, chunked_loss=False)
    assert logits.head == 4 * tokens * config.padded_vocab_size  # fp32 log-probabilities of the whole batch
    assert logits.total - fsdp.total > 2 * 4 * tokens * config.padded_vocab_size
    assert estimate_memory(config, 8, precision="32-true").activations > ddp.activations


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(strategy="zero3"), "strategy='zero3'"), (dict(precision="16-mixed"), "precision='16-mixed'"),
     (dict(world_size=0), "world_size=0")],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate_memory(GPTConfig.preset("tiny"), 1, **kwargs)
