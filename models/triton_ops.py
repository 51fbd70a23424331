"""Fused GPU kernels (Triton) for the torch backend's small per-token operations.

At batch 1 a forward is thousands of tiny kernels: the profile of one Kimi TP-8 rank (`benchmarks/profile_forward.py`)
spends more time in RMSNorm (6 kernels each: cast, square, mean, add, rsqrt, scale) and the rotary embedding (slice,
negate, concatenate, two products, a sum) than in the attention kernel, and the mean's reduction gets slower with
the verify's 33 rows. Here each is one kernel, one program per row, so a row's result does not depend on how many
rows the forward has (the verify and a decode step round alike). They reproduce the torch expressions' roundings
(`layers.RMSNorm`, `rope.apply_rotary`) in the input dtype; so does the SwiGLU act (`silu_mul`, `FusedGatedMLP`).
The MoE router (`route_top_k`, `moe.FusedRouter`) is two launches instead of about ten: its logits a K split at a
time, then its choice a program a token. CUDA tensors only; the CPU (and ONNX export) paths keep the plain torch
expressions.
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


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, width, in_stride, out_stride, BLOCK: tl.constexpr):
    """out[t, j] = silu(gate[t, j]) * up[t, j] for gate_up = [gate | up] rows, rounded as torch rounds
    `F.silu(gate) * up` (the silu to the dtype, then the product)."""
    t, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    row = gate_up_ptr + t * in_stride
    gate = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + width + offs, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + t * out_stride + offs, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2W] (gate and up side by side, one GEMM's output) -> silu(gate) * up [T, W], one kernel instead of two."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul[(tokens, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                    num_warps=4)  # fmt: skip
    return out


@triton.jit
def _head_matmul(a_ptr, w_ptr, out_ptr, rows, k, n, a_t, a_h, w_h, w_k, w_j, out_t, out_h, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Program (head h, block of output columns): out[t, h, j] = sum_k a[t, h, k] w[h, k, j] for every row t,
    float32 sums (tensor cores; float32 inputs in full precision, not TF32), rounded once to out's dtype."""
    h, pid = tl.program_id(0), tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
    t_ok, j_ok = offs_t < rows, offs_j < n
    acc = tl.zeros([BLOCK_T, BLOCK_J], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        a = tl.load(a_ptr + offs_t[:, None] * a_t + h * a_h + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_ptr + h * w_h + offs_k[:, None] * w_k + offs_j[None, :] * w_j, mask=k_ok[:, None] & j_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dst = out_ptr + offs_t[:, None] * out_t + h * out_h + offs_j[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & j_ok[None, :])


HEAD_MATMUL_MAX_ROWS = 64


def head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t, h, :] = a[t, h, :] @ w[h] for a [T <= HEAD_MATMUL_MAX_ROWS, H, K] and w [H, K, N] (any strides; a and
    out with unit last stride), one launch for every head: MLA's absorbed products (q_nope @ W_kc, latent @ W_vc^T)
    at decode and verify rows: 2.85 us a call at one row where the two batched GEMMs took 4.6 and 2.8 (BENCHMARKS.md,
    the decode forward)."""
    rows, heads, k = a.shape
    n = w.shape[2]
    if rows > HEAD_MATMUL_MAX_ROWS or w.shape[:2] != (heads, k) or out.shape != (rows, heads, n):
        raise ValueError(f"head_matmul: a [<= {HEAD_MATMUL_MAX_ROWS}, H, K], w [H, K, N], out [T, H, N]; got "
                         f"{tuple(a.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")  # fmt: skip
    if a.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"head_matmul: a and out need unit last strides, got {a.stride()} and {out.stride()}")
    block_j = min(64, triton.next_power_of_2(n))
    _head_matmul[(heads, triton.cdiv(n, block_j))](
        a, w, out, rows, k, n, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), BLOCK_T=max(16, triton.next_power_of_2(rows)), BLOCK_K=min(128, triton.next_power_of_2(k)),
        BLOCK_J=block_j, PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4)  # fmt: skip
    return out


# The MoE router (`models/moe.py`, `Router`): the router's logits, then its choice, in two launches instead of the
# torch form's ten (fp32 GEMM, sigmoid, bias add, top-k with its sort, gather, sum, division, scaling, casts).


@triton.jit
def _router_logits(x_ptr, w_ptr, part_ptr, tokens, x_stride, experts, hidden, split_k, BLOCK_T: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """Program (expert block, K split, token block): part[split, t, e] = sum over the split's inputs of x[t, k] w[e, k]
    for the block's tokens, in float32. bf16 x and w: tensor cores (each product exact in float32); else float32 FMAs.
    Each weight is read once a token block (once where the tokens fit one block: a verify of up to BLOCK_T rows)."""
    pid_e, pid_k, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    t_ok, e_ok = offs_t < tokens, offs_e < experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    start = pid_k * split_k
    for k0 in tl.range(start, start + split_k, BLOCK_K, num_stages=3):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_ptr + offs_t[:, None] * x_stride + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_e[:, None] * hidden + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        if BF16:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    dst = part_ptr + (pid_k * tokens + offs_t[:, None]) * experts + offs_e[None, :]
    tl.store(dst, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_select(part_ptr, bias_ptr, active_ptr, ids_ptr, weights_ptr, splits, tokens, experts, scaling,
                   BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr,
                   N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                   HAS_ACTIVE: tl.constexpr):  # fmt: skip
    """Program t: token t's logits (the splits summed in split order), sigmoid scores, the noaux_tc choice (scores +
    bias, limited to the best TOPK_GROUP of N_GROUP groups by the sum of each group's best two), the TOP_K best in
    descending order (the lowest index among equals) and their plain scores, normalised over the k and scaled. A row
    outside the step (HAS_ACTIVE, active[t] false) takes row 0's experts with zero weights, as `Router` does."""
    t = tl.program_id(0)
    src = t
    if HAS_ACTIVE:
        active = tl.load(active_ptr + t) != 0
        src = tl.where(active, t, 0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < experts
    part = tl.load(part_ptr + (offs_s[:, None] * tokens + src) * experts + offs_e[None, :],
                   mask=(offs_s[:, None] < splits) & e_ok[None, :], other=0.0)  # fmt: skip
    scores = tl.sigmoid(tl.sum(part, axis=0))
    choice = tl.where(e_ok, scores + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0), float("-inf"))
    if N_GROUP > 1:
        group = offs_e // (experts // N_GROUP)
        offs_g = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            mine = tl.where(group == g, choice, float("-inf"))
            best = tl.max(mine, axis=0)
            first = tl.min(tl.where(mine == best, offs_e, BLOCK_E), axis=0)
            second = tl.max(tl.where(offs_e == first, float("-inf"), mine), axis=0)
            group_score = tl.where(offs_g == g, best + second, group_score)
        keep = offs_e < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == best, offs_g, N_GROUP), axis=0)
            keep = keep | (group == pick)
            group_score = tl.where(offs_g == pick, float("-inf"), group_score)
        choice = tl.where(keep, choice, float("-inf"))
    # the top k by one reduction each: a key that orders as the choice does (its float bits made signed-monotonic)
    # with the lower index winning among equals
    bits = choice.to(tl.int32, bitcast=True)
    key = (tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) << 16) | (0xFFFF - offs_e)
    offs_k = tl.arange(0, BLOCK_TOP)
    ids = tl.zeros([BLOCK_TOP], dtype=tl.int64)
    weights = tl.zeros([BLOCK_TOP], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        pick = 0xFFFF - (tl.max(key, axis=0) & 0xFFFF)
        ids = tl.where(offs_k == i, pick, ids)
        weights = tl.where(offs_k == i, tl.sum(tl.where(offs_e == pick, scores, 0.0), axis=0), weights)
        key = tl.where(offs_e == pick, -(1 << 62), key)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    if HAS_ACTIVE:
        weights = tl.where(active, weights, 0.0)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids, mask=offs_k < TOP_K)
    tl.store(weights_ptr + t * TOP_K + offs_k, weights * scaling, mask=offs_k < TOP_K)


ROUTER_BLOCK_T = 64  # the logits' token block (a lone request's verify of budget 32 has 33 rows)
# rows the kernels take: a batch's verify (16 slots of budget 32: 528 rows); longer prefills keep the torch form
ROUTER_MAX_TOKENS = 1024
ROUTER_SPLITS = 8


def router_splits(experts: int, hidden: int, block_e: int, block_k: int, device: torch.device) -> int:
    """Inputs a K split of the router's logits: about two programs an SM over the expert blocks, whole chunks, at
    most ROUTER_SPLITS splits (the choice's program sums them all). The same at any row count, so a row's logits are
    summed in the same order alone and in a batch's verify."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    splits = max(1, min(triton.cdiv(hidden, block_k), 2 * sms // triton.cdiv(experts, block_e), ROUTER_SPLITS))
    return triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k


def route_top_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                norm: bool, scaling: float, active: torch.Tensor | None = None, block_e: int = 32, warps: int = 4,
                select_warps: int = 4):  # fmt: skip
    """`Router.forward` for x [T <= ROUTER_MAX_TOKENS, hidden]: (expert ids [T, k] int64, weights [T, k] float32);
    the logits' programs take ROUTER_BLOCK_T rows each. weight [E, hidden] float32, or bfloat16 where the router's
    weights are bf16 values (a bf16 checkpoint's): then with bf16 x the logits run on tensor cores, each product
    exact, the sums in float32 as the torch form's. block_e / warps: the logits' launch (experts a program, warps);
    select_warps: the choice's."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if tokens > ROUTER_MAX_TOKENS:
        raise ValueError(f"route_top_k takes at most {ROUTER_MAX_TOKENS} rows, got {tokens}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    # tensor cores for bf16 operands on a GPU; the Triton interpreter's bf16 dot is not exact, so on the CPU (tests)
    # the same bf16 operands take the float32 form, whose products and sums are the same
    bf16 = weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and x.is_cuda
    block_k = 128 if bf16 else 64
    block_t = min(ROUTER_BLOCK_T, max(16, triton.next_power_of_2(tokens)))
    token_blocks = triton.cdiv(tokens, block_t)
    split_k = router_splits(experts, hidden, block_e, block_k, x.device)
    splits = triton.cdiv(hidden, split_k)
    part = torch.empty(splits, tokens, experts, dtype=torch.float32, device=x.device)
    _router_logits[(triton.cdiv(experts, block_e), splits, token_blocks)](
        x, weight, part, tokens, x.stride(0), experts, hidden, split_k, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=block_k, BF16=bf16, num_warps=warps)  # fmt: skip
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    _router_select[(tokens,)](
        part, bias, active if active is not None else ids, ids, weights, splits, tokens, experts, float(scaling),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_E=triton.next_power_of_2(experts), TOP_K=top_k,
        BLOCK_TOP=triton.next_power_of_2(top_k), N_GROUP=n_group, BLOCK_G=triton.next_power_of_2(n_group),
        TOPK_GROUP=topk_group, NORM=norm, HAS_ACTIVE=active is not None, num_warps=select_warps)  # fmt: skip
    return ids, weights
