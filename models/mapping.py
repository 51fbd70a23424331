"""The parallel layout: one object, carried by every model config (TensorRT-LLM's `Mapping` idiom)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    """Tensor-parallel layout of one process.

    Only tensor parallelism exists today, so `world_size == tp_size` and `tp_rank == rank`.
    """

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.world_size != self.tp_size:
            raise ValueError(
                f"world_size={self.world_size} must equal tp_size={self.tp_size}; pipeline parallelism is not supported"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def tp_rank(self) -> int:
        return self.rank

    def split(self, size: int, what: str) -> tuple[int, int]:
        """This rank's slice `(start, length)` of a dimension split evenly over tp_size ranks."""
        check_divides(self.tp_size, size, what)
        length = size // self.tp_size
        return self.tp_rank * length, length

    def for_rank(self, rank: int) -> Mapping:
        return Mapping(world_size=self.world_size, rank=rank, tp_size=self.tp_size)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "tp_size": self.tp_size, "pp_size": 1}


def check_divides(tp_size: int, size: int, what: str) -> None:
    if size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide {what}={size} ({size} % {tp_size} = {size % tp_size})")
