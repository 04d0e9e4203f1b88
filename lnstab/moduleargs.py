""":class:`~lnstab.module.GPTModule`'s arguments without importing Lightning: which build the model, their defaults,
and the :class:`~lnstab.model.GPTConfig` they make.

``lnstab check`` reads these in its parent process, which never trains (its workers do), so it starts without
Lightning's import (seconds on a slow CPU). ``tests/test_model_options.py`` holds them equal to ``GPTModule``'s
signature.
"""

from __future__ import annotations

from typing import Any

from lnstab.model import GPTConfig

# GPTModule's arguments that are GPTConfig fields, with GPTModule's defaults ("preset" first: the rest override it).
MODEL_DEFAULTS: dict[str, Any] = {
    "preset": "gpt2", "norm_placement": "pre", "norm_type": "layernorm", "residual_scale": 1.0, "block_size": 1024,
    "n_layer": None, "n_head": None, "n_embd": None, "vocab_size": None, "pad_vocab_multiple": None, "bias": None,
    "dropout": None, "qk_norm": False, "z_loss": 0.0, "dyt_alpha_init": 0.5, "residual_gate": "none",
    "layerscale_init": None, "tie_embeddings": True, "init": "gpt2",
}
MODEL_ARGS = tuple(k for k in MODEL_DEFAULTS if k != "preset")
# The rest of GPTModule's arguments: optimisation and compilation.
TRAINING_ARGS = ("learning_rate", "min_lr", "warmup_steps", "lr_decay_steps", "weight_decay", "weight_decay_mode",
                 "betas", "eps", "compile")
# How AdamW's decay relates to the learning rate (GPTModule's weight_decay_mode).
WEIGHT_DECAY_MODES = ("coupled", "independent")
MODULE_ARGS = (*MODEL_DEFAULTS, *TRAINING_ARGS)


def gpt_config(hparams: dict[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` that ``GPTModule(**hparams)`` builds; missing arguments take the signature's defaults."""
    get = {k: hparams.get(k, default) for k, default in MODEL_DEFAULTS.items()}
    return GPTConfig.preset(get["preset"], **{k: get[k] for k in MODEL_ARGS})
