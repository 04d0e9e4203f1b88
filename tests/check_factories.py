"""Model factories for the tests of ``lnstab check --factory`` (no tests here; imported as ``check_factories``).

Each function returns a fresh ``nn.Module`` mapping token ids ``(B, T)`` to logits ``(B, T, V)``, or, for the
bad-input tests, something that does not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

VOCAB, WIDTH, LAYERS = 128, 32, 2


class EncoderLM(nn.Module):
    """Token + position embedding, ``nn.TransformerEncoder`` under a causal mask, linear head."""

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(64, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)  # (T, T)
        return self.head(self.encoder(x, mask=mask, is_causal=True))  # (B, T, V)


class TriplingBlock(nn.Module):
    """A Pre-LN encoder layer whose residual stream is multiplied by 3: ``3·x + f(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=mask, is_causal=True) + 2 * x  # (B, T, C): 3·x + attention and MLP updates


class TriplingLM(nn.Module):
    """Four :class:`TriplingBlock` s between an embedding and a head."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([TriplingBlock() for _ in range(layers)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)  # (B, T, V)


class PooledLM(EncoderLM):
    """Returns one logit vector per sequence, ``(B, V)``: the wrong shape."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).mean(dim=1)


def encoder_lm() -> nn.Module:
    """Post-LN ``nn.TransformerEncoder`` language model (PyTorch's default layer)."""
    return EncoderLM()


def tripling_lm() -> nn.Module:
    """A model whose blocks multiply the residual stream by 3."""
    return TriplingLM()


def pooled_lm() -> nn.Module:
    """A model with logits of the wrong shape."""
    return PooledLM()


class PackedLM(EncoderLM):
    """Returns its logits inside a tuple ``(logits, aux_loss)`` or a dict ``{"logits", "aux_loss"}``, as many do."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        logits = super().forward(idx)  # (B, T, V)
        aux = logits.square().mean()  # a stand-in auxiliary loss the check must not train on
        return (logits, aux) if self.form == "tuple" else {"aux_loss": aux, "logits": logits}


def tuple_lm() -> nn.Module:
    """``encoder_lm`` returning ``(logits, aux_loss)``."""
    return PackedLM("tuple")


def dict_lm() -> nn.Module:
    """``encoder_lm`` returning ``{"aux_loss", "logits"}``."""
    return PackedLM("dict")


def half_lm() -> nn.Module:
    """``encoder_lm`` built in float16 (AdamW's eps underflows in float16: trained as built, every run diverges)."""
    return EncoderLM().half()


class LayerDropLM(nn.Module):
    """Two Pre-LN blocks; in training, block 1 runs in the first forward only (a LayerDrop that always drops it
    after that), so no measurement after step 0 sees every block."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, WIDTH)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, vocab_size)
        self.forwards = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device)
        for i, block in enumerate(self.blocks):
            if not (self.training and i == 1 and self.forwards > 0):
                x = block(x, src_mask=mask, is_causal=True)
        self.forwards += self.training
        return self.head(x)  # (B, T, V)


def layerdrop_lm(vocab_size: int = VOCAB) -> nn.Module:
    """A model whose block 1 is skipped in training after the first forward."""
    return LayerDropLM(vocab_size)


class BidirectionalLM(EncoderLM):
    """``encoder_lm`` without its causal mask: every position sees the whole sequence."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        return self.head(self.encoder(self.embed(idx) + self.pos(torch.arange(T, device=idx.device))))


def bidirectional_lm() -> nn.Module:
    """A model that is not causal."""
    return BidirectionalLM()


class PeekInTrainingLM(EncoderLM):
    """``encoder_lm``, causal in eval mode, that adds the next token's embedding in train mode: a training-only
    branch that reads the answer."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(idx)
        T = idx.size(1)
        x = self.embed(idx) + self.embed(torch.roll(idx, -1, dims=1)) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(T), is_causal=True))


def peek_in_training_lm() -> nn.Module:
    """A model that is causal in eval mode only."""
    return PeekInTrainingLM()


class NamedBlocksLM(EncoderLM):
    """``encoder_lm`` whose two blocks are named ``first`` and ``second``: no numeric index in their names."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = self.encoder.layers[0], self.encoder.layers[1]
        del self.encoder

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        for block in (self.first, self.second):
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def named_blocks_lm() -> nn.Module:
    """A model whose blocks have names without an index."""
    return NamedBlocksLM()


class LastPositionLM(EncoderLM):
    """nanoGPT's inference forward: ``(logits of the last position, None)`` without targets."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return super().forward(idx)[:, [-1], :], None  # (B, 1, V)


def last_position_lm() -> nn.Module:
    """A model that returns the last position's logits only."""
    return LastPositionLM()


def not_a_module() -> int:
    """Not a model at all."""
    return 3


class SizedLM(EncoderLM):
    """A Pre-LN encoder LM whose vocabulary is an argument (so the check may build it with the protocol's)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(norm_first=True)
        self.embed = nn.Embedding(vocab_size, WIDTH)
        self.head = nn.Linear(WIDTH, vocab_size)


MODES: list[bool] = []  # ModeLM's forward appends whether it runs in train mode
FLUSHED: list[tuple[bool, bool]] = []  # and (train mode, whether denormal floats are flushed to zero)


def denormals_flushed() -> bool:
    return (torch.tensor([1e-40]) * 2).item() == 0.0


class ModeLM(EncoderLM):
    """Records ``self.training`` (and whether denormals are flushed) on every forward and holds a dropout module with
    p = 0.3."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        MODES.append(self.training)
        FLUSHED.append((self.training, denormals_flushed()))
        return super().forward(idx)


def sized_lm(vocab_size: int = VOCAB) -> nn.Module:
    """A model built with any vocabulary."""
    return SizedLM(vocab_size)


def deaf_lm(vocab_size: int = VOCAB) -> nn.Module:
    """Takes ``vocab_size`` but ignores it: logits stay ``VOCAB`` wide."""
    return EncoderLM()


class ShortEmbeddingLM(EncoderLM):
    """Logits over ``vocab_size`` tokens, but an embedding of 100 rows whatever ``vocab_size`` is."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__(norm_first=True)
        self.embed = nn.Embedding(100, WIDTH)
        self.head = nn.Linear(WIDTH, vocab_size)


def short_embedding_lm() -> nn.Module:
    """No ``vocab_size`` argument: the check feeds it its own vocabulary, ids 0…127, which its 100 rows do not hold."""
    return ShortEmbeddingLM()


def short_embedding_sized_lm(vocab_size: int = VOCAB) -> nn.Module:
    """Sizes its head by ``vocab_size`` but not its embedding (100 rows)."""
    return ShortEmbeddingLM(vocab_size)


def mode_lm() -> nn.Module:
    """A model that records its training mode."""
    return ModeLM()


class WaitingLM(EncoderLM):
    """Trains for ever: its training forward (train mode with grad: the stress runs') leaves this process's pid as a
    file in ``$LNSTAB_TEST_MARKS`` and then waits without end, so a stress run is in progress until a signal, or the
    death of the process that started it, ends it. Its forward without grad (the check's shape and causality probes,
    in eval and in train mode) is the encoder's."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            (Path(os.environ["LNSTAB_TEST_MARKS"]) / str(os.getpid())).touch()
            while True:
                time.sleep(0.05)
        return super().forward(idx)


def waiting_lm() -> nn.Module:
    """A model whose stress runs never end by themselves."""
    return WaitingLM()


class OwnBlock(nn.Module):
    """A Pre-LN block of a user's own: ``query``/``key``/``value`` projections the instruments do not recognise."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.query, self.key, self.value = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.ff = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_1(x)
        q, k, v = (m(h).unflatten(-1, (self.heads, -1)).transpose(1, 2) for m in (self.query, self.key, self.value))
        x = x + nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return x + self.ff(self.norm_2(x))  # (B, T, C)


class OwnAttentionLM(nn.Module):
    """Embedding, :class:`OwnBlock` s under ``blocks.N``, a head called ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([OwnBlock() for _ in range(LAYERS)])
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.out(x)  # (B, T, V)


def own_attention_lm() -> nn.Module:
    """A model whose attention and head only patterns can point at."""
    return OwnAttentionLM()


class PeriResidual(nn.Module):
    """``x + LN_out(f(x))`` with a causal self-attention ``f`` (Peri-LN's update without its input norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.ln_out = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return x + self.ln_out(self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])  # (B, T, C)


class LoopedLM(nn.Module):
    """One block run ``loops`` times (weights shared across depth), under ``block``, between an embedding and a
    head: a looped (recurrent-depth) Transformer. ``block`` is a Pre-LN encoder layer, or with ``peri`` a
    :class:`PeriResidual` whose output norm is ``block.ln_out``."""

    def __init__(self, vocab_size: int = VOCAB, loops: int = 3, peri: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, WIDTH)
        self.pos = nn.Embedding(64, WIDTH)
        self.block = PeriResidual() if peri else nn.TransformerEncoderLayer(
            WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(WIDTH, vocab_size)
        self.loops = loops

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        for _ in range(self.loops):
            x = self.block(x) if isinstance(self.block, PeriResidual) else self.block(x, src_mask=mask, is_causal=True)
        return self.head(x)  # (B, T, V)


def looped_lm(vocab_size: int = VOCAB) -> nn.Module:
    """A Pre-LN block looped three times."""
    return LoopedLM(vocab_size)


def looped_peri_lm(vocab_size: int = VOCAB) -> nn.Module:
    """A Peri-style update ``x + LN(f(x))`` looped three times; its output norm is ``block.ln_out``."""
    return LoopedLM(vocab_size, peri=True)


def lnstab_gpt_lm(vocab_size: int = VOCAB) -> nn.Module:
    """lnstab's own GPT (``tiny``, context 32, Pre-LN), as ``--model.preset tiny --model.vocab_size V
    --model.block_size 32`` builds it, but given as a factory: the check trains it on its logits when ``--z-loss``
    is set, not through its chunked head."""
    from lnstab.model import GPT
    from lnstab.moduleargs import gpt_config

    return GPT(gpt_config({"preset": "tiny", "vocab_size": vocab_size, "block_size": 32}))


GPT2_VOCAB = 50257


def gpt2_vocab_lm() -> nn.Module:
    """:class:`SizedLM` over GPT-2's 50,257 tokens, without a ``vocab_size`` argument: the check cannot build it
    with the protocol vocabulary, so it trains the whole head."""
    return SizedLM(GPT2_VOCAB)


def gpt2_vocab_sized_lm(vocab_size: int = GPT2_VOCAB) -> nn.Module:
    """The same model taking ``vocab_size``: the check builds it with the protocol vocabulary."""
    return SizedLM(vocab_size)


def hf_gpt2_lm(vocab_size: int = GPT2_VOCAB) -> nn.Module:
    """Hugging Face's GPT-2 (2 × 32, context 32) as a user writes it: ``GPT2Config`` keeps its bos/eos id 50256
    whatever ``vocab_size`` is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=vocab_size))


class ReversedLM(TriplingLM):
    """:class:`TriplingLM` whose blocks are attributes ``trunk.unit_N`` created last to first and run first to last:
    module order is not the order they run."""

    def __init__(self) -> None:
        super().__init__()
        del self.blocks
        self.trunk = nn.Module()
        for i in reversed(range(4)):
            setattr(self.trunk, f"unit_{i}", TriplingBlock())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device)
        for i in range(4):
            x = getattr(self.trunk, f"unit_{i}")(x, mask)
        return self.head(x)


def reversed_lm() -> nn.Module:
    return ReversedLM()


def meta_lm() -> nn.Module:
    """A model built on the meta device (no values)."""
    with torch.device("meta"):
        return TriplingLM()


class DictBlocksLM(EncoderLM):
    """``encoder_lm`` whose blocks are an ``nn.ModuleDict``'s ``b0`` and ``b1``: an index, not after a dot."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": layer for i, layer in enumerate(self.encoder.layers)})
        del self.encoder

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        for block in self.blocks.values():
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def dict_blocks_lm() -> nn.Module:
    """A model whose blocks are in an nn.ModuleDict."""
    return DictBlocksLM()


class TableLM(nn.Module):
    """A bigram table and nothing else: a model with no submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(VOCAB, VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]  # (B, T, V)


def table_lm() -> nn.Module:
    """A model with no submodules, so no block to select."""
    return TableLM()
