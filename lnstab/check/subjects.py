"""The models a check trains: the checked model (lnstab's family, a Hugging Face causal LM or a factory) and its
Pre-LN and Peri-LN references of the same width, depth and context, each a :class:`Subject` built from a picklable
recipe (so that a worker process builds the same model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from torch import nn

from lnstab.callbacks.sites import (
    BLOCK_PATTERN,
    COLLAPSE_WEIGHT,
    DEFAULT_CHUNK_ELEMENTS,
    DEFAULT_CHUNK_ROWS,
    EMBED_PATTERN,
    FINAL_PATTERN,
    HEAD_PATTERN,
    LNSTAB_RESIDUALS,
    OUTPUT_NORMS,
    PARAM_LAYER_PATTERN,
    attention_sites,
    output_site,
)
from lnstab.check import hf
from lnstab.check.runspec import Sites
from lnstab.errors import LNStabError
from lnstab.loss import z_loss_coefficient
from lnstab.model import GPT, GPTConfig
from lnstab.moduleargs import MODEL_ARGS, MODULE_ARGS, gpt_config
from lnstab.safeload import check_yaml_text

# Where the instruments look in lnstab's GPT (and, with defaults, in Hugging Face GPT-2): half-step residual modules.
LNSTAB_SITES = Sites(
    hidden_pattern=LNSTAB_RESIDUALS,
    embed_pattern=EMBED_PATTERN,
    final_pattern=FINAL_PATTERN,
    block_pattern=r"(?:^|\.)h\.(\d+)$",
    param_pattern=r"(?:^|\.)h\.(\d+)\.",
    norm_pattern=OUTPUT_NORMS,
)
# Hugging Face decoders: numbered blocks (GPT-2 ``transformer.h.3``, Llama-style ``model.layers.3``).
HF_SITES = Sites(
    hidden_pattern=BLOCK_PATTERN,
    embed_pattern=EMBED_PATTERN,
    final_pattern=r"(?:^|\.)(?:transformer\.ln_f|model\.norm|model\.final_layernorm)$",
    block_pattern=BLOCK_PATTERN,
    param_pattern=PARAM_LAYER_PATTERN,
)
REFERENCES = {"pre-ln": "pre", "peri-ln": "peri"}
# What a reference copies from a checked lnstab GPT: its shape and the choices that are not about its norms or residual
# stream. Every other GPTConfig field (norm type, Δt, QK-norm, z-loss, gates, dropout, an option added later) is
# GPTConfig's default.
REFERENCE_KEEPS = ("block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_embd", "bias", "norm_eps",
                   "tie_embeddings", "init")
# GPTModule arguments that are optimisation settings of the stress runs rather than architecture.
OPTIMISATION_ARGS = ("weight_decay", "betas", "eps", "warmup_steps")
UNUSED_ARGS = ("min_lr", "lr_decay_steps", "compile")
DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass(frozen=True)
class Shape:
    """What the references copy from the checked model (``None``: unknown)."""

    n_layer: int
    n_embd: int
    block_size: int | None
    vocab_size: int
    n_head: int | None = None


@dataclass(frozen=True)
class LnstabRecipe:
    """lnstab's GPT of ``config``."""

    config: GPTConfig

    def build(self) -> nn.Module:
        return GPT(self.config)

    def with_vocab(self, vocab_size: int) -> LnstabRecipe:
        return LnstabRecipe(dataclasses.replace(self.config, vocab_size=vocab_size))


def dropout_off(model: nn.Module) -> int:
    """Set every dropout module's probability to 0, and ``nn.MultiheadAttention``'s attention dropout (a float it
    applies functionally); how many were above 0."""
    changed = 0
    for module in model.modules():
        if isinstance(module, DROPOUT_TYPES) and module.p > 0:
            module.p = 0.0
            changed += 1
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            module.dropout = 0.0
            changed += 1
    return changed


@dataclass
class Subject:
    """One model of the check.

    Attributes:
        key: ``checked``, ``pre-ln`` or ``peri-ln`` (directory and JSON key).
        label: How the report names it.
        recipe: Builds a fresh model (the caller seeds torch first), in this process or a worker.
        sites: Where the instruments look.
        shape: Width, depth, context and vocabulary.
        config: The lnstab :class:`GPTConfig` when the model is lnstab's (references, dedup of identical models).
        same_as: Key of an identical subject whose runs this one reuses.
        name: A short name for the run directory.
        dropout: How dropout was switched off (the card says it; the runs train in train mode).
        own_vocab: The model's own vocabulary when it is built with the protocol's smaller one, else ``None``.
        z_loss: PaLM's z-loss coefficient ``c`` of a Hugging Face or factory model: it trains on its cross-entropy
            plus ``c·mean (log Z)²`` (``--z-loss``; lnstab's GPT carries its own in ``config.z_loss``).
    """

    key: str
    label: str
    recipe: Any
    sites: Sites
    shape: Shape
    config: GPTConfig | None = None
    same_as: str | None = None
    name: str = "model"
    dropout: str = ""
    own_vocab: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    z_loss: float = 0.0

    def build(self) -> nn.Module:
        """A fresh model with every dropout module at probability 0 (seed torch first)."""
        model = self.recipe.build()
        dropout_off(model)
        return model

    def with_vocab(self, vocab_size: int) -> Subject | None:
        """This subject built with the protocol's vocabulary ``vocab_size``, or ``None`` where its vocabulary is
        fixed (trained Hugging Face weights, a factory function without a ``vocab_size`` argument)."""
        recipe = self.recipe.with_vocab(vocab_size)
        if recipe is None:
            return None
        config = recipe.config if isinstance(recipe, LnstabRecipe) else None
        return dataclasses.replace(self, recipe=recipe, config=config,
                                   shape=dataclasses.replace(self.shape, vocab_size=vocab_size),
                                   own_vocab=self.own_vocab or self.shape.vocab_size)


def attention_problem(model: nn.Module, qk: tuple[str, str, int] | None = None) -> str | None:
    """Why the attention-logit instrument cannot read ``model``'s q and k (``qk``: named projections), or ``None``."""
    options = {"chunk_elements": DEFAULT_CHUNK_ELEMENTS, "min_keys": 2, "collapse_weight": COLLAPSE_WEIGHT}
    q, k, n_head = (re.compile(qk[0]), re.compile(qk[1]), qk[2]) if qk else (None, None, None)
    try:
        attention_sites(model, options, q, k, n_head)
    except (ValueError, LNStabError) as exc:
        return str(exc)
    return None


def instrument_support(model: nn.Module, head_pattern: str | None = None,
                       qk: tuple[str, str, int] | None = None) -> tuple[bool, bool]:
    """Whether the attention-logit instrument finds q and k in ``model`` (``qk``: named projections), and the
    output-logit one its logits."""
    try:
        output_site(model, "auto", re.compile(FINAL_PATTERN), re.compile(head_pattern or HEAD_PATTERN), None,
                    DEFAULT_CHUNK_ROWS)
        logits = True
    except (ValueError, LNStabError):
        logits = False
    return attention_problem(model, qk) is None, logits


def parse_value(text: str) -> Any:
    """A ``--model.KEY`` value as YAML (``4``, ``0.5``, ``true``, ``null``, ``[0.9, 0.95]``, strings), within
    :mod:`lnstab.safeload`'s bounds (a value that is not YAML stays a string; ``1e-4``, a string to YAML 1.1, is a
    number)."""
    check_yaml_text(text, "a --model.* value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and value.strip().lower() not in ("nan", "inf", "-inf", "+inf"):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 1e-4 (no dot) as a string
            return float(value)
    return value


def describe_config(config: GPTConfig) -> str:
    """``output, layernorm, Δt=1, qk_norm, z_loss 0.0001`` (the options that are on)."""
    parts = [config.norm_placement, config.norm_type, f"Δt={config.residual_scale:g}"]
    parts += ["qk_norm"] if config.qk_norm else []
    parts += [f"z_loss {config.z_loss:g}"] if config.z_loss else []
    parts += [config.residual_gate] if config.residual_gate != "none" else []
    parts += ["untied"] if not config.tie_embeddings else []
    parts += [f"{config.init} init"] if config.init != "gpt2" else []
    return ", ".join(parts)


def lnstab_subject(args: dict[str, Any]) -> tuple[Subject, dict[str, Any]]:
    """The checked model from ``--model.KEY VALUE`` arguments (any ``GPTModule`` argument).

    Returns the subject and the optimisation overrides among the arguments (``weight_decay``, ``betas``, ``eps``,
    ``warmup_steps``; ``learning_rate`` is handed back too, as a one-rung ladder). Dropout is switched off in the
    config (the runs train in train mode).
    """
    for key in args:
        if key not in MODULE_ARGS:
            raise LNStabError(f"--model.{key} is not allowed; GPTModule takes: {', '.join(MODULE_ARGS)}")
        if key == "compile":
            raise LNStabError("--model.compile is not used by lnstab check; its short runs are eager")
        if key == "weight_decay_mode" and args[key] != "coupled":
            raise LNStabError(
                f"--model.weight_decay_mode={args[key]} is not used by lnstab check; its runs decay weights as "
                "PyTorch's AdamW does (coupled to the learning rate), by --weight-decay"
            )
        if key in UNUSED_ARGS:
            raise LNStabError(
                f"--model.{key} is not used by lnstab check; its runs warm up for --warmup-steps and decay by cosine "
                "to --min-lr-ratio of each learning rate at --steps"
            )
    arch = {k: v for k, v in args.items() if k in ("preset", *MODEL_ARGS)}
    given = gpt_config(arch)
    config = dataclasses.replace(given, dropout=0.0)
    options = "".join(f"-{o}" for o, on in (("qknorm", config.qk_norm), (f"z{config.z_loss:g}", config.z_loss),
                                               (config.residual_gate, config.residual_gate != "none"),
                                               ("untied", not config.tie_embeddings),
                                               (config.init, config.init != "gpt2")) if on)
    name = (f"{arch.get('preset', 'gpt2')}-{config.norm_placement}-{config.norm_type}-dt{config.residual_scale:g}"
            + options)
    subject = Subject(
        key="checked",
        label=f"checked ({describe_config(config)})",
        recipe=LnstabRecipe(config),
        sites=LNSTAB_SITES,
        shape=Shape(config.n_layer, config.n_embd, config.block_size, config.vocab_size, config.n_head),
        config=config,
        name=name,
        dropout=f"train mode; dropout {given.dropout:g} set to 0 in the config" if given.dropout else (
            "train mode; dropout 0 in the config (lnstab's GPT has no other training-only branch)"),
    )
    extra = {k: v for k, v in args.items() if k in (*OPTIMISATION_ARGS, "learning_rate")}
    return subject, extra


def check_z_loss(z_loss: float | None) -> float | None:
    """``--z-loss`` as given (``None``: not given), or a one-line error when it is negative or not finite."""
    return None if z_loss is None else z_loss_coefficient(z_loss, "--z-loss", error=LNStabError)


def with_z_loss(subject: Subject, z_loss: float | None) -> Subject:
    """``subject`` (a Hugging Face or factory model) trained on its cross-entropy plus PaLM's z-loss
    ``z_loss·mean (log Z)²`` (``--z-loss``); the references train without it.

    Raises:
        LNStabError: ``z_loss`` is negative or not finite, or ``subject`` is lnstab's GPT (``--model.z_loss``).
    """
    z_loss = check_z_loss(z_loss)
    if z_loss is None:
        return subject
    if subject.config is not None:
        raise LNStabError("--z-loss is for --hf and --factory models; lnstab's GPT takes --model.z_loss "
                          "(computed in its chunked head)")
    return dataclasses.replace(subject, z_loss=z_loss)


def hf_subject(name: str, init: bool) -> Subject:
    """A Hugging Face causal LM: a local directory or a hub name, trained weights or (``init``) its config's init, never
    remote code (``transformers`` refuses what needs it), every dropout probability of its config set to 0."""
    config, local = hf.load_config(name)
    if getattr(config, "text_config", None) is not None or getattr(config, "vision_config", None) is not None:
        raise LNStabError(f"--hf {name!r} is a multimodal model ({config.model_type}); lnstab check reads text-only "
                          "causal LMs: give a directory of its text model (saved from its text_config)")
    dropped = hf.dropout_overrides(config)
    recipe = hf.HFRecipe(name, init, tuple(dropped.items()), local)
    try:
        probe = recipe.build()
    except Exception as exc:
        raise hf.load_error(name, "is not a causal language model lnstab check can load", exc) from None
    attention, logits = instrument_support(probe)
    del probe
    sites = dataclasses.replace(HF_SITES, norm_pattern=hf.norm_pattern(config.model_type), attention=attention,
                                logits=logits)
    base = os.path.basename(os.path.normpath(name)) or "model"
    part = ", decoder only" if getattr(config, "is_encoder_decoder", False) else ""
    label = f"checked ({config.model_type}{part}{', init' if init else ''})"
    note = (f"train mode; dropout set to 0 in its config ({', '.join(sorted(dropped))})" if dropped else
            "train mode; no dropout in its config") + " and in every nn.Dropout"
    left = hf.training_only(config)
    if left:
        note += f"; left on as training-only branches: {', '.join(f'{k} {v:g}' for k, v in sorted(left.items()))}"
    if getattr(config, "auto_map", None):
        note += f"; its auto_map (custom code) is ignored: the built-in {config.model_type} classes run"
    return Subject("checked", label, recipe, sites, Shape(**hf.config_shape(config)),
                   name=f"hf-{base}{'-init' if init else ''}", dropout=note)


def reference_config(checked: Subject, placement: str, seq_len: int) -> GPTConfig:
    """lnstab's GPT-2 block (LayerNorm, Δt = 1, every option at :class:`GPTConfig`'s default) under ``placement``,
    with the checked model's shape: a checked lnstab GPT's :data:`REFERENCE_KEEPS`, else its :class:`Shape`."""
    if checked.config is not None:
        return GPTConfig(norm_placement=placement, **{k: getattr(checked.config, k) for k in REFERENCE_KEEPS})
    shape = checked.shape
    heads = shape.n_head if shape.n_head and shape.n_embd % shape.n_head == 0 else None
    if heads is None:  # unknown: heads of 64 channels where the width allows, else one head
        heads = next(h for h in range(max(1, shape.n_embd // 64), 0, -1) if shape.n_embd % h == 0)
    return GPTConfig(block_size=shape.block_size or seq_len, vocab_size=shape.vocab_size, n_layer=shape.n_layer,
                     n_head=heads, n_embd=shape.n_embd, norm_placement=placement)


def references(checked: Subject, seq_len: int) -> list[Subject]:
    """The Pre-LN and Peri-LN references of ``checked``; one identical to it reuses its runs (``same_as``)."""
    out = []
    for key, placement in REFERENCES.items():
        config = reference_config(checked, placement, seq_len)
        label = f"{placement.capitalize()}-LN reference"
        out.append(Subject(key, label, LnstabRecipe(config), LNSTAB_SITES,
                           Shape(config.n_layer, config.n_embd, config.block_size, config.vocab_size, config.n_head),
                           config, same_as="checked" if checked.config == config else None,
                           dropout="train mode; dropout 0 in the config",
                           own_vocab=checked.own_vocab))
    return out


def context_length(checked: Subject, seq_len: int, given: bool = False) -> int:
    """The sequence length of the stress runs: ``seq_len``, at most the model's context.

    A default ``seq_len`` longer than the context is cut to it; one the user ``given`` is refused instead, so a card
    never reports a length other than the one asked for.
    """
    limit = checked.shape.block_size  # an int (GPTConfig's, or hf.context_of's) or None
    if not limit:
        return seq_len
    if given and seq_len > limit:
        raise LNStabError(f"--seq-len={seq_len} is not allowed with {checked.name}'s context of {limit}; "
                          f"it must be at most {limit}")
    return min(seq_len, limit)
