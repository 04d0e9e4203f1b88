"""AttentionLogitStatistics on torch.nn.MultiheadAttention (nn.TransformerEncoder's attention): its logits' softmax
equals the attention weights the module itself returns (need_weights=True, average_attn_weights=False)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.callbacks import VOCAB, LitLM, loader, trainer
from torch import nn

from lnstab.callbacks import AttentionLogitStatistics
from lnstab.callbacks._captures import MultiheadQK, attention_sites
from lnstab.errors import ConfigError


def weights_of(view) -> torch.Tensor:
    """softmax of the view's logits ``(B, nh, T, T)``, the causal mask applied where the view is causal."""
    z = view.q.float() @ view.k.float().transpose(-1, -2) * view.scale
    if view.causal:
        T = z.size(-1)
        z = z.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return z.softmax(dim=-1)


CAUSAL_FLOAT = nn.Transformer.generate_square_subsequent_mask(7)
CAUSAL_BOOL = torch.ones(7, 7, dtype=torch.bool).triu(1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "mask, is_causal, causal",
    [(None, False, False), (CAUSAL_FLOAT, False, True), (CAUSAL_BOOL, False, True), (CAUSAL_FLOAT, True, True)],
    ids=["none", "causal-float", "causal-bool", "is_causal"],
)
def test_logits_softmax_equals_the_modules_attention_weights(batch_first, bias, mask, is_causal, causal):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first)
    x = torch.randn(2, 7, 16) * 3  # (B, T, E)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()  # (T, B, E)
    kwargs = {"attn_mask": mask, "is_causal": is_causal}
    view = MultiheadQK(mha, {}).view((x, x, x), {**kwargs, "need_weights": False})
    with torch.no_grad():
        _, expected = mha(x, x, x, need_weights=True, average_attn_weights=False, **kwargs)  # (B, nh, T, T)
    assert view.causal is causal and view.q.shape == (2, 4, 7, 4)
    torch.testing.assert_close(weights_of(view), expected, rtol=1e-5, atol=1e-6)


class CausalEncoderLM(nn.Module):
    """nn.TransformerEncoder as a language model: a causal mask, or none (``causal=False``)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1)) if self.causal else None
        return self.head(self.encoder(self.embed(x), mask=mask, is_causal=self.causal))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
def test_transformer_encoder_statistics_equal_the_modules_own_weights(tmp_path, causal):
    torch.manual_seed(0)
    module = LitLM(CausalEncoderLM(causal))
    seen: dict[int, tuple[nn.Module, torch.Tensor, dict]] = {}

    def keep(i):
        def hook(m, args, kwargs):
            if m.training and i not in seen:  # the first training call: step 0's weights and input
                seen[i] = (copy.deepcopy(m), args[0].detach().clone(), dict(kwargs))
        return hook

    for i, layer in enumerate(module.model.encoder.layers):
        layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True)
    callback = AttentionLogitStatistics(every_n_steps=10)
    trainer(tmp_path, [callback], max_steps=1).fit(module, loader(n=4))
    assert callback.tags == ["L00", "L01"] and callback.steps == [0]
    for i, (mha, x, kwargs) in seen.items():
        with torch.no_grad():
            _, p = mha.eval()(x, x, x, need_weights=True, average_attn_weights=False,
                              attn_mask=kwargs.get("attn_mask"))  # (B, nh, T, T)
        rows = p[..., 1:, :] if causal else p  # min_keys=2: a causal first row (one key) does not count
        entropy = -(rows * rows.clamp_min(1e-30).log()).sum(-1)
        tag = f"L{i:02d}"
        assert callback.last[f"attn/entropy_mean/{tag}"] == pytest.approx(entropy.mean().item(), rel=1e-4)
        assert callback.last[f"attn/entropy_min/{tag}"] == pytest.approx(entropy.min().item(), rel=1e-4)
        assert callback.last[f"attn/collapsed/{tag}"] == (rows.amax(-1) > 0.99).double().mean().item()
    # a causal row t has t + 1 keys, an encoder's every row all 16: the mean entropy tells them apart
    assert (callback.last["attn/entropy_mean/L00"] < math.log(16) * 0.9) == causal


def test_decoder_cross_attention_is_left_out_and_other_masks_refused():
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), 2)
    sites = attention_sites(decoder, {})
    assert [(s.tag, s.name) for s in sites] == [("L00", "layers.0.self_attn"), ("L01", "layers.1.self_attn")]
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    band = torch.ones(5, 5, dtype=torch.bool).triu(2)  # neither causal nor empty
    with pytest.raises(ConfigError, match=r"^MultiheadAttention's attn_mask of shape \(5, 5\) is not allowed"):
        MultiheadQK(mha, {}).view((x, x, x), {"attn_mask": band})
    with pytest.raises(ConfigError, match="cross-attention"):
        MultiheadQK(mha, {}).view((x, torch.randn(2, 5, 16), x), {})
