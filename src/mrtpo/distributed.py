"""The few collectives the trainer needs, as no-ops in a single process.

Under DDP/FSDP every rank holds its own prompt groups. Decisions that change what a rank
runs next (skip this update, stop the run) must be taken jointly, or one rank would wait in a
collective another rank skipped; metrics are combined so every rank logs the global batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Ranks:
    """Collectives over the default process group; ``device`` gives where tensors must live
    (NCCL reduces CUDA tensors only)."""

    def __init__(self, device: Callable[[], torch.device] | None = None) -> None:
        self._device = device or (lambda: torch.device("cpu"))

    @property
    def group(self):
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def sum(self, *values: float) -> list[float]:
        """Element-wise sums of ``values`` over ranks (one collective; local outside DDP)."""
        if self.group is None:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        return [float(v) for v in self.all_reduce_sum(t).cpu()]

    def max(self, value: int) -> int:
        """The largest ``value`` over ranks (e.g. how many forwards every rank must run)."""
        if self.group is None:
            return int(value)
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank: joint skip decisions."""
        return self.sum(float(flag))[0] > 0

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (a list of one outside DDP)."""
        if self.group is None:
            return [obj]
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


# ---- sharded models: facts the step needs without Lightning --------------------------
def is_sharded(model: torch.nn.Module | None) -> bool:
    """True for a model wrapped by ``fully_shard`` (its forwards are collectives)."""
    if model is None:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def dummy_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, prompt mask, response ids, response mask) of one row, one token each: the
    cheapest forward a rank with no work left runs to keep a sharded loop in step."""
    one = torch.full((1, 1), int(pad_id), dtype=torch.long)
    mask = torch.ones((1, 1), dtype=torch.bool)
    return one, mask, one.clone(), mask.clone()
