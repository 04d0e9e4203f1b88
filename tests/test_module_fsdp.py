"""GPTModule under Lightning's FSDPStrategy with norm clipping (2 CPU processes, gloo) equals one process."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from fsdp_cpu import CPUFSDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lnstab.model import Block
from lnstab.module import GPTModule

GLOBAL_BATCH, STEPS, VOCAB = 8, 4, 64


class ClippedSGD(GPTModule):
    """GPTModule with SGD (its update is linear in the clipped gradient, so a wrong clipping norm shows; Adam would
    all but cancel it) on one fixed global batch, split over the ranks."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        windows = torch.randint(0, VOCAB, (GLOBAL_BATCH, 33), generator=g).repeat(STEPS, 1)  # the same batch each step
        data = TensorDataset(windows[:, :-1], windows[:, 1:])
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=4.0)


class Losses(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        Path(f"{self.path}.{trainer.global_rank}.json").write_text(json.dumps(self.losses))


def fit(tmp_path: Path, name: str, clip: float = 0.05, **kwargs) -> list[float]:
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, gradient_clip_val=clip, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=[Losses(str(tmp_path / name))],
                         default_root_dir=tmp_path, **kwargs)
    torch.manual_seed(0)
    trainer.fit(ClippedSGD(preset="tiny", vocab_size=VOCAB, block_size=32, warmup_steps=0))
    per_rank = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"{name}.*.json"))]
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]  # equal halves: the global mean


@pytest.mark.slow
@pytest.mark.parametrize("clip", [0.05, -1.0])
def test_fsdp_clips_by_the_global_norm_like_one_process(tmp_path, clip) -> None:
    # Lightning's FSDP precision plugin refuses norm clipping; GPTModule clips through the sharded root's
    # clip_grad_norm_, which takes the norm over every shard. The losses of each step match one process. A value
    # <= 0 is no clipping, as Lightning reads it (the sharded root's clip_grad_norm_(-1) flipped the gradients)
    torch.set_num_threads(1)
    single = fit(tmp_path, "single", clip, devices=1)
    strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    sharded = fit(tmp_path, "fsdp", clip, devices=2, strategy=strategy)
    assert len(single) == len(sharded) == STEPS
    assert single[-1] < single[0] - 0.05 if clip > 0 else single[-1] > single[0]  # unclipped, lr 4 is too high
    assert sharded == pytest.approx(single, rel=1e-5)
