"""DeepSeek-V3 / Kimi MoE, one rank's slice of every expert (TP-MoE): the caller all-reduces the output.

Routing (replicated on every rank, fp32): sigmoid scores; the `noaux_tc` choice adds `e_score_correction_bias`
and optionally limits choices to the best `topk_group` of `n_group` groups; the chosen experts are weighted by
their plain sigmoid scores, normalised over the top-k, times `routed_scaling_factor`.

Experts run token-choice by gathering the chosen experts' weight slices: T*k gathers, static shapes, no
data-dependent control flow, so the same code exports to ONNX and runs under CUDA graphs.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from models.config import TargetConfig
from models.streams import beside, join


class StackedExperts(nn.Module):
    """One projection of all routed experts: weight [n_experts, out, in]."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class Router(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        # the device loop's narrow steps (`runner/device/budget.py`): [T] bool, rows outside the step's budget take
        # row 0's experts with zero weight, so they add no expert to the forward's reads; None (always, in exports)
        self.row_active: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (expert ids [T, k], weights [T, k] fp32)."""
        scores = torch.sigmoid(F.linear(x.to(torch.float32), self.weight.to(torch.float32)))
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
            choice = (grouped.masked_fill(keep[..., None] == 0, float("-inf"))).view(x.shape[0], -1)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.row_active is not None:
            active = self.row_active[:, None]
            ids, weights = torch.where(active, ids, ids[:1]), torch.where(active, weights, 0.0)
        return ids, weights * self.scaling


class FusedRouter(Router):
    """The GPU form: the same choice in two Triton launches (`models/triton_ops.py`, `route_top_k`: the logits a
    K split at a time, each weight read once a block of 64 rows; then a program a token sums the splits in order,
    scores and picks) where the torch form takes about ten (its float32 GEMM alone ran on the CUDA cores at
    1.5 TB/s). Weights that are bf16 values (a bf16 checkpoint's router, upcast at load) are kept in bf16, half the
    bytes, and multiplied on tensor cores with float32 sums, products exact. A batch's verify takes them too (one
    H100: Kimi's routing at 144 / 528 rows 16.5 / 31.8 us against the torch form's 78.4 / 138.4; the trained pair's
    16-slot DDTree 8 step graph 1271.8 -> 1122.6 us, the same tokens; BENCHMARKS.md 18). Rows beyond `max_rows`
    (long prefills), float32 weights (whose float32-FMA form measured slower than torch's at one token,
    benchmarks/router_gpu.py) and activations other than bf16 take the torch form."""

    max_rows: int | None = None  # rows the kernels take (None: ROUTER_MAX_TOKENS; `DDTREE_ROUTER_MAX_ROWS`)

    def prepare_weights(self) -> None:
        weight = self.weight.data
        if weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).to(torch.float32), weight):
            self.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from models.triton_ops import ROUTER_MAX_TOKENS, route_top_k

        rows = self.max_rows or ROUTER_MAX_TOKENS
        if x.shape[0] > rows or self.weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
            return super().forward(x)
        return route_top_k(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                           self.norm_topk_prob, self.scaling, self.row_active)  # fmt: skip


@functools.cache
def fused_router(max_rows: int | None = None) -> type[FusedRouter]:
    """FusedRouter, or the same with the kernels taking at most `max_rows` rows (one class a limit, so the rank
    factory's cache sees the same forms)."""
    if max_rows is None:
        return FusedRouter
    return type(f"FusedRouter{max_rows}", (FusedRouter,), {"max_rows": max_rows})


def with_shared_experts(moe: nn.Module, x: torch.Tensor, routed) -> torch.Tensor:
    """routed(x) + moe.shared_experts(x); where `moe.overlap` (GPUs, `ModelOps.side_stream`) the shared expert runs
    on the side stream while the router and the routed experts run on the current one (`models/streams.py`)."""
    if not (moe.overlap and x.is_cuda):
        return routed(x) + moe.shared_experts(x)
    with beside(x.device):
        shared = moe.shared_experts(x)
    out = routed(x)
    join(x.device)
    return out + shared


@contextmanager
def active_rows(routers: list[Router], active: torch.Tensor | None):
    """`Router.row_active` set on `routers` for one forward (the device loop's narrow steps), and cleared after it,
    so the other forwards the same modules run (prefill, host-loop verifies, exports) route every row."""
    for router in routers:
        router.row_active = active
    try:
        yield
    finally:
        for router in routers:
            router.row_active = None


class MoE(nn.Module):
    """Token-choice MoE by gathering the chosen experts' slices (the exported form)."""

    def __init__(self, config: TargetConfig, layer_idx: int, ops):
        super().__init__()
        experts, hidden = config.n_routed_experts, config.hidden_size
        width = config.moe_intermediate_size // config.mapping.tp_size
        self.gate = ops.router(config)
        self.experts = nn.ModuleDict(
            {
                "gate_proj": StackedExperts(experts, width, hidden),
                "up_proj": StackedExperts(experts, width, hidden),
                "down_proj": StackedExperts(experts, hidden, width),
            }
        )
        width = config.shared_intermediate_size // config.mapping.tp_size
        self.shared_experts = ops.gated_mlp(hidden, width, ops.fused_projections)
        self.overlap = ops.side_stream

    def _gather(self, projection: str, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' slices: [T, k, out, in]."""
        weight = self.experts[projection].weight
        return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, *weight.shape[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_shared_experts(self, x, self.routed)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k]
        gate, up, down = (self._gather(name, ids) for name in ("gate_proj", "up_proj", "down_proj"))
        act = F.silu(torch.einsum("th,tkwh->tkw", x, gate)) * torch.einsum("th,tkwh->tkw", x, up)
        routed = torch.einsum("tkw,tkhw->tkh", act, down)
        return (routed * weights.to(x.dtype)[..., None]).sum(dim=1)


class DenseMoE(MoE):
    """Every routed expert applied to every token, weighted by the router's top-k weights (zero for the experts a
    token did not choose): the function token-choice computes, with one GEMM a projection and each expert's weights
    read once whatever the token count, where the gathered form copies T x k expert slices. The CPU form (ONNX
    Runtime and the torch reference) for models with few experts (`moe_form`): at one token it does E / k times the
    chosen experts' arithmetic, and a 33-token verify costs about what a decode does instead of 33 times the
    copies. The same parameters as `MoE`."""

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k]
        gate_w, up_w, down_w = (self.experts[n].weight for n in ("gate_proj", "up_proj", "down_proj"))
        experts, width, hidden = gate_w.shape
        dense = torch.zeros(x.shape[0], experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        gate = F.linear(x, gate_w.reshape(experts * width, hidden)).view(-1, experts, width)
        up = F.linear(x, up_w.reshape(experts * width, hidden)).view(-1, experts, width)
        act = (F.silu(gate) * up * dense.to(x.dtype)[..., None]).reshape(-1, experts * width)
        return F.linear(act, down_w.permute(1, 0, 2).reshape(hidden, experts * width))


def moe_form(config: TargetConfig) -> type:
    """The CPU MoE form: `DenseMoE` while the experts are few (E <= 4 k: at most 4x the chosen experts' arithmetic
    at one token), the gathered `MoE` otherwise."""
    return DenseMoE if config.n_routed_experts <= 4 * config.num_experts_per_tok else MoE


class GroupedMoE(MoE):
    """GPU form: the T*k (token, expert) pairs sorted by expert and run as one grouped GEMM per projection
    (`torch._grouped_mm`, CUTLASS on Hopper), so each chosen expert's weights are read once per forward however
    many tokens chose it. Static shapes (the group offsets live on the device), so CUDA graphs capture it.
    bf16 only; the weights are the same parameters as `MoE`'s."""

    def __init__(self, config: TargetConfig, layer_idx: int, ops):
        super().__init__(config, layer_idx, ops)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"GroupedMoE needs torch._grouped_mm (torch >= 2.8), this torch is {torch.__version__}")
        self.num_experts = config.n_routed_experts

    def sort_pairs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The T*k (token, expert) pairs of ids [T, k] sorted by expert, stably: (order [T*k]: the pairs' flat
        indices in that order, token [T*k]: each sorted pair's token, offsets [E] int32: where each expert's pairs
        end), in device work only."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
        return order, order // ids.shape[1], counts.cumsum(0).to(torch.int32)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k]
        order, token, offsets = self.sort_pairs(ids)
        rows = x.index_select(0, token)  # [T*k, hidden], grouped by expert
        gate = torch._grouped_mm(rows, self.experts["gate_proj"].weight.transpose(1, 2), offs=offsets)
        up = torch._grouped_mm(rows, self.experts["up_proj"].weight.transpose(1, 2), offs=offsets)
        down = torch._grouped_mm(F.silu(gate) * up, self.experts["down_proj"].weight.transpose(1, 2), offs=offsets)
        scaled = down * weights.reshape(-1).index_select(0, order).to(down.dtype)[:, None]
        # back to [T, k] order and summed over k in a fixed order: an index_add_ into the tokens' rows adds with
        # atomics on GPUs, in an order that changes between runs (greedy bf16 output did); this also rounds once
        unsorted = torch.empty_like(order).index_put_((order,), torch.arange(order.numel(), device=order.device))
        return scaled.index_select(0, unsorted).view(*ids.shape, -1).sum(dim=1)


class RoutedGroupedMoE(GroupedMoE):
    """`GroupedMoE` whose pairs are sorted in one launch: the INT4 experts' routing program
    (`plugins/int4_moe/kernel.route`: the sort, each expert's count and start), where the stable `argsort` and the
    counts take several launches. One H100, a 16-slot DDTree 8 step of the trained pair: the `argsort` alone took
    127 us of 1299 in its 5 MoE layers (25 us each over 576 pairs; 8.5 us over 64 in an autoregressive step).
    Up to `ROUTE_MAX_PAIRS` pairs (more: `GroupedMoE`'s sort). The same order as the stable sort (the routing's tests
    check it), so the same outputs. Not yet timed on a GPU: `DDTREE_MOE_ROUTE=kernel` takes it
    (`runner.factory.gpu_ops`)."""

    def sort_pairs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from plugins.int4_moe.kernel import ROUTE_MAX_PAIRS, route

        if ids.numel() > ROUTE_MAX_PAIRS:
            return super().sort_pairs(ids)
        order, token, start, count, _, _ = route(ids, self.num_experts)
        return order, token, start + count


class PackedExperts(nn.Module):
    """One projection of all routed experts kept INT4 (compressed-tensors pack-quantized, W4A16): `weight_packed`
    [n_experts, out, in / 8] int32 and `weight_scale` [n_experts, out, in / group_size] (bf16 in the checkpoint,
    the model's dtype once loaded)."""

    def __init__(self, experts: int, out_features: int, in_features: int, group_size: int):
        super().__init__()
        self.register_buffer("weight_packed", torch.empty(experts, out_features, in_features // 8, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(experts, out_features, in_features // group_size))


class PackedMoE(nn.Module):
    """The MoE of a checkpoint whose routed experts stayed INT4: routing and the shared expert as in `MoE`, the
    routed experts through `ops.int4_moe` (the `ddtree::Int4MoE` op: torch reference, ONNX op or GPU kernel), so the
    packed weights go from the checkpoint to the kernel."""

    def __init__(self, config: TargetConfig, layer_idx: int, ops):
        super().__init__()
        experts, hidden = config.n_routed_experts, config.hidden_size
        width = config.moe_intermediate_size // config.mapping.tp_size
        self.group_size = config.quantization.group_size
        self.gate = ops.router(config)
        self.experts = nn.ModuleDict(
            {
                "gate_proj": PackedExperts(experts, width, hidden, self.group_size),
                "up_proj": PackedExperts(experts, width, hidden, self.group_size),
                "down_proj": PackedExperts(experts, hidden, width, self.group_size),
            }
        )
        width = config.shared_intermediate_size // config.mapping.tp_size
        self.shared_experts = ops.gated_mlp(hidden, width, ops.fused_projections)
        self.overlap = ops.side_stream
        self.int4_moe = ops.int4_moe
        self.int4_kwargs = {}  # {"layout": ...} once the op has reordered the words (`prepare_weights`)

    def prepare_weights(self) -> None:
        dtype = self.shared_experts.down_proj.weight.dtype
        for experts in self.experts.values():
            experts.weight_scale = experts.weight_scale.to(dtype)
        prepare = getattr(self.int4_moe, "prepare_experts", None)  # the GPU kernel's faster layout, once at load
        if prepare is not None:
            names = ("gate_proj", "up_proj", "down_proj")
            _, layout = prepare(*(self.experts[n].weight_packed for n in names), self.group_size)  # in place
            self.int4_kwargs = {"layout": layout}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_shared_experts(self, x, self.routed)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k]
        packed = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            packed += [self.experts[name].weight_packed, self.experts[name].weight_scale]
        return self.int4_moe(x, ids, weights, *packed, self.group_size, **self.int4_kwargs)
