"""Torch reference of `ddtree::Int4MoE` (the oracle; also the CPU form the rank factory picks).

The chosen experts' packed slices are gathered (T x top-k gathers, static shapes), unpacked and scaled exactly as
compressed-tensors defines the weight (value * group scale, in float32), cast to x's dtype, then run as the gathered
MoE does (`models.moe.MoE`), so a packed checkpoint gives the same numbers as the same checkpoint dequantized.

Two word layouts, the same bytes (`LAYOUTS`): "compressed-tensors", the checkpoint's (nibble j of word w holds input
8 w + j), and "rows" (`kernel.repack_rows`: nibble j of word w holds input j * words + w), which the GPU kernels run
fastest and exported graphs carry where the dimensions allow it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK = 8  # int4 values per int32 word
LAYOUTS = ("compressed-tensors", "rows")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"Int4MoE layout must be one of {list(LAYOUTS)}: got {layout!r}")


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                       layout: str = "compressed-tensors") -> torch.Tensor:  # fmt: skip
    """packed [..., out, in / 8] int32 (words in `layout`), scale [..., out, in / group_size] -> float32 weights
    [..., out, in]."""
    check_layout(layout)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = ((packed.unsqueeze(-1) >> shifts) & 0xF) - 8  # [..., out, in / 8, 8]: nibble j of word w
    if layout == "rows":  # nibble j of word w is input j * words + w
        values = values.transpose(-1, -2)
    *lead, out_features, words = packed.shape
    grouped = values.reshape(*lead, out_features, -1, group_size).to(torch.float32)
    return (grouped * scale.to(torch.float32).unsqueeze(-1)).reshape(*lead, out_features, words * PACK)


def int4_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_packed: torch.Tensor,
    gate_scale: torch.Tensor,
    up_packed: torch.Tensor,
    up_scale: torch.Tensor,
    down_packed: torch.Tensor,
    down_scale: torch.Tensor,
    group_size: int,
    layout: str = "compressed-tensors",
) -> torch.Tensor:
    """x [T, H], expert_ids [T, k] int64, expert_weights [T, k] float32 -> sum_k w * down(silu(gate x) * up x); the
    packed words in `layout`."""
    check_layout(layout)
    flat = expert_ids.reshape(-1)

    def chosen(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        weight = dequantize_experts(packed.index_select(0, flat), scale.index_select(0, flat), group_size, layout)
        return weight.to(x.dtype).view(*expert_ids.shape, *weight.shape[1:])  # [T, k, out, in]

    gate, up, down = chosen(gate_packed, gate_scale), chosen(up_packed, up_scale), chosen(down_packed, down_scale)
    act = F.silu(torch.einsum("th,tkwh->tkw", x, gate)) * torch.einsum("th,tkwh->tkw", x, up)
    routed = torch.einsum("tkw,tkhw->tkh", act, down)
    return (routed * expert_weights.to(x.dtype)[..., None]).sum(dim=1)
