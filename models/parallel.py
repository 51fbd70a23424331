"""Collectives the per-rank modules call: all-reduce of partial sums, all-gather of vocab-parallel logits.

Implementations: `SingleRank` (TP=1), `ThreadGroup` (all ranks in one process, for tests and the CPU reference),
`runner.mpi.MpiCollectives` (mpi4py, CPU ranks), `runner.nccl.NcclCollectives` (torch.distributed on GPUs), and the
ONNX export ops in `plugins/collectives/onnx_op.py`.
"""

from __future__ import annotations

import threading

import torch


class SingleRank:
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ThreadGroup:
    """N ranks as N threads of one process; `member(rank)` is what rank `rank`'s modules call."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size)

    def abort(self) -> None:
        """Wakes every rank blocked in a collective with BrokenBarrierError (a rank failed)."""
        self._barrier.abort()

    def member(self, rank: int) -> ThreadCollectives:
        return ThreadCollectives(self, rank)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = x
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read all of them
        return parts


class ThreadCollectives:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group._exchange(self.rank, x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group._exchange(self.rank, x), dim=-1)
