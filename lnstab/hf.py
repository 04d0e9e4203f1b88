"""Hugging Face interop: load a ``transformers.GPT2LMHeadModel`` into lnstab's GPT and export it back (Pre-LN).

Hugging Face stores GPT-2's projections as ``Conv1D`` with weights ``(in, out)``; lnstab (like nanoGPT) uses
``nn.Linear`` with ``(out, in)``, so exactly those four weights per block are transposed and everything else is
copied as is. Imported lazily: ``transformers`` is needed only when these functions are called.

The export refuses, in one line, every option Hugging Face's GPT-2 cannot express: a placement other than Pre-LN
(or one that weights the stream, as DeepNorm), RMSNorm or DyT, ``qk_norm``, a residual gate, Δt ≠ 1, no biases.
``z_loss`` and ``init`` export: they shape training only, and the exported model computes the same logits; untied
embeddings (``tie_embeddings=False``) export as ``tie_word_embeddings=False`` with their own ``lm_head.weight``.
A model trained on a relabelled vocabulary (``--data.vocab compact|top_k``) exports as it is, ids and all: its ids
are not GPT-2's, and the run's ``vocab.json`` maps them back (``kept[i]`` is the GPT-2 id of id ``i``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lnstab.errors import ConfigError
from lnstab.model import GPT, PLACEMENTS, GPTConfig

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Hugging Face's GPT-2 normalises each sublayer's input (ln_1, ln_2) and the stream before the head (ln_f), nothing
# else: a placement exports when its row of lnstab.model.PLACEMENTS has exactly these norms.
HF_GPT2_NORMS = frozenset({"input", "final"})


def config_from_hf(hf_config: Any, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers.GPT2Config`` (Pre-LN, LayerNorm, biases on)."""
    if getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"activation_function={hf_config.activation_function!r} is not allowed; lnstab's GPT uses gelu_new"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf_config, flag, False):
            raise ConfigError(f"{flag}=True is not allowed; lnstab's GPT implements GPT-2's attention without it")
    values = dict(
        block_size=hf_config.n_positions,
        vocab_size=hf_config.vocab_size,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        bias=True,
        norm_eps=hf_config.layer_norm_epsilon,
        norm_placement="pre",
        norm_type="layernorm",
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
    )
    values.update(overrides)
    return GPTConfig(**values)


def gpt_from_hf(hf_model: GPT2LMHeadModel, **overrides: Any) -> GPT:
    """An lnstab :class:`GPT` with the weights of ``hf_model``; logits agree with Hugging Face's."""
    config = config_from_hf(hf_model.config, **overrides)
    model = GPT(config)
    source = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    target = model.state_dict()
    converted = {}
    for key, value in source.items():
        if key not in target:
            raise ConfigError(f"Hugging Face weight {key!r} has no counterpart in lnstab's GPT")
        value = value.t() if key.endswith(CONV1D_SUFFIXES) else value
        if key in ("transformer.wte.weight", "lm_head.weight") and value.shape != target[key].shape:
            padded = target[key].clone()  # vocab padding rows keep their init; they are never predicted
            padded[: value.size(0)] = value
            value = padded
        converted[key] = value
    missing = [k for k in target if k not in converted]
    if missing:
        raise ConfigError(f"Hugging Face checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}")
    model.load_state_dict(converted)
    return model


def gpt_to_hf(model: GPT) -> GPT2LMHeadModel:
    """A ``transformers.GPT2LMHeadModel`` with the weights of a Pre-LN, LayerNorm, biased lnstab :class:`GPT`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    exportable = [name for name, p in PLACEMENTS.items() if p.norms == HF_GPT2_NORMS and p.stream_scale is None]
    if c.norm_placement not in exportable or c.norm_type != "layernorm":
        raise ConfigError(
            f"norm_placement={c.norm_placement!r}, norm_type={c.norm_type!r} cannot be exported; Hugging Face's "
            f"GPT-2 is norm_placement={' or '.join(map(repr, exportable))} with norm_type='layernorm'"
        )
    if not c.bias:
        raise ConfigError("bias=False cannot be exported; Hugging Face's GPT-2 has biases (use bias=True)")
    if c.residual_scale != 1.0:
        raise ConfigError(f"residual_scale={c.residual_scale} cannot be exported; Hugging Face's GPT-2 has Δt = 1")
    if c.qk_norm:
        raise ConfigError("qk_norm=True cannot be exported; Hugging Face's GPT-2 has no query/key norms")
    if c.residual_gate != "none":
        raise ConfigError(
            f"residual_gate={c.residual_gate!r} cannot be exported; Hugging Face's GPT-2 has no residual gates"
        )
    hf_config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        layer_norm_epsilon=c.norm_eps,
        activation_function="gelu_new",
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        tie_word_embeddings=c.tie_embeddings,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    target = hf_model.state_dict()
    converted = {}
    for key, value in model.state_dict().items():
        value = value.t() if key.endswith(CONV1D_SUFFIXES) else value
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[: c.vocab_size]
        converted[key] = value.detach().clone()
    unexpected = [k for k in converted if k not in target]
    if unexpected:
        raise ConfigError(f"weight {unexpected[0]!r} has no counterpart in Hugging Face's GPT-2")
    with torch.no_grad():
        hf_model.load_state_dict(converted, strict=False)
    missing = [k for k in target if k not in converted and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing:
        raise ConfigError(f"lnstab's GPT lacks {len(missing)} weights Hugging Face needs, e.g. {missing[0]!r}")
    return hf_model
