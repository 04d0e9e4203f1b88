"""A seeded in-memory token stream for smoke runs, tests and benchmarks (no text, no tokenizer)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lnstab.errors import ConfigError


class TokenWindows(Dataset):
    """Consecutive ``block_size + 1`` windows of a 1-D token tensor as ``(inputs, targets)`` pairs."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ConfigError(
                f"block_size={block_size} is not allowed; the data holds only {tokens.numel()} tokens "
                f"(need at least block_size + 1)"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return w[:-1], w[1:]


class SyntheticDataModule(pl.LightningDataModule):
    """A seeded stream of tokens with learnable structure (a random first-order Markov chain).

    Labelled ``source: synthetic`` in the hyperparameters so no report mistakes it for text.

    Args:
        block_size: Tokens per training window.
        batch_size: Windows per batch (per rank).
        synthetic_vocab_size: Token ids are drawn in ``[0, synthetic_vocab_size)``.
        train_tokens: Length of the training stream.
        val_tokens: Length of the validation stream (drawn from the same chain, another seed).
        seed: Seed of the chain and of the streams.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 8,
        synthetic_vocab_size: int = 50257,
        train_tokens: int = 200_000,
        val_tokens: int = 20_000,
        seed: int = 1234,
    ) -> None:
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self.save_hyperparameters({**args, "source": "synthetic"})  # in hparams_initial, so the logger records it

    @staticmethod
    def markov_stream(n: int, vocab_size: int, seed: int, chain_seed: int, branching: int = 4) -> torch.Tensor:
        """``n`` tokens of a Markov chain in which each token has ``branching`` likely successors."""
        g = torch.Generator().manual_seed(chain_seed)
        successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        g = torch.Generator().manual_seed(seed)
        choice = torch.randint(0, branching, (n,), generator=g)
        succ, ch = successors.tolist(), choice.tolist()  # plain ints: ~50x faster than tensor indexing
        out = [0] * n
        prev = 0
        for i in range(1, n):
            prev = out[i] = succ[prev][ch[i]]
        return torch.tensor(out, dtype=torch.long)

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        train = self.markov_stream(hp.train_tokens, hp.synthetic_vocab_size, hp.seed, 0)
        val = self.markov_stream(hp.val_tokens, hp.synthetic_vocab_size, hp.seed + 1, 0)
        self.train_set = TokenWindows(train, hp.block_size)
        self.val_set = TokenWindows(val, hp.block_size)

    def validation_tokens(self) -> torch.Tensor:
        """The validation stream as one 1-D token tensor (the contract evaluation relies on)."""
        return self.val_set.tokens

    def token_id_limit(self) -> int:
        """Every token id is below this (a model's ``vocab_size`` must be at least this)."""
        return int(self.hparams.synthetic_vocab_size)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, generator=g, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
