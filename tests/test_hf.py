"""Hugging Face interop: weights copied both ways give the same logits in fp32 (tiny random models, no download)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lnstab.errors import ConfigError
from lnstab.hf import gpt_from_hf, gpt_to_hf
from lnstab.model import GPT, GPTConfig


def hf_tiny(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=211, n_positions=32, n_embd=48, n_layer=3, n_head=4, initializer_range=0.2)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a missed transpose or copy cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def test_hf_to_lnstab_logits_agree() -> None:
    hf = hf_tiny()
    ours = gpt_from_hf(hf).eval()
    idx = torch.randint(0, 211, (3, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)


def test_lnstab_to_hf_logits_agree_and_round_trip() -> None:
    torch.manual_seed(1)
    ours = GPT(GPTConfig.preset("tiny", vocab_size=211, block_size=32, n_layer=3)).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf = gpt_to_hf(ours).eval()
    idx = torch.randint(0, 211, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=1e-5)
        back = gpt_from_hf(hf).eval()
        torch.testing.assert_close(back(idx), ours(idx), rtol=0, atol=0)


def test_padded_vocab_loads_and_exports() -> None:
    hf = hf_tiny()
    ours = gpt_from_hf(hf, pad_vocab_multiple=64).eval()
    assert ours.transformer.wte.weight.shape[0] == 256
    idx = torch.randint(0, 211, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(gpt_to_hf(ours).eval()(idx).logits, hf(idx).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(norm_placement="peri"), "norm_placement='peri'"),
        (dict(norm_type="rmsnorm"), "norm_type='rmsnorm'"),
        (dict(bias=False), "bias=False"),
        (dict(residual_scale=0.1), "residual_scale=0.1"),
        (dict(norm_type="dyt"), "norm_type='dyt'"),
        (dict(qk_norm=True), "qk_norm=True cannot be exported"),
        (dict(residual_gate="rezero"), "residual_gate='rezero' cannot be exported"),
        (dict(residual_gate="layerscale"), "residual_gate='layerscale' cannot be exported"),
        (dict(norm_placement="deepnorm"), "norm_placement='deepnorm'"),
    ],
)
def test_only_gpt2_shaped_models_export(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        gpt_to_hf(GPT(GPTConfig.preset("tiny", vocab_size=50, **overrides)))
    assert "\n" not in str(info.value)


def test_z_loss_exports_with_the_same_logits() -> None:
    # the z-loss shapes training only; the model's function is GPT-2's
    torch.manual_seed(2)
    ours = GPT(GPTConfig.preset("tiny", vocab_size=211, block_size=32, z_loss=1e-4)).eval()
    idx = torch.randint(0, 211, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(gpt_to_hf(ours).eval()(idx).logits, ours(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pad", [1, 64])
def test_untied_embeddings_export_as_untied_and_round_trip(pad: int) -> None:
    # Hugging Face's GPT-2 holds a separate head with tie_word_embeddings=False; a tied export would replace the
    # trained head with the input embedding and change the logits
    torch.manual_seed(3)
    ours = GPT(GPTConfig.preset("tiny", vocab_size=211, block_size=32, tie_embeddings=False,
                                pad_vocab_multiple=pad)).eval()
    assert ours.lm_head.weight.data_ptr() != ours.transformer.wte.weight.data_ptr()
    hf = gpt_to_hf(ours).eval()
    assert hf.config.tie_word_embeddings is False
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, 211, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=1e-5)
        back = gpt_from_hf(hf, pad_vocab_multiple=pad).eval()
        assert back.config.tie_embeddings is False
        torch.testing.assert_close(back(idx), ours(idx), rtol=0, atol=0)


def test_xavier_initialised_model_exports_with_the_same_logits() -> None:
    # the initialisation shapes training only; the trained weights are copied as they are
    torch.manual_seed(4)
    ours = GPT(GPTConfig.preset("tiny", vocab_size=211, block_size=32, init="xavier")).eval()
    idx = torch.randint(0, 211, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(gpt_to_hf(ours).eval()(idx).logits, ours(idx), rtol=0, atol=1e-5)
