"""Small building blocks shared by the target and the drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before the norm, then the norm: (x + delta, norm(x + delta))."""
        total = x + delta
        return total, self(total)


class FusedRMSNorm(RMSNorm):
    """The GPU form: one Triton kernel instead of six (`models/triton_ops.py`), the same roundings; `add_norm` is
    one kernel too (the residual add fused in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from models.triton_ops import rms_norm

        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from models.triton_ops import add_rms_norm

        return add_rms_norm(x, delta, self.weight, self.eps)


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


def prepare_weights(model: nn.Module) -> None:
    """Once after loading: every submodule's own `prepare_weights` (MLA's rope rows de-interleaved, projections that
    run as one GEMM stacked)."""
    for module in model.modules():
        if module is not model and callable(getattr(module, "prepare_weights", None)):
            module.prepare_weights()


@torch.no_grad()
def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Stacks the weights of linears that read the same input into one [sum of outputs, in] tensor and points each
    linear's weight at its rows of it (no second copy): `F.linear(x, fused)` is then all of them in one GEMM."""
    fused = torch.cat([module.weight for module in linears])
    start = 0
    for module in linears:
        rows = module.weight.shape[0]
        module.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class GatedMLP(nn.Module):
    """SwiGLU MLP, one rank's column/row slice: the caller all-reduces the output.

    `fused` (GPUs): gate and up run as one GEMM over one stacked weight (SGLang's / vLLM's gate_up_proj), stacked by
    `prepare_weights` after loading; the CPU and the ONNX export keep one linear per weight."""

    def __init__(self, hidden: int, width: int, fused: bool = False):
        super().__init__()
        self.gate_proj = linear(hidden, width)
        self.up_proj = linear(hidden, width)
        self.down_proj = linear(width, hidden)
        self.fused = fused
        self.register_buffer("gate_up", None, persistent=False)
        self.gate_and_up = self._fused_gate_and_up if fused else self._gate_and_up

    def prepare_weights(self) -> None:
        if self.fused:
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def _gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def _fused_gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x, self.gate_up).chunk(2, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_and_up(x)
        return self.down_proj(F.silu(gate) * up)


class FusedGatedMLP(GatedMLP):
    """The GPU form: gate and up in one GEMM (always stacked: `fused` is taken for GatedMLP's signature),
    silu(gate) * up in one Triton kernel (`models/triton_ops.py`, `silu_mul`) where the plain form launches two."""

    def __init__(self, hidden: int, width: int, fused: bool = True):
        super().__init__(hidden, width, fused=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from models.triton_ops import silu_mul

        return self.down_proj(silu_mul(F.linear(x, self.gate_up)))


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank + 1) * V/tp) of the embedding; ids outside the slice contribute zeros."""

    def __init__(self, vocab_size: int, hidden: int, mapping, collectives):
        super().__init__()
        self.start, self.rows = mapping.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.collectives = collectives

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        rows = F.embedding(torch.clamp(local, 0, self.rows - 1), self.weight)
        return self.collectives.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class VocabParallelHead(nn.Module):
    """lm_head rows of this rank; the logits of all ranks are all-gathered along the vocab."""

    def __init__(self, vocab_size: int, hidden: int, mapping, collectives):
        super().__init__()
        _, rows = mapping.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather(F.linear(x, self.weight).to(torch.float32))
