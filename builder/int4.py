"""compressed-tensors `pack-quantized` INT4 (W4A16, symmetric, group-wise), as Kimi K2.x stores routed experts.

Layout (compressed-tensors `pack_to_int32`, packed_dim=1): a weight [out, in] is quantized per group of
`group_size` input columns; each int4 value v in [-8, 7] is stored unsigned as v + 8, eight to an int32, the
j-th value of a word in bits [4j, 4j+4). `weight_packed` is [out, in / 8] int32, `weight_scale` is
[out, in / group_size], `weight_shape` is [2]. Dequantized weight = v * scale (no zero point).
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32
Q_MIN, Q_MAX = -8, 7


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [out, in] -> (int8 values in [-8, 7], scale [out, in // group_size]) with the minmax observer."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"INT4 group_size={group_size} must divide the input width {in_features}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / ((Q_MAX - Q_MIN) / 2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = torch.clamp(torch.round(groups / scale[..., None]), Q_MIN, Q_MAX).to(torch.int8)
    return values.reshape(out_features, in_features), scale


def pack(values: torch.Tensor) -> torch.Tensor:
    """int8 values [out, in] in [-8, 7] -> int32 [out, ceil(in / 8)]."""
    if values.dtype != torch.int8:
        raise ValueError(f"pack expects int8 values, got {values.dtype}")
    rows, cols = values.shape
    padded = -(-cols // PACK_FACTOR) * PACK_FACTOR
    unsigned = torch.nn.functional.pad((values.to(torch.int32) - Q_MIN), (0, padded - cols))
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32) * 4
    words = (unsigned.reshape(rows, -1, PACK_FACTOR) << shifts).sum(dim=-1, dtype=torch.int64)
    # Values >= 2^31 wrap to negative int32, as compressed-tensors' int32 sum does.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 values [out, in] in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {packed.dtype}")
    rows, cols = int(shape[0]), int(shape[1])
    if packed.shape[0] != rows or packed.shape[1] * PACK_FACTOR < cols:
        raise ValueError(f"weight_packed shape {tuple(packed.shape)} cannot hold a weight of shape {(rows, cols)}")
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles.reshape(rows, -1)[:, :cols] + Q_MIN).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """The float32 weight [out, in] that a compressed-tensors checkpoint stands for."""
    values = unpack(packed, shape).float()
    rows, cols = values.shape
    expected = (rows, cols // group_size)
    if tuple(scale.shape) != expected:
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not match {expected} (group_size={group_size})")
    return (values.reshape(rows, -1, group_size) * scale.float()[..., None]).reshape(rows, cols)
