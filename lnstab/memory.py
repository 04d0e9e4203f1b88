"""Per-GPU memory of a training step, from parameters, gradients, optimizer state and saved activations.

An estimate for planning (which batch fits, whether activation checkpointing is needed), not a measurement: it counts
the tensors a step keeps, in the dtypes they have, and leaves out the CUDA context (~0.5 GiB), the caching
allocator's fragmentation and NCCL buffers. The activation term is checked against the tensors autograd actually
saves (``torch.autograd.graph.saved_tensors_hooks``) in the tests.

Saved activations per layer, for ``n = B·T`` tokens of width ``C`` (``a`` bytes per activation: 2 under
``bf16-mixed``, 4 under ``32-true``; norms run in fp32 under autocast, so their saved inputs are 4 bytes)::

    c_attn input a·C, q/k/v a·3C, attention output a·C, c_fc input a·C, MLP hidden a·4C, GELU output a·4C
    + every real norm's fp32 input 4·C (2 per block for pre, post, output and deepnorm, 4 for peri, 0 for none:
      the placement table's row), with mean/rstd (LayerNorm), the normalised input and rstd (RMSNorm, composite
      in torch: another 4·C) or tanh's output (DyT: another 4·C)
    + the attention's log-sum-exp, 4 bytes per head
    + with ``qk_norm``: the normalised q and k (2·4·C) and what their norms keep beside them, and for LayerNorm and
      RMSNorm a copy of the attention output (4·C) (:func:`qk_norm_bytes_per_token`)
    + with a residual gate: the sublayer output each gate multiplies (2·4·C; ``a·C`` each under bf16 without an
      output norm)

``z_loss`` adds nothing: its gradient only rescales the softmax rows the chunked head already forms.

The head and loss (:func:`lnstab.loss.lm_head_loss`) keep ``a·n·C`` (the hidden state's gradient) and an fp32 weight
gradient ``4·V·C``; the usual path keeps fp32 log-probabilities ``4·n·V`` and needs two more such tensors in the
backward pass. With activation checkpointing per Block only each block's input (``4·n·C``) is kept, and one block's
activations are rebuilt at a time in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from lnstab.model import PLACEMENTS, GPTConfig

GIB = 1024**3
STRATEGIES = ("ddp", "fsdp", "single")
PRECISIONS = ("bf16-mixed", "32-true")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one training step, by what holds them; :attr:`total` is their sum."""

    params: int
    grads: int
    optimizer: int
    gradient_buckets: int
    low_precision_weights: int
    activations: int
    head: int
    working: int

    @property
    def total(self) -> int:
        return sum(vars(self).values())

    def as_gib(self) -> dict[str, float]:
        """Every term and the total in GiB."""
        return {**{k: v / GIB for k, v in vars(self).items()}, "total": self.total / GIB}


def norms_per_block(config: GPTConfig) -> int:
    """Real norms of one Block under the config's placement (its row of :data:`lnstab.model.PLACEMENTS`)."""
    row = PLACEMENTS[config.norm_placement]
    return 2 * (row.input + row.output + row.post)


def norm_params(config: GPTConfig, width: int) -> int:
    """Parameters of one norm of ``width`` channels: γ, β with biases (LayerNorm, DyT), and DyT's α."""
    beta = width if config.bias and config.norm_type != "rmsnorm" else 0
    return width + beta + (1 if config.norm_type == "dyt" else 0)


def block_params(config: GPTConfig) -> int:
    """Parameters of one Block: four matrices (12·C²), their biases, the norms' and query/key norms' parameters,
    and the gates."""
    C, bias = config.n_embd, config.bias
    n = 12 * C * C + (9 * C if bias else 0)  # c_attn 3C² + 3C, attn c_proj C² + C, c_fc 4C² + 4C, mlp c_proj 4C² + C
    qk = 2 * norm_params(config, C // config.n_head) if config.qk_norm else 0
    gates = 2 * {"none": 0, "rezero": 1, "layerscale": C}[config.residual_gate]
    return n + norms_per_block(config) * norm_params(config, C) + qk + gates


def total_params(config: GPTConfig) -> int:
    """Unique parameters of the GPT (a tied head counted once), as ``GPT(config).num_params()``."""
    C = config.n_embd
    final = norm_params(config, C) if PLACEMENTS[config.norm_placement].final else 0
    embeddings = (1 if config.tie_embeddings else 2) * config.padded_vocab_size * C  # wte (+ an untied lm_head)
    return embeddings + config.block_size * C + config.n_layer * block_params(config) + final


def norm_bytes_per_token(config: GPTConfig) -> int:
    """What one norm saves per token: LayerNorm its fp32 input, mean and rstd; RMSNorm (composite in torch) its input,
    the normalised input and rstd; DyT its input and tanh's output."""
    C = config.n_embd
    return {"layernorm": 4 * C + 8, "rmsnorm": 8 * C + 4, "dyt": 8 * C}[config.norm_type]


def qk_norm_bytes_per_token(config: GPTConfig) -> int:
    """What ``qk_norm`` adds per token to one Block's saved tensors (0 when off), as measured with the CPU kernels:
    the normalised q and k (2·4·C; their inputs are views of the c_attn output, already kept) and what each norm
    keeps beside them (LayerNorm mean and rstd, 8 bytes per head; RMSNorm the normalised input and rstd, 4·C + 4 per
    head; DyT tanh's output, 4·C); LayerNorm and RMSNorm return q in a fresh layout, so the attention output is then
    copied to ``(B, T, C)`` (4·C), which DyT (elementwise, layout-preserving) avoids."""
    if not config.qk_norm:
        return 0
    C, H = config.n_embd, config.n_head
    per_norm = {"layernorm": 4 * C + 8 * H, "rmsnorm": 8 * C + 4 * H, "dyt": 8 * C}[config.norm_type]
    return 2 * per_norm + (0 if config.norm_type == "dyt" else 4 * C)


def activation_bytes_per_layer(config: GPTConfig, tokens: int, act_bytes: int) -> int:
    """Bytes autograd keeps for one Block over ``tokens`` positions (module docstring)."""
    C, H = config.n_embd, config.n_head
    linear_side = act_bytes * (C + 3 * C + C + C + 4 * C + 4 * C)  # c_attn in, qkv, attn out, c_fc in, hidden, GELU
    norm_side = norms_per_block(config) * norm_bytes_per_token(config) + qk_norm_bytes_per_token(config)
    lse = 4 * H  # attention log-sum-exp per head per token
    # a gate keeps the sublayer output it multiplies: fp32 after an output norm, else in the activations' dtype
    gated = 4 if PLACEMENTS[config.norm_placement].output else act_bytes
    gates = 0 if config.residual_gate == "none" else 2 * C * gated
    return tokens * (linear_side + norm_side + lse + gates)


def estimate_memory(
    config: GPTConfig,
    micro_batch: int,
    seq_len: int | None = None,
    *,
    precision: str = "bf16-mixed",
    strategy: str = "ddp",
    world_size: int = 1,
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
    loss_chunk_rows: int = 128,
) -> MemoryEstimate:
    """Peak memory per GPU of a training step under Lightning's DDP or FSDP (FULL_SHARD) with AdamW.

    Args:
        config: The model's shape.
        micro_batch: Sequences per GPU per forward pass (the config's ``data.batch_size``; gradient accumulation does
            not change the peak).
        seq_len: Tokens per sequence (``None``: ``config.block_size``).
        precision: ``bf16-mixed`` (fp32 master weights, bf16 products) or ``32-true``.
        strategy: ``ddp`` (full replica, gradient buckets as large as the gradients), ``fsdp`` (parameters,
            gradients and optimizer state sharded over ``world_size``, one Block gathered at a time plus one
            prefetched) or ``single`` (one device, no buckets).
        world_size: GPUs the model is sharded over (FSDP only).
        activation_checkpointing: Recompute each Block in the backward pass (FSDPStrategy's
            ``activation_checkpointing_policy``), keeping only its input.
        chunked_loss: The head and loss of :func:`lnstab.loss.lm_head_loss` (lnstab's training path) instead of
            whole-batch logits.
        loss_chunk_rows: Rows per chunk of the chunked loss.

    Returns:
        A :class:`MemoryEstimate` in bytes.

    Raises:
        ValueError: An unknown strategy or precision, or a non-positive batch or world size.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not allowed; choose one of: {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed; choose one of: {', '.join(PRECISIONS)}")
    if micro_batch < 1 or world_size < 1:
        raise ValueError(f"micro_batch={micro_batch}, world_size={world_size} are not allowed; both must be >= 1")
    T = seq_len or config.block_size
    n, C, V, L = micro_batch * T, config.n_embd, config.padded_vocab_size, config.n_layer
    a = 2 if precision == "bf16-mixed" else 4
    N, per_block = total_params(config), block_params(config)
    shard = world_size if strategy == "fsdp" else 1

    params, grads, optimizer = 4 * N // shard, 4 * N // shard, 8 * N // shard  # fp32 weights, grads, Adam m and v
    buckets = 4 * N if strategy == "ddp" else 0  # DDP's reducer buffers (gradient_as_bucket_view=False)
    if strategy == "fsdp":  # gathered units: the root (embeddings, final norm) and two Blocks; their unsharded grads
        root = V * C + config.block_size * C
        low = a * (root + 2 * per_block) + a * per_block + (a * root if a == 2 else 0)
    else:  # autocast's bf16 copies of the block matrices, kept for the backward pass
        low = 2 * L * 12 * C * C if a == 2 else 0

    layer = activation_bytes_per_layer(config, n, a)
    if activation_checkpointing:
        activations = L * 4 * n * C + layer  # block inputs, and one block rebuilt in the backward pass
    else:
        activations = L * layer
    if PLACEMENTS[config.norm_placement].final:
        activations += n * norm_bytes_per_token(config)  # the final norm
    activations += 8 * (n + T)  # token and position ids for the embeddings' backward
    working = 3 * 4 * n * 4 * C  # backward of one MLP: gradients of its widest tensors
    if chunked_loss:
        head = a * n * C + 4 * V * C  # the stored gradients of the hidden state and the head weight
        working = max(working, 4 * min(loss_chunk_rows, n) * V + (a * min(loss_chunk_rows, n) * V if a == 2 else 0))
    else:
        head = 4 * n * V  # fp32 log-probabilities
        working = max(working, 2 * 4 * n * V + (a * n * V if a == 2 else 0))  # their gradients; bf16 logits
    return MemoryEstimate(params, grads, optimizer, buckets, low, activations, head, working)
