"""AttentionLogitStatistics on Hugging Face families (GPT-2, Llama, Mistral, Mixtral, Gemma, Qwen2, Qwen3, Gemma 2,
Gemma 3, OLMo, OLMo 2): every statistic equals a direct computation on the q, k and weights the eager attention itself
receives, with its scale, soft-cap, sliding window and clamp; user q/k patterns measure the projections before the
rotary embedding."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hf_tiny import HFLM, hf_model
from support.callbacks import LitLM, assert_close, direct, fit_fixed
from torch import nn

from lnstab.callbacks import AttentionLogitStatistics


def eager_reference(hf: nn.Module, x: torch.Tensor, monkeypatch, kind: str) -> tuple[list, list]:
    """q, k as the eager attention receives them (after RoPE; k heads not yet repeated), with its scale, soft-cap
    and sliding window, and its weights."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    eager, seen = modeling.eager_attention_forward, []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.detach(), key.detach(), kwargs.get("scaling"),
                     {"softcap": kwargs.get("softcap"), "window": kwargs.get("sliding_window")}))
        return eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    implementation = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        weights = hf(input_ids=x, output_attentions=True, use_cache=False).attentions
    hf.set_attn_implementation(implementation)
    return seen, list(weights)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "mixtral", "gemma", "qwen2", "qwen3", "gemma2", "gemma3",
                                  "olmo", "olmo2"])
def test_hugging_face_models_against_eager_attention(tmp_path, monkeypatch, kind):
    hf = hf_model(kind)
    callback = AttentionLogitStatistics(every_n_steps=1)
    pattern = AttentionLogitStatistics(every_n_steps=1, q_pattern=r"self_attn\.q_proj$",
                                       k_pattern=r"self_attn\.k_proj$", n_head=4) if kind == "llama" else None
    projections = {}
    if pattern is not None:
        for i, layer in enumerate(hf.model.layers):
            for part in ("q", "k"):  # every call: the fit's two micro-batches first
                getattr(layer.self_attn, f"{part}_proj").register_forward_hook(
                    lambda m, a, o, key=(part, i): projections.setdefault(key, []).append(o.detach()) and None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, data = fit_fixed(tmp_path, LitLM(HFLM(hf)), [callback] + ([pattern] if pattern else []), steps=1)
    # q, k and the rotary embedding reach the tap by three hooks: one call of the attention, not three
    assert not [w for w in caught if "ran in one micro-batch" in str(w.message)], kind
    values = {0: callback.last}  # both instruments log the same tags: each one's own record
    seen, weights = eager_reference(hf, data[:4], monkeypatch, kind)
    assert callback.tags == ["L00", "L01"] and len(seen) == 2
    for i, ((q, k, scale, shape), p) in enumerate(zip(seen, weights, strict=True)):
        if kind == "gpt2":
            assert scale == pytest.approx(1 / math.sqrt(8) / (i + 1))  # scale_attn_by_inverse_layer_idx
        else:
            assert k.size(1) == 2 and q.size(1) == 4  # grouped-query attention: 2 k heads for 4 q heads
        if kind == "gemma2":  # both bind here: layer 0 slides over 5 keys, layer 1 sees all; every logit is capped
            assert scale == 0.5 and shape["softcap"] == 2.0 and shape["window"] == (5 if i == 0 else None)
            uncapped = direct([q], [k], scale, window=shape["window"])
        if kind in ("mistral", "mixtral", "qwen2", "qwen3", "gemma3"):  # Mistral slides on every layer (its config's)
            windows = {"mistral": (5, 5), "mixtral": (5, 5), "qwen2": (None, 5), "qwen3": (None, 5),
                       "gemma3": (5, None)}[kind]
            assert shape["window"] == windows[i]
        expected = direct([q], [k], scale, **shape)
        if kind == "olmo":  # the clip binds: q and k as the projections left them would give other logits
            assert q[:, :, 0].abs().max().item() == pytest.approx(0.05)  # position 0 is not rotated: clamped
        if shape["window"]:  # the window binds at T = 16: leaving it out would show
            assert direct([q], [k], scale)["entropy_mean"] != pytest.approx(expected["entropy_mean"], rel=1e-3)
        p = p.double()[..., 1:, :]  # the rows that count (min_keys=2)
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
        assert expected["entropy_mean"] == pytest.approx(entropy.mean().item(), rel=1e-5)  # the weights themselves
        assert expected["collapsed"] == (p.amax(-1) > 0.99).double().mean().item()
        assert_close(values[0], expected, f"L{i:02d}", kind)
        if kind == "gemma2":
            assert expected["max_logit"] > 3 * 2.0 and uncapped["max_logit"] == expected["max_logit"]
            assert expected["entropy_mean"] != pytest.approx(uncapped["entropy_mean"], rel=1e-2)
    if pattern is not None:  # user patterns on the projections: q and k before the rotary embedding
        for i in range(2):
            q = torch.cat(projections[("q", i)][:2]).view(4, 16, 4, 8).transpose(1, 2)  # (B, 4, T, hd)
            k = torch.cat(projections[("k", i)][:2]).view(4, 16, 2, 8).transpose(1, 2)  # (B, 2, T, hd)
            pre_rope = direct([q], [k], 1 / math.sqrt(8))
            got = pattern.last
            assert got[f"attn/max_logit/L{i:02d}"] == pytest.approx(pre_rope["max_logit"], rel=1e-5)
            assert got[f"attn/entropy_mean/L{i:02d}"] == pytest.approx(pre_rope["entropy_mean"], rel=1e-5)
            assert pre_rope["max_logit"] != pytest.approx(values[0][f"attn/max_logit/L{i:02d}"], rel=1e-3)
