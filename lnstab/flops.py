"""FLOPs of a training step of lnstab's GPT: the 6N + attention formula, and the same counted by Lightning.

Only matrix products count (the convention of PaLM's MFU and of ``torch.utils.flop_counter``): per token the forward
pass does ``2·N`` FLOPs for the ``N = 12·L·C² + C·V`` weights of the products (attention in/out, MLP, head) and
``4·L·T·C`` for attention scores and their weighted sum (full ``T × T``, as the counters count it, causal or not);
the backward pass does twice the forward. Norms, GELU, softmax and the optimizer are not counted.

The model options add no matrix product, so the count is the same with them: ``qk_norm`` is two norms over the
head dimension (about 10 elementwise FLOPs per query and key entry forward, ~20·C per token and layer against the
24·C² of the layer's products: 0.1 % at C = 768), DyT, the residual gates and DeepNorm's ``α·x`` are elementwise,
and the z-loss is a few operations per row of logits in the chunked head.
"""

from __future__ import annotations

import torch

from lnstab.model import GPT, GPTConfig


def training_flops(config: GPTConfig, batch_size: int, seq_len: int) -> int:
    """FLOPs of one forward + backward pass over ``batch_size × seq_len`` tokens (``6·N + 12·L·T·C`` per token).

    Args:
        config: The model's shape (``n_layer``, ``n_embd``, ``vocab_size``).
        batch_size: Sequences per batch.
        seq_len: Tokens per sequence ``T`` (the attention term grows with it).

    Returns:
        Training FLOPs per batch, counting matrix products only.
    """
    L, C, V = config.n_layer, config.n_embd, config.vocab_size
    matmul_params = 12 * L * C * C + C * V  # qkv 3C², attention out C², MLP 8C², head C·V (real rows only)
    per_token = 6 * matmul_params + 12 * L * seq_len * C  # 3 × (2·N + 4·L·T·C)
    return per_token * batch_size * seq_len


def measured_training_flops(config: GPTConfig, batch_size: int, seq_len: int) -> int:
    """The same, counted by Lightning's ``measure_flops`` on a meta-device model (no memory, no compute)."""
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = GPT(config)
        idx = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return measure_flops(model, lambda: model(idx, idx), loss_fn=lambda loss: loss)
