"""Rotary position embedding with transformers' semantics ('default' and 'yarn').

For DeepSeek / Kimi (mscale = mscale_all_dim = 1) yarn's cos/sin amplitude ("attention_factor") is 1 and the
mscale enters the softmax scale instead (`TargetConfig.softmax_scale`). For HF-style drafters the amplitude is
`get_mscale(factor)` unless the config pins `attention_factor`.
"""

from __future__ import annotations

import math

import torch

from models.config import RopeConfig, yarn_mscale


def inv_freq_and_amplitude(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] in float32, cos/sin amplitude)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    amplitude = rope.attention_factor
    if amplitude is None:
        if rope.mscale and rope.mscale_all_dim:
            amplitude = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            amplitude = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(amplitude)


class Rotary(torch.nn.Module):
    """cos/sin tables computed from positions in the graph (no baked sequence length)."""

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.rope, self.dim = rope, dim
        inv_freq, self.amplitude = inv_freq_and_amplitude(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rebuild(self, device: torch.device | str) -> None:
        """Recomputes the table on `device` (after construction on the meta device)."""
        self.inv_freq = inv_freq_and_amplitude(self.rope, self.dim)[0].to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, dim]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.amplitude).to(dtype), (emb.sin() * self.amplitude).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation. x: [T, ..., dim]; cos, sin: [T, dim]. (GPUs: `triton_ops.fused_rotary`.)"""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)


def deinterleave_permutation(dim: int) -> torch.Tensor:
    """Row order that turns DeepSeek's interleaved rope pairs (x0, x1), (x2, x3)... into half-split layout.

    Applying it to the rope rows of q_b_proj and kv_a_proj_with_mqa at load time makes the half-split rotation
    produce exactly what transformers' `apply_rotary_pos_emb_interleave` produces (also the cached k_pe).
    """
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))
