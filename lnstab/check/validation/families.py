"""The Hugging Face families the validation rows build (``hf:`` in ``rows.yaml`` and ``heldout.yaml``): each a config
at the check's shape, built without a download. ``transformers`` is imported only when a config is built."""

from __future__ import annotations


def _rotary_config(name: str, n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int,
                   **extra: object) -> object:
    """``transformers.<name>`` at a given shape: the MLP four times wide, full multi-head attention."""
    import transformers

    return getattr(transformers, name)(
        hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer, num_attention_heads=n_head,
        num_key_value_heads=n_head, vocab_size=vocab_size, max_position_embeddings=block_size, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, **extra)


def gemma2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """Gemma 2 at a given shape: head width ``n_embd / n_head`` (and ``query_pre_attn_scalar`` that width, as Gemma 2's
    2B/9B models set it), GeGLU four times wide, eager attention (its logit soft-capping needs it)."""
    head = n_embd // n_head
    config = _rotary_config("Gemma2Config", n_layer, n_embd, n_head, block_size, vocab_size, head_dim=head,
                            query_pre_attn_scalar=head)
    config._attn_implementation = "eager"
    return config


def llama_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """Llama at a given shape: pre-RMSNorm, SwiGLU four times wide (LLaMA's own is 8/3 wide), rotary positions, no
    biases, an untied head, full multi-head attention."""
    return _rotary_config("LlamaConfig", n_layer, n_embd, n_head, block_size, vocab_size)


def olmo2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """OLMo 2 at a given shape: the reordered norm ``x + RMSNorm(f(x))``, QK-norm over all heads, SwiGLU four times
    wide, rotary positions, an untied head. Its Hugging Face loss has no z-loss (OLMo 2's training adds one)."""
    return _rotary_config("Olmo2Config", n_layer, n_embd, n_head, block_size, vocab_size)


def gpt2_config(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> object:
    """GPT-2 at a given shape (Hugging Face's ``GPT2LMHeadModel``: Pre-LN, tied head, its own initialisation)."""
    from transformers import GPT2Config

    return GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=block_size, vocab_size=vocab_size,
                      bos_token_id=0, eos_token_id=0)


# family -> (config at a shape, the model class's name in transformers, the family's name in words)
HF_FAMILIES = {
    "gemma2": (gemma2_config, "Gemma2ForCausalLM", "Gemma 2"),
    "llama": (llama_config, "LlamaForCausalLM", "Llama"),
    "olmo2": (olmo2_config, "Olmo2ForCausalLM", "OLMo 2"),
    "gpt2": (gpt2_config, "GPT2LMHeadModel", "GPT-2"),
}
