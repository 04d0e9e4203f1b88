"""A block that does not run on a measuring step (LayerDrop, a skip taken in training only): the step is not measured,
the first such step is said once in a warning naming the module, the series stay aligned, and under DDP a block
skipped on one rank only neither hangs the others in a collective nor lets ranks log different steps."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from fsdp_cpu import CPUDDPSpawnStrategy
from lightning.pytorch.loggers import CSVLogger
from support.callbacks import VOCAB, LitLM, tokens, trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lnstab.callbacks import DivergenceMonitor, HiddenStateStatistics, OutputLogitStatistics


class SkippingLM(nn.Module):
    """Three Pre-LN encoder layers as ``blocks``; the blocks whose indices are in :attr:`skip` do not run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True) for _ in range(3))
        self.lm_head = nn.Linear(32, VOCAB)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                h = block(h, src_mask=mask, is_causal=True)
        return self.lm_head(h)  # (B, T, V)


class SkippingLit(LitLM):
    """Skips block 1 at the (step, rank) pairs of ``plan``; each rank takes every other sequence of a batch of 8."""

    def __init__(self, plan: set[tuple[int, int]]) -> None:
        torch.manual_seed(0)
        super().__init__(SkippingLM())
        self.plan = plan

    def training_step(self, batch, batch_idx):
        self.model.skip = {1} if (self.global_step, self.global_rank) in self.plan else set()
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(tokens(16), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(tokens(16), batch_size=8 // world, sampler=sampler)


def callbacks() -> list:
    return [HiddenStateStatistics(every_n_steps=1, layer_pattern=r"blocks\.(\d+)$"), OutputLogitStatistics(
        every_n_steps=1), DivergenceMonitor(layer_pattern=r"blocks\.(\d+)$", stats_every_n_steps=1,
                                            collapse_fraction=None, attention_logit_threshold=None)]


def test_a_skipped_block_leaves_its_step_unmeasured_and_says_so_once(tmp_path) -> None:
    hidden, output, monitor = instruments = callbacks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, instruments, max_steps=4, use_distributed_sampler=False).fit(SkippingLit({(1, 0), (2, 0)}))
    said = [str(w.message) for w in caught if "was not measured" in str(w.message)]
    assert said == ["HiddenStateStatistics: step 1 was not measured: 'model.blocks.1' did not run in it (a block "
                    "skipped in training, e.g. LayerDrop?); only steps on which every watched module runs are "
                    "measured, and this is said once"]
    assert hidden.steps == [0, 3] and all(len(v) == 2 for by_tag in hidden.values.values() for v in by_tag.values())
    assert output.steps == [0, 1, 2, 3]  # the head ran on every step
    assert monitor.events == [] and monitor.diverged_step is None  # a skipped block is not a non-finite activation


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_a_block_skipped_on_one_rank_is_unmeasured_on_both_without_a_hang(tmp_path) -> None:
    torch.set_num_threads(1)
    strategy = CPUDDPSpawnStrategy(find_unused_parameters=True)  # a skipped block has no gradient on that rank
    t = trainer(tmp_path, callbacks(), max_steps=4, devices=2, strategy=strategy, use_distributed_sampler=False,
                logger=CSVLogger(tmp_path, name="ddp", version=0))
    t.fit(SkippingLit({(1, 1), (2, 1)}))  # before: the ranks' collectives mismatched and rank 1 aborted
    series = json.loads((tmp_path / "ddp" / "version_0" / "hidden_stats.json").read_text())
    assert series["steps"] == [0, 3] and series["tags"] == ["L00", "L01", "L02"]
