""":class:`~lnstab.module.GPTModule`'s arguments without importing Lightning: which build the model, their defaults
and types, and the :class:`~lnstab.model.GPTConfig` they make.

``lnstab check`` reads these in its parent process, which never trains (its workers do), so it starts without
Lightning's import (seconds on a slow CPU); ``lnstab report`` checks a saved config's types with them, without torch's
(the model is imported only to build a :class:`GPTConfig`). ``tests/test_model_options.py`` holds them equal to
``GPTModule``'s signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lnstab import validation as require
from lnstab.errors import ConfigError

if TYPE_CHECKING:
    from lnstab.model import GPTConfig

# GPTModule's arguments as its signature has them, (annotation, default): first those that are GPTConfig fields
# ("preset" first: the rest override it), then optimisation and compilation. Written once; the tables below are
# read from these.
_MODEL_ARGUMENTS: dict[str, tuple[str, Any]] = {
    "preset": ("str", "gpt2"), "norm_placement": ("str", "pre"), "norm_type": ("str", "layernorm"),
    "residual_scale": ("float", 1.0), "block_size": ("int", 1024), "n_layer": ("int | None", None),
    "n_head": ("int | None", None), "n_embd": ("int | None", None), "vocab_size": ("int | None", None),
    "pad_vocab_multiple": ("int | None", None), "bias": ("bool | None", None), "dropout": ("float | None", None),
    "qk_norm": ("bool", False), "z_loss": ("float", 0.0), "dyt_alpha_init": ("float", 0.5),
    "residual_gate": ("str", "none"), "layerscale_init": ("float | None", None), "tie_embeddings": ("bool", True),
    "init": ("str", "gpt2"),
}
_TRAINING_ARGUMENTS: dict[str, tuple[str, Any]] = {
    "learning_rate": ("float", 6e-4), "min_lr": ("float", 6e-5), "warmup_steps": ("int", 2000),
    "lr_decay_steps": ("int | None", None), "weight_decay": ("float", 0.1), "weight_decay_mode": ("str", "coupled"),
    "betas": ("tuple[float, float]", (0.9, 0.95)), "eps": ("float", 1e-8), "compile": ("bool", False),
}
MODEL_DEFAULTS: dict[str, Any] = {k: default for k, (_, default) in _MODEL_ARGUMENTS.items()}
MODEL_ARGS = tuple(k for k in MODEL_DEFAULTS if k != "preset")
TRAINING_DEFAULTS: dict[str, Any] = {k: default for k, (_, default) in _TRAINING_ARGUMENTS.items()}
TRAINING_ARGS = tuple(TRAINING_DEFAULTS)
MODULE_TYPES: dict[str, str] = {k: kind for k, (kind, _) in {**_MODEL_ARGUMENTS, **_TRAINING_ARGUMENTS}.items()}
# Each part of those annotations: whether a config's value is of it, and the words for it.
TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (require.is_integer, "an integer"),
    "float": (require.is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "None": (lambda v: v is None, "null"),
    "tuple[float, float]": (lambda v: isinstance(v, list | tuple) and len(v) == 2 and all(map(require.is_number, v)),
                            "a list of two numbers"),
}
# How AdamW's decay relates to the learning rate (GPTModule's weight_decay_mode).
WEIGHT_DECAY_MODES = ("coupled", "independent")
MODULE_ARGS = (*MODEL_DEFAULTS, *TRAINING_ARGS)


def argument_type(name: str, value: Any) -> str | None:
    """What GPTModule's argument ``name`` takes, in words (``a string``, ``an integer or null``), when ``value`` is
    of no type it takes; ``None`` when it is (or ``name`` is none of its arguments). Types only: the values
    themselves are GPTModule's to judge."""
    if name not in MODULE_TYPES:
        return None
    parts = [TYPE_CHECKS[part.strip()] for part in MODULE_TYPES[name].split("|")]
    return None if any(fits(value) for fits, _ in parts) else " or ".join(words for _, words in parts)


def gpt_config(hparams: dict[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` that ``GPTModule(**hparams)`` builds; missing arguments take the signature's defaults."""
    from lnstab.model import GPTConfig

    get = {k: hparams.get(k, default) for k, default in MODEL_DEFAULTS.items()}
    return GPTConfig.preset(get["preset"], **{k: get[k] for k in MODEL_ARGS})


def checked_config(hparams: dict[str, Any]) -> GPTConfig:
    """:func:`gpt_config` after GPTModule's checks of its training arguments: what ``GPTModule(**hparams)`` refuses,
    refused here without building the model (the CLI checks a run's model before it builds the data and trainer)."""
    get = {k: hparams.get(k, default) for k, default in TRAINING_DEFAULTS.items()}
    learning_rate, min_lr, weight_decay = get["learning_rate"], get["min_lr"], get["weight_decay"]
    for name, value in (("learning_rate", learning_rate), ("min_lr", min_lr), ("weight_decay", weight_decay)):
        require.number(name, value, 0.0)
    if min_lr > learning_rate:
        raise ConfigError(f"min_lr={min_lr!r} is not allowed; it must be <= learning_rate={learning_rate!r}")
    require.integer("warmup_steps", get["warmup_steps"], 0)
    if get["lr_decay_steps"] is not None:
        require.positive_int("lr_decay_steps", get["lr_decay_steps"])
    require.choice("weight_decay_mode", get["weight_decay_mode"], WEIGHT_DECAY_MODES)
    if get["weight_decay_mode"] == "independent" and weight_decay > 0 and learning_rate == 0:
        raise ConfigError(
            "weight_decay_mode='independent' is not allowed with learning_rate=0 and weight_decay > 0; it sets "
            "AdamW's decay to weight_decay/learning_rate (use learning_rate > 0 or weight_decay 0)"
        )
    require.number("eps", get["eps"], 0.0, low_open=True)  # AdamW's: torch refused -1 only as the optimizer was built
    if not all(0.0 <= b < 1.0 for b in get["betas"]):
        raise ConfigError(f"betas={tuple(get['betas'])!r} is not allowed; each must be in [0, 1)")
    return gpt_config(hparams)
