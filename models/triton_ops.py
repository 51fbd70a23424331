"""Fused GPU kernels (Triton) for the torch backend's small per-token operations.

At batch 1 a forward is thousands of tiny kernels: the profile of one Kimi TP-8 rank (`benchmarks/profile_forward.py`)
spends more time in RMSNorm (6 kernels each: cast, square, mean, add, rsqrt, scale) and the rotary embedding (slice,
negate, concatenate, two products, a sum) than in the attention kernel, and the mean's reduction gets slower with
the verify's 33 rows. Here each is one kernel, one program per row, so a row's result does not depend on how many
rows the forward has (the verify and a decode step round alike). They reproduce the torch expressions' roundings
(`layers.RMSNorm`, `rope.apply_rotary`) in the input dtype. CUDA tensors only; the CPU (and ONNX export) paths keep
the plain torch expressions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weighted_norm(x, x_ptr, w_ptr, offs, ok, n, eps):
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x_ptr's dtype), float32: `layers.RMSNorm`'s roundings; x float32
    (zeros past n)."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # x.to(input dtype), as transformers does
    return tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * normed


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
    out = _weighted_norm(x, x_ptr, w_ptr, offs, ok, n, eps)
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), over the last dim; x's rows may be strided. `out`: a
    [rows, n] destination whose rows may be strided too (e.g. columns of a wider buffer), written and returned."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view where the rows allow it (2-D inputs always)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is not None and (out.shape != rows.shape or out.stride(-1) != 1 or out.dtype != dtype):
        raise ValueError(f"rms_norm out must be {dtype} {tuple(rows.shape)} with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")  # fmt: skip
    result = torch.empty(rows.shape, dtype=dtype, device=x.device) if out is None else out
    block = triton.next_power_of_2(n)
    _rms_norm[(rows.shape[0],)](rows, weight, result, rows.stride(0), result.stride(0), n, eps, BLOCK=block,
                                num_warps=max(1, min(8, block // 512)))  # fmt: skip
    return result if out is not None else result.view(x.shape)


@triton.jit
def _add_rms_norm(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, x_stride, d_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * d_stride + offs, mask=ok, other=0.0).to(tl.float32)
    h = (x + d).to(sum_ptr.dtype.element_ty)  # the residual add, rounded as torch's add rounds it
    tl.store(sum_ptr + row * n + offs, h, mask=ok)
    out = _weighted_norm(h.to(tl.float32), sum_ptr, w_ptr, offs, ok, n, eps)
    tl.store(out_ptr + row * n + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)) in one kernel: the residual add and the RMSNorm after it (each [rows, n],
    contiguous; the sum in x's dtype, rounded as torch's add rounds it, then normalised as `rms_norm` does)."""
    n = x.shape[-1]
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: delta must be {x.dtype} {tuple(x.shape)}, got {delta.dtype} {tuple(delta.shape)}"
        )
    rows, delta_rows = x.reshape(-1, n).contiguous(), delta.reshape(-1, n).contiguous()
    total = torch.empty_like(rows)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    _add_rms_norm[(rows.shape[0],)](rows, delta_rows, weight, total, out, rows.stride(0), delta_rows.stride(0), n, eps,
                                    BLOCK=block, num_warps=max(1, min(8, block // 512)))  # fmt: skip
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _rotary(
    x_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_r, out_t, out_r, rows, HALF: tl.constexpr, BLOCK_R: tl.constexpr
):
    t = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = r < rows
    src = x_ptr + t * stride_t + r * stride_r + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    table = t * 2 * HALF + d
    c1, c2 = tl.load(cos_ptr + table).to(tl.float32), tl.load(cos_ptr + table + HALF).to(tl.float32)
    s1, s2 = tl.load(sin_ptr + table).to(tl.float32), tl.load(sin_ptr + table + HALF).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype before the sum (as torch computes it)
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    dst = out_ptr + t * out_t + r * out_r + d
    tl.store(dst, o1, mask=ok)
    tl.store(dst + HALF, o2, mask=ok)


def rotary_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    half = x.shape[-1] // 2
    return (
        x.dim() in (2, 3)
        and x.stride(-1) == 1
        and half >= 1
        and half & (half - 1) == 0
        and cos.shape == (x.shape[0], x.shape[-1])
        and cos.dtype == x.dtype
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Half-split rotation of x [T, dim] or [T, R, dim] (strided rows allowed) by cos, sin [T, dim]. `out`: a
    destination of x's shape and dtype, rows may be strided (e.g. columns of a wider buffer), written and returned."""
    rows = x.shape[1] if x.dim() == 3 else 1
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"rotary out must be {x.dtype} {tuple(x.shape)} with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")  # fmt: skip
    three = x.dim() == 3
    _rotary[(x.shape[0],)](x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1) if three else 0,
                           out.stride(0), out.stride(1) if three else 0, rows, HALF=x.shape[-1] // 2,
                           BLOCK_R=triton.next_power_of_2(rows), num_warps=1)  # fmt: skip
    return out


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rotary` as one kernel where the kernel takes the layout (`rotary_supported`), else the torch form."""
    from models.rope import apply_rotary

    return rotary(x, cos, sin) if rotary_supported(x, cos) else apply_rotary(x, cos, sin)
