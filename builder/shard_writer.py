"""Writes a converted checkpoint a layer group at a time, as sharded safetensors per rank (HF's sharding idiom).

Convert adds each group's tensors (one target layer, for instance) for every rank, then calls `end_group()`. When
the bytes held across all ranks reach `max_buffer_bytes`, every rank's buffer is written to that rank's next
shard and freed, so peak memory stays near one group's weights (plus the limit) whatever the model's size.

A (role, rank) that ends with one shard is written as `{role}/rank{r}.safetensors`; one with several as
`{role}/rank{r}-00001-of-0000N.safetensors` ... plus `{role}/rank{r}.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`), which `models.checkpoint` reads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.checkpoint import index_file, rank_file

log = logging.getLogger("ddtree.builder")

DEFAULT_MAX_BUFFER = 4 * 2**30


class ShardWriter:
    def __init__(self, root: Path, max_buffer_bytes: int = DEFAULT_MAX_BUFFER):
        self.root = Path(root)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self._buffers: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._shards: dict[tuple[str, int], list[tuple[Path, list[str], int]]] = {}
        self.buffered = 0
        self.peak_buffered = 0

    def add(self, role: str, rank: int, name: str, tensor: torch.Tensor) -> None:
        buffer = self._buffers.setdefault((role, rank), {})
        if name in buffer or any(name in names for _, names, _ in self._shards.get((role, rank), ())):
            raise ValueError(f"tensor {name} was written twice for {role} rank {rank}")
        buffer[name] = tensor.contiguous()
        self.buffered += tensor.numel() * tensor.element_size()
        self.peak_buffered = max(self.peak_buffered, self.buffered)

    def end_group(self) -> None:
        if self.buffered >= self.max_buffer_bytes:
            self.flush()

    def flush(self) -> None:
        for key, tensors in self._buffers.items():
            if not tensors:
                continue
            role, rank = key
            shards = self._shards.setdefault(key, [])
            path = self.root / role / f".rank{rank}-part{len(shards) + 1:05d}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path), metadata={"format": "pt"})
            shards.append((path, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())))
        self._buffers = {}
        self.buffered = 0

    def close(self) -> dict[tuple[str, int], int]:
        """Writes what is left, names the shards and writes the indexes; returns the bytes of each (role, rank)."""
        self.flush()
        totals = {}
        for (role, rank), shards in sorted(self._shards.items()):
            totals[(role, rank)] = total = sum(size for _, _, size in shards)
            if len(shards) == 1:
                shards[0][0].rename(rank_file(self.root, role, rank))
                continue
            weight_map = {}
            for i, (path, names, _) in enumerate(shards):
                final = path.with_name(f"rank{rank}-{i + 1:05d}-of-{len(shards):05d}.safetensors")
                path.rename(final)
                weight_map.update({name: final.name for name in names})
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            index_file(self.root, role, rank).write_text(json.dumps(index, indent=2) + "\n")
        return totals

    def files(self, role: str, rank: int) -> int:
        return len(self._shards.get((role, rank), ()))
