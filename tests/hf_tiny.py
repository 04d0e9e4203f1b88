"""Tiny Hugging Face causal LMs built from configs (no download), one per family the attention instruments read,
each with what makes a layout or window mistake show: windows that bind at T = 16, grouped-query heads, q/k biases,
QK-norm gains away from 1, Gemma 2's soft-cap."""

from __future__ import annotations

import torch
from support.callbacks import VOCAB
from torch import nn


class HFLM(nn.Module):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits


def hf_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                            eos_token_id=0, scale_attn_by_inverse_layer_idx=True, attn_implementation="sdpa",
                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # the same forward in train mode
        return GPT2LMHeadModel(config)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "gemma2":  # soft-capping and a sliding window that bind at T = 16, query_pre_attn_scalar ≠ head_dim
        from transformers import Gemma2Config, Gemma2ForCausalLM

        model = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, query_pre_attn_scalar=4, attn_logit_softcapping=2.0,
                                               sliding_window=5, final_logit_softcapping=None,
                                               attn_implementation="eager"))
        with torch.no_grad():  # logits well past the cap, so that capping changes the weights
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 150
        return model
    if kind == "mixtral":  # Mistral's attention and config window, with experts in the MLP
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(**shape, sliding_window=5, num_local_experts=2, num_experts_per_tok=1,
                                                attn_implementation="eager"))
    if kind == "gemma":  # Llama's attention with its own head_dim (not hidden / heads)
        from transformers import GemmaConfig, GemmaForCausalLM

        return GemmaForCausalLM(GemmaConfig(**shape, head_dim=16, attn_implementation="eager"))
    if kind == "mistral":  # a sliding window that binds at T = 16, from the config, on every layer
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**shape, sliding_window=5, attn_implementation="eager"))
    if kind == "qwen2":  # q and k biases; a sliding window on layer 1 only
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=5,
                                             layer_types=["full_attention", "sliding_attention"],
                                             attn_implementation="eager"))
        with torch.no_grad():  # biases that are not zero, so that leaving them out would show
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
        return model
    if kind == "gemma3":  # q and k normalised per head, then rotated; a window on layer 0; no soft-cap
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, head_dim=8, query_pre_attn_scalar=4, sliding_window=5,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   attn_implementation="eager"))
        with torch.no_grad():  # gains away from Gemma's 1 + 0, so that reading q before its norm would show
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(0, 2)
                layer.self_attn.k_norm.weight.normal_(0, 2)
        return model
    if kind == "qwen3":  # q and k normalised per head before the heads move to the front, then rotated
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=8, use_sliding_window=True, sliding_window=5,
                                             layer_types=["full_attention", "sliding_attention"],
                                             attn_implementation="eager"))
        with torch.no_grad():  # gains away from 1, so that reading q before its norm would show
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(0, 2)
                layer.self_attn.k_norm.weight.normal_(0, 2)
        return model
    if kind == "olmo":  # OLMo 1: q and k clamped to ±clip_qkv, a bound that binds here, then rotated
        from transformers import OlmoConfig, OlmoForCausalLM

        model = OlmoForCausalLM(OlmoConfig(**shape, clip_qkv=0.05, attn_implementation="sdpa"))
        with torch.no_grad():  # projections well past the clip, so that leaving it out would show
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 20
                layer.self_attn.k_proj.weight *= 20
        return model
    if kind == "olmo2":  # q and k normalised over all heads after the projections, then rotated
        from transformers import Olmo2Config, Olmo2ForCausalLM

        return Olmo2ForCausalLM(Olmo2Config(**shape, attn_implementation="sdpa"))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
