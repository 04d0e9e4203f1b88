"""What the training strategy means for an instrument, in one place: which strategies are served, reductions over
ranks and over parameter shards, and a full-parameter view of a sharded model.

Three strategies are served: one device, DDP (``ddp``, ``ddp_spawn``, ``ddp_fork``: every rank holds the whole model
and, in ``on_before_optimizer_step``, the same averaged gradients) and Lightning's :class:`FSDPStrategy` (FSDP1 with
``use_orig_params=True``, its default). Under FSDP the LightningModule is the root FSDP unit, so outside its forward
each parameter is this rank's flat slice of it (possibly empty) and so is its gradient: a max over slices is an exact
``MAX`` all-reduce, a squared norm an exact ``SUM`` all-reduce, and a forward outside the training step needs the full
parameters (:func:`unsharded`). Anything else (DeepSpeed, ModelParallelStrategy, XLA) is refused in one line at setup.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lnstab.errors import ConfigError

SERVED = "SingleDeviceStrategy, DDPStrategy (ddp, ddp_spawn, ddp_fork), FSDPStrategy"


def strategy_kind(trainer: Any) -> str:
    """``single``, ``ddp``, ``fsdp`` or ``other`` for ``trainer.strategy`` (``single`` without a trainer)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None:
        return "single"
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, DeepSpeedStrategy):  # a DDPStrategy subclass whose ZeRO stages hide parameters
        return "other"
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    if isinstance(strategy, SingleDeviceStrategy):
        return "single"
    return "other"


def require_strategy(trainer: Any, who: str, reads_parameters: bool = False) -> str:
    """The :func:`strategy_kind` of ``trainer`` if ``who`` can serve it, else a one-line :class:`ConfigError`.

    ``reads_parameters``: the instrument reads parameters or gradients outside the forward (FSDP must then keep the
    original parameters as views of its shards and shard over every rank).
    """
    kind = strategy_kind(trainer)
    name = type(getattr(trainer, "strategy", None)).__name__
    if kind == "other":
        raise ConfigError(f"strategy={name} is not allowed with {who}; choose one of: {SERVED}")
    if kind == "fsdp" and reads_parameters:
        strategy = trainer.strategy
        if not strategy.kwargs.get("use_orig_params", True):
            raise ConfigError(
                f"strategy={name}(use_orig_params=False) is not allowed with {who}; it reads parameters by module, "
                "so keep use_orig_params=True (Lightning's default)"
            )
        sharding = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
        if sharding.startswith("HYBRID") or sharding.startswith("_HYBRID"):
            raise ConfigError(
                f"strategy={name}(sharding_strategy={sharding}) is not allowed with {who}; choose one of: "
                "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"
            )
    return kind


def distributed(trainer: Any) -> bool:
    """Whether a process group spans several ranks."""
    return getattr(trainer, "world_size", 1) > 1 and dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: str, trainer: Any) -> torch.Tensor:
    """In-place ``all_reduce`` (``sum`` or ``max``) across ranks; a no-op in one process."""
    if distributed(trainer):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def params_sharded(trainer: Any) -> bool:
    """Whether each rank holds only a slice of every parameter and gradient (FSDP other than ``NO_SHARD``)."""
    if strategy_kind(trainer) != "fsdp" or not distributed(trainer):
        return False
    return getattr(trainer.strategy.sharding_strategy, "name", "") != "NO_SHARD"


def reduce_over_shards_(tensor: torch.Tensor, op: str, trainer: Any) -> torch.Tensor:
    """``all_reduce`` (``sum`` of squares, ``max``) of per-slice values when parameters are sharded, else as is."""
    return all_reduce_(tensor, op, trainer) if params_sharded(trainer) else tensor


def abs_max(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``max |t|`` of each tensor as a float32 vector (0 for ``None`` or an empty slice); no host sync."""
    values = [
        t.detach().abs().max().float() if t is not None and t.numel() else torch.zeros((), device=device)
        for t in tensors
    ]
    return torch.stack([v.to(device) for v in values]) if values else torch.zeros(0, device=device)


def _fsdp_root(trainer: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = trainer.strategy.model
    if not isinstance(root, FullyShardedDataParallel):
        raise ConfigError(f"strategy.model={type(root).__name__} is not allowed; FSDPStrategy should have wrapped it")
    return root


@contextmanager
def unsharded(trainer: Any, pl_module: nn.Module) -> Iterator[nn.Module]:
    """``pl_module`` with full parameters inside the block, so its ``forward`` (and its model's ``generate``) run
    outside the training step on every strategy; every rank must enter it (FSDP gathers the shards).

    One device or DDP: ``pl_module`` itself. FSDP: the full parameters are gathered into every unit
    (``summon_full_params``, read-only: changes are not written back) and each nested FSDP wrapper is replaced by the
    module it wraps for the duration, so calls go straight to the gathered weights; everything is restored on exit.

    Example::

        with unsharded(trainer, pl_module) as module:
            logits = module(tokens)
    """
    if strategy_kind(trainer) != "fsdp":
        yield pl_module
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = _fsdp_root(trainer)
    with FullyShardedDataParallel.summon_full_params(root, writeback=False, recurse=True):
        swapped = []
        for parent in list(pl_module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, FullyShardedDataParallel):
                    parent._modules[name] = child.module
                    swapped.append((parent, name, child))
        try:
            yield pl_module
        finally:
            for parent, name, child in reversed(swapped):
                parent._modules[name] = child


def count_nonfinite(params: Any) -> torch.Tensor:
    """Parameters (this rank's shards) with a non-finite entry, as a device tensor (no host sync)."""
    params = [p.detach() for p in params]
    if not params:
        return torch.zeros(())
    return (~torch.stack(torch._foreach_norm(params)).isfinite()).sum()
