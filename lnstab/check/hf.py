"""Hugging Face causal LMs in the check: loading (never remote code), dropout switched off, a smaller protocol
vocabulary for fresh initialisations, and the output norms Theorem 4 needs for the families that have them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lnstab.errors import LNStabError, first_line
from lnstab.hub import hub_error
from lnstab.validation import is_integer

# model_type -> (output norms of one decoder layer in update order, whether the RMSNorm scales by 1 + weight). Located
# per family, never guessed from names: Llama's post_attention_layernorm is its MLP's input norm, not an output norm.
FAMILY_OUTPUT_NORMS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gemma2": (("post_attention_layernorm", "post_feedforward_layernorm"), True),
    "gemma3_text": (("post_attention_layernorm", "post_feedforward_layernorm"), True),
    "olmo2": (("post_attention_layernorm", "post_feedforward_layernorm"), False),
}
DECODER_LAYERS = ("model.layers", "transformer.h")
# Where a config keeps the context: Hugging Face's names (GPT-2's n_positions, MPT's max_seq_len, ...) and nanoGPT's.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx", "block_size")
# transformers' warning when a config's special token id is outside its vocabulary (configuration_utils, 5.x)
OUTSIDE_VOCABULARY = "_token_id must be `None` or an integer within the vocabulary"


class LayerUpdates:
    """The two normalised updates of one decoder layer as one entry of Theorem 4's sum (one per Hugging Face block, as
    the instruments' sites are): :attr:`weight` is ``γmax₁ + γmax₂``, read live (``offset`` 1 for Gemma's ``1 + weight``
    RMSNorm), since each update adds at most ``γmax·√d`` to a token's norm; read by
    :class:`lnstab.callbacks.GrowthBoundMonitor` as an output norm's ``max |weight|`` (no bias)."""

    def __init__(self, norms: list[nn.Module], offset: float) -> None:
        self.norms, self.offset = norms, offset

    @property
    def weight(self) -> torch.Tensor:
        gains = [(n.weight.detach().float() + self.offset).abs().max() for n in self.norms]
        return torch.stack(gains).sum().reshape(1)  # (1,)

    bias = None


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as token ids ``(B, T)`` → logits ``(B, T, V)`` (no cache).

    Exposes ``output_norms()`` (Theorem 4's updates, see :class:`LayerUpdates`; empty for families whose output norms
    are not located) the way lnstab's GPT does, so :class:`lnstab.callbacks.GrowthBoundMonitor` finds them.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.updates: list[LayerUpdates] = []
        if model_type in FAMILY_OUTPUT_NORMS:
            names, one_plus = FAMILY_OUTPUT_NORMS[model_type]
            for layer in decoder_layers(model):
                norms = [getattr(layer, n, None) for n in names]
                if all(isinstance(getattr(n, "weight", None), torch.Tensor) for n in norms):
                    self.updates.append(LayerUpdates(norms, 1.0 if one_plus else 0.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    def output_norms(self) -> list[tuple[LayerUpdates, float]]:
        """``(updates of layer i, Δt = 1)`` for every decoder layer of a family with located output norms."""
        return [(u, 1.0) for u in self.updates]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (``model.layers`` or ``transformer.h``), in order."""
    for path in DECODER_LAYERS:
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, nn.ModuleList):
            return list(node)
    return []


def norm_pattern(model_type: str | None) -> str | None:
    """A regex of the located output norms (what the card names), ``None`` for other families."""
    if model_type not in FAMILY_OUTPUT_NORMS:
        return None
    names = "|".join(FAMILY_OUTPUT_NORMS[model_type][0])
    return r"(?:^|\.)layers\.(\d+)\.(" + names + r")$"


def dropout_overrides(config: Any) -> dict[str, float]:
    """Every dropout probability of a Hugging Face config that is not 0 (``*dropout*``, ``*pdrop*``), set to 0."""
    return {key: 0.0 for key, value in config.to_dict().items()
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0}


def vocab_overrides(config: Any, vocab_size: int) -> dict[str, Any]:
    """``vocab_size`` and the special token ids it no longer holds (set to ``None``)."""
    ids = {key: None for key, value in config.to_dict().items()
           if key.endswith("_token_id") and isinstance(value, int) and value >= vocab_size}
    return {"vocab_size": vocab_size, **ids}


def context_of(config: Any) -> int | None:
    """The context a model's config states (:data:`CONTEXT_KEYS`, the first that is a positive integer), else
    ``None``."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if is_integer(value) and value > 0:
            return value
    return None


class OutsideVocabulary(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return OUTSIDE_VOCABULARY not in record.getMessage()


@contextlib.contextmanager
def outside_vocabulary_quiet() -> Iterator[None]:
    """While in it, transformers does not warn of special token ids (bos, eos, pad) outside the vocabulary, as a config
    made for the model's own vocabulary has with the protocol's: the check sets them to ``None`` once the model is
    built (:func:`special_ids_in_vocabulary`). Nothing else is silenced; transformers is not imported."""
    logger, quiet = logging.getLogger("transformers.configuration_utils"), OutsideVocabulary()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def progress_bars_off() -> Iterator[None]:
    """While in it, transformers draws no progress bar ('Loading weights', 'Writing model shards': not the check's
    to print); after it, the process-wide setting is as it was."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def special_ids_in_vocabulary(model: nn.Module, vocab_size: int) -> None:
    """Set every special token id (``*_token_id``) of ``model.config`` that ``vocab_size`` tokens do not hold to
    ``None``: ids that name no row of the model's embedding and that no forward reads (what is trained is
    unchanged); a model without a Hugging Face config is left as it is."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_dict", None)):
        return
    for key, value in vocab_overrides(config, vocab_size).items():
        if key != "vocab_size":
            setattr(config, key, value)


@dataclass(frozen=True)
class HFRecipe:
    """How to build the model in any process: the name, fresh init or trained weights, and config overrides."""

    name: str
    init: bool
    overrides: tuple[tuple[str, Any], ...] = ()
    local_files_only: bool = False  # a hub name read from the local cache: the hub could not be reached

    def config(self) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.name, trust_remote_code=False, local_files_only=self.local_files_only)
        for key, value in self.overrides:
            setattr(config, key, value)
        return config

    def build(self) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        config = self.config()
        # transformers' construction advice (is_decoder for an encoder, bos/eos ids outside the protocol vocabulary)
        # is not the check's to print: what matters for the check it says itself, in one line
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with progress_bars_off():  # a 'Loading weights' bar on stderr each time a process builds the model
                if self.init:
                    config.pad_token_id = None  # the windows hold no padding: no real token gets a zero embedding
                    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
                else:
                    model = AutoModelForCausalLM.from_pretrained(self.name, config=config, trust_remote_code=False,
                                                                 local_files_only=self.local_files_only)
        finally:
            hf_logging.set_verbosity(level)
        for module in model.modules():  # trained weights: the padding row trains like any token's (no padding here)
            if isinstance(module, nn.Embedding):
                module.padding_idx = None
        return HFCausalLM(model.float())

    def with_vocab(self, vocab_size: int) -> HFRecipe | None:
        """A fresh initialisation with ``vocab_size`` tokens; ``None`` for trained weights (their vocabulary is
        fixed)."""
        if not self.init:
            return None
        overrides = {**dict(self.overrides), **vocab_overrides(self.config(), vocab_size)}
        return HFRecipe(self.name, True, tuple(overrides.items()), self.local_files_only)


def hub_unreachable(name: str) -> str | None:
    """Why the hub of ``name``, a hub name (not a local directory) with ``HF_HUB_OFFLINE`` unset, does not answer (the
    error's type, :func:`lnstab.hub.hub_error`), else ``None``. Any answer, an error status included, is a reachable
    hub: transformers then loads as it always did."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    if os.path.isdir(os.path.expanduser(name)) or constants.HF_HUB_OFFLINE:
        return None
    exc = hub_error(name, "model")
    # the hub answered, or the name is none (transformers says so); else any transport failure: no DNS, refused, …
    return None if exc is None or isinstance(exc, HfHubHTTPError | HFValidationError) else type(exc).__name__


def load_config(name: str) -> tuple[Any, bool]:
    """The config of ``name`` (a directory or a hub name) and whether it is read from the local Hugging Face cache
    alone (a hub name whose hub cannot be reached: :func:`hub_unreachable`), or a one-line error."""
    from transformers import AutoConfig

    # a file: transformers reads it as the config, then torch.loads it as the weights ('Weights only load failed')
    if os.path.isfile(os.path.expanduser(name)):
        raise LNStabError(f"--hf {name!r} is a file; give the directory save_pretrained wrote (its config.json and "
                          "weights) or a hub name")
    unreachable = hub_unreachable(name)
    try:  # from the cache alone where the hub does not answer: a cached model loads offline, at once
        config = AutoConfig.from_pretrained(name, trust_remote_code=False, local_files_only=bool(unreachable))
        return config, bool(unreachable)
    except Exception as exc:  # OSError offline / missing, ValueError for remote code or unknown types
        if unreachable and isinstance(exc, OSError):
            raise LNStabError(f"--hf {name!r} cannot be loaded: the Hugging Face hub cannot be reached ({unreachable}) "
                              "and the model is not in the local Hugging Face cache; give --hf a local directory of "
                              "the model (what save_pretrained wrote), which works offline") from None
        raise load_error(name, "cannot be loaded", exc) from None


def load_error(name: str, what: str, exc: BaseException) -> LNStabError:
    """``--hf NAME <what>: <first line of the error>`` (and why a hub name may fail offline)."""
    where = "" if os.path.isdir(name) else " (not a local directory; without network only local directories work)"
    return LNStabError(f"--hf {name!r} {what}{where}: {first_line(exc, type(exc).__name__)}")


def config_shape(config: Any) -> dict[str, Any]:
    """Depth, width, context, vocabulary and heads of a Hugging Face config."""
    get = lambda *keys: next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)  # noqa: E731
    return {  # an encoder-decoder's causal LM is its decoder (BART's num_hidden_layers is the encoder's)
        "n_layer": int(get("decoder_layers", "num_hidden_layers", "n_layer", "n_layers")),
        "n_embd": int(get("hidden_size", "n_embd", "d_model")),
        "block_size": context_of(config),
        "vocab_size": int(get("vocab_size")),
        "n_head": get("decoder_attention_heads", "num_attention_heads", "n_head", "n_heads"),
    }


def training_only(config: Any) -> dict[str, float]:
    """Training-only branches a config leaves on that are not dropout (LayerDrop, drop path): ``{key: value}``."""
    return {key: value for key, value in config.to_dict().items()
            if ("layerdrop" in key or "drop_path" in key) and isinstance(value, int | float) and value > 0}
