"""The W4A16 grouped MoE kernel (`plugins/int4_moe/kernel.py`) at Kimi K2.x per-rank TP-8 dimensions on one GPU:
hidden 7168, 384 routed experts of width 2048 / 8 = 256 (INT4, groups of 32), top-8, a shared expert of width 256.

    python benchmarks/int4_moe_gpu.py OUT_DIR [--tokens 1,8,16,33] [--repeats 3] [--smoke]

For each routing and T: the kernel is checked against the torch reference (bf16, relative error < 1e-2), then timed
(median of CUDA-graph replays, `benchmarks.common.graph_time_us`, median over --repeats): the routed experts alone,
and the whole layer (router + routed experts + shared expert; the routed experts follow the chosen distribution,
the router's cost is counted). In the same run: `torch._grouped_mm` on the same experts in bf16 (4.2 GB a rank) and
the gathered dequantize-then-grouped-GEMM (each pair's expert dequantized to bf16, then one grouped GEMM a
projection). The INT4 byte floor: packed weights + scales of the distinct chosen experts + the shared expert and the
router in bf16, at the device copy rate measured in the same run.

Routings: `random` (8 distinct experts a token, uniform); `skewed` (8 distinct a token, drawn with probability
proportional to 1 / (i + 1) over a fixed random order of the experts: Zipf, exponent 1); `pooled` (8 distinct a
token out of one fixed pool of 16, uniform: a block whose tokens share experts; `int4_gemv_probe.py`).
`--smoke`: tiny dimensions on the CPU (run under TRITON_INTERPRET=1), float32: checks the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triton.runtime.errors import OutOfResources  # noqa: E402

from benchmarks.common import environment, graph_time_us, measure_ceilings  # noqa: E402
from models.config import QuantConfig  # noqa: E402
from models.mapping import Mapping  # noqa: E402
from models.presets import kimi_k2  # noqa: E402
from plugins.int4_moe import token_cuda  # noqa: E402
from plugins.int4_moe.kernel import DEFAULT_TUNING, Int4MoEKernel, Tuning, int4_moe_cuda, repack_rows  # noqa: E402
from plugins.int4_moe.reference import dequantize_experts, int4_moe  # noqa: E402

GROUP = 32


def rank_config(smoke: bool):
    config = replace(kimi_k2(8), quantization=QuantConfig(group_size=GROUP), mapping=Mapping(8, 0, 8))
    if smoke:
        config = replace(config, hidden_size=128, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4)
    return config


def make_weights(config, device, dtype, gen):
    """Packed experts [E, W, H / 8] etc. (random words, small positive scales), shared expert and router in dtype."""
    experts, hidden = config.n_routed_experts, config.hidden_size
    width = config.moe_intermediate_size // config.mapping.tp_size

    def packed(rows, cols):
        words = torch.randint(-(2**31), 2**31 - 1, (experts, rows, cols // 8), dtype=torch.int32, generator=gen)
        scales = torch.rand(experts, rows, cols // GROUP, generator=gen) * 0.02 + 0.005
        return words.to(device), scales.to(device, dtype)

    tensors = [*packed(width, hidden), *packed(width, hidden), *packed(hidden, width)]
    shared = [torch.randn(s, generator=gen).mul(0.02).to(device, dtype) for s in ((2 * width, hidden), (hidden, width))]
    router = torch.randn(experts, hidden, generator=gen).mul(0.02).to(device, dtype)
    return tensors, shared, router, width


def packed_expert_bytes(hidden: int, width: int) -> int:
    """The packed bytes of one expert: gate, up and down's INT4 words and their bf16 scales (one per GROUP inputs)."""
    return 3 * hidden * width // 2 + 3 * hidden * width // GROUP * 2


def rows_probe_setup(device, dtype):
    """What the rows-layout probes share: the rank config, its random packed experts (checkpoint and rows layout),
    the packed bytes of one expert (words and scales of gate, up and down) and the ceilings measured now."""
    config = rank_config(False)
    tensors, _, _, width = make_weights(config, device, dtype, torch.Generator().manual_seed(0))
    rows = [repack_rows(t) if t.dtype == torch.int32 else t for t in tensors]
    return config, tensors, rows, packed_expert_bytes(config.hidden_size, width), measure_ceilings(False)


def routing(kind: str, tokens: int, experts: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "random":
        scores = torch.rand(tokens, experts, generator=gen)
    elif kind == "pooled":  # every token's k experts from one pool of 2 k (a block whose tokens share experts)
        pool = torch.randperm(experts, generator=torch.Generator().manual_seed(7))[: 2 * k]
        scores = torch.zeros(tokens, experts)
        scores[:, pool] = 1.0 + torch.rand(tokens, pool.numel(), generator=gen)
    else:
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(7))
        probs = torch.empty(experts)
        probs[order] = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32)
        # k distinct experts a token, drawn without replacement with these probabilities (Gumbel top-k)
        scores = probs.log() - torch.log(-torch.log(torch.rand(tokens, experts, generator=gen)))
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def grouped_bf16(x, ids, weights, dense):
    """torch._grouped_mm over the pairs sorted by expert, on bf16 experts [E, out, in] (as `models.moe.GroupedMoE`)."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(dense[0].shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return _grouped_mlp(x, ids, weights, order, counts.cumsum(0).to(torch.int32), dense)


def _grouped_mlp(x, ids, weights, order, offsets, dense):
    """The pairs' rows in `order`, one grouped GEMM a projection over `dense` [groups, out, in] split at `offsets`,
    weighted and added back into the tokens' rows."""
    rows = x.index_select(0, order // ids.shape[1])
    gate = torch._grouped_mm(rows, dense[0].transpose(1, 2), offs=offsets)
    up = torch._grouped_mm(rows, dense[1].transpose(1, 2), offs=offsets)
    down = torch._grouped_mm(F.silu(gate) * up, dense[2].transpose(1, 2), offs=offsets)
    scaled = down * weights.reshape(-1).index_select(0, order).to(down.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, order // ids.shape[1], scaled)


def dequantize_then_grouped(x, ids, weights, tensors):
    """Each pair's expert gathered and dequantized to x's dtype, then one grouped GEMM a projection (one group a
    pair): what a stack without a W4A16 kernel runs."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    chosen = flat.index_select(0, order)
    offsets = torch.arange(1, flat.numel() + 1, dtype=torch.int32, device=x.device)
    dense = [
        dequantize_experts(tensors[i].index_select(0, chosen), tensors[i + 1].index_select(0, chosen), GROUP).to(
            x.dtype
        )
        for i in (0, 2, 4)
    ]
    return _grouped_mlp(x, ids, weights, order, offsets, dense)


def triton_tensor_cores(tuning: Tuning) -> Tuning:
    """`tuning` with the rows layout's Triton tensor-core form at every T (no CUDA C form, no CUDA-core form)."""
    return replace(tuning, gemv_tokens=0, token_kernel="triton", block_kernel="triton")


def time_forms(x, gx, ids, weights, tensors, shared, router, dense, device, smoke: bool, repeats: int,
               tuning: Tuning, ready, layout: str) -> dict:  # fmt: skip
    """Median time of each form (microseconds). int4_kernel_us: the experts as the rank factory runs them (`ready`
    in `layout`: in the rows layout the CUDA C forms where they take the shape, one token and blocks up to
    `tuning.block_tokens`); tiles_kernel_us: in the checkpoint's layout, as the TensorRT plugin runs them; in the rows
    layout also rows_tensor_cores_us: the Triton tensor-core form alone, at every T."""

    def layer():
        torch.sigmoid(F.linear(x.float(), router.float()))  # the router's cost (its choice is `ids`)
        routed = int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=tuning, layout=layout)
        gate, up = F.linear(x, shared[0]).chunk(2, dim=-1)
        return routed + F.linear(F.silu(gate) * up, shared[1])

    forms = {
        "int4_kernel_us": lambda: int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=tuning, layout=layout),
        "tiles_kernel_us": lambda: int4_moe_cuda(x, ids, weights, *tensors, GROUP, tuning=tuning),
        "layer_us": layer,
        "grouped_mm_bf16_us": lambda: grouped_bf16(gx, ids, weights, dense),
        "dequantize_then_grouped_us": lambda: dequantize_then_grouped(gx, ids, weights, tensors),
    }
    if layout == "rows" and x.shape[0] == 1:  # one token: the Triton CUDA-core form beside the CUDA C kernels
        triton_token = replace(tuning, token_kernel="triton")
        forms["token_triton_us"] = lambda: int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=triton_token,
                                                         layout=layout)  # fmt: skip
    if layout == "rows":
        tensor_cores = triton_tensor_cores(tuning)
        forms["rows_tensor_cores_us"] = lambda: int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=tensor_cores,
                                                              layout=layout)  # fmt: skip
    return {
        name: statistics.median(graph_time_us(fn, device, smoke) for _ in range(repeats)) for name, fn in forms.items()
    }


def sweep_tunings(tensors, config, device, dtype, smoke: bool, pipeline: bool = False):
    """Times every launch shape of a small grid at T = 1 and 33 (random routing); the best by the geometric mean.
    pipeline: the grid of input words a K step reads (gate/up, down) and pipeline stages, at the default shapes."""
    import itertools
    import math

    experts, hidden, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    gen = torch.Generator().manual_seed(11)
    cases = []
    for tokens in (1, 33):
        ids, weights = routing("random", tokens, experts, k, gen)
        cases.append((torch.randn(tokens, hidden, generator=gen).to(device, dtype), ids.to(device), weights.to(device)))
    grid = [Tuning(g, d, kw, per_sm, warps) for g, d, kw, per_sm, warps in
            itertools.product((32, 64, 128), (64, 128, 256), (8, 16), (2, 8), (4, 8))]  # fmt: skip
    if pipeline:
        base = vars(DEFAULT_TUNING)
        grid = [Tuning(**{**base, "gate_kw": g, "down_kw": d, "stages": st})
                for g, d, st in itertools.product((16, 32, 64), (8, 16, 32), (1, 2, 3, 4))]  # fmt: skip
    if smoke:
        grid = grid[:2]
    results = []
    for tuning in grid:
        try:
            times = [graph_time_us(lambda c=c, t=tuning: int4_moe_cuda(*c, *tensors, GROUP, tuning=t), device, smoke)
                     for c in cases]  # fmt: skip
        except OutOfResources as err:  # a shape whose stages do not fit: skipped, reported
            print(json.dumps({**vars(tuning), "skipped": str(err)[:120]}), flush=True)
            continue
        results.append(
            {**vars(tuning), "T1_us": times[0], "T33_us": times[1], "geomean_us": math.sqrt(times[0] * times[1])}
        )
        print(json.dumps(results[-1]), flush=True)
    best = min(results, key=lambda r: r["geomean_us"])
    return Tuning(**{f: best[f] for f in vars(DEFAULT_TUNING)}), sorted(results, key=lambda r: r["geomean_us"])


def profile(x, ids, weights, tensors, path: Path, smoke: bool, layout: str = "compressed-tensors") -> None:
    """Device time of each kernel the forms launch (20 calls each), as torch.profiler's table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    small = Tuning(32, 128, 8, 2, 8)
    for name, kwargs in ((f"default launch shapes, {layout} layout", {"layout": layout}),
                         ("gate 32 columns, down 128, 8 warps", {"tuning": small, "layout": layout})):  # fmt: skip
        int4_moe_cuda(x, ids, weights, *tensors, GROUP, **kwargs)
        activities = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
        with torch_profile(activities=activities) as prof:
            for _ in range(20):
                int4_moe_cuda(x, ids, weights, *tensors, GROUP, **kwargs)
            if not smoke:
                torch.cuda.synchronize()
        sort = "cpu_time_total" if smoke else "cuda_time_total"
        lines += [f"== {name} (T={x.shape[0]}, 20 calls)", prof.key_averages().table(sort_by=sort, row_limit=12)]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokens", default="1,8,9,16,17,33")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also each kernel's share (torch.profiler) at T 1, 33")
    what = "first time launch shapes at T 1 and 33 (random routing); the table uses the best"
    parser.add_argument("--sweep", action="store_true", help=what)
    parser.add_argument("--sweep-pipeline", action="store_true", help="the same over K-step words and pipeline stages")
    args = parser.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    config = rank_config(smoke)
    tensors, shared, router, width = make_weights(config, device, dtype, gen)
    experts, hidden, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    # bf16 copies of the same experts for torch._grouped_mm (on the CPU it takes bf16 only)
    grouped_dtype = torch.bfloat16
    dense = [dequantize_experts(tensors[i], tensors[i + 1], GROUP).to(grouped_dtype) for i in (0, 2, 4)]
    ceilings = measure_ceilings(smoke)
    expert_bytes = packed_expert_bytes(hidden, width)
    fixed_bytes = 3 * hidden * width * 2 + experts * hidden * 2  # shared expert + router, bf16
    ready, layout = Int4MoEKernel.prepared(tensors, GROUP)
    tuning, sweep = DEFAULT_TUNING, []
    if args.sweep or args.sweep_pipeline:
        tuning, sweep = sweep_tunings(tensors, config, device, dtype, smoke, args.sweep_pipeline)
        print("tuning", tuning, flush=True)
    rows = []
    for kind in ("random", "skewed"):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            ids, weights = routing(kind, tokens, experts, k, gen)
            ids, weights = ids.to(device), weights.to(device)
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            want = int4_moe(x.float(), ids, weights, *[t if t.dtype == torch.int32 else t.float() for t in tensors],
                            GROUP)  # fmt: skip
            got = int4_moe_cuda(x, ids, weights, *tensors, GROUP).float()
            error = float((got - want).norm() / want.norm())
            tuned = int4_moe_cuda(x, ids, weights, *tensors, GROUP, tuning=tuning).float()
            error = max(error, float((tuned - want).norm() / want.norm()))
            fast = int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=tuning, layout=layout).float()
            error = max(error, float((fast - want).norm() / want.norm()))
            if layout == "rows" and tokens == 1:  # the Triton form of one token too, where the CUDA C one ran
                fast = int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=replace(tuning, token_kernel="triton"),
                                     layout=layout).float()  # fmt: skip
                error = max(error, float((fast - want).norm() / want.norm()))
            if layout == "rows":  # the Triton tensor-core form too, where a CUDA C or CUDA-core one ran above
                fast = int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=triton_tensor_cores(tuning),
                                     layout=layout).float()  # fmt: skip
                error = max(error, float((fast - want).norm() / want.norm()))
            if error > 1e-2:
                raise RuntimeError(f"{kind} T={tokens}: kernel relative error {error:.2e} > 1e-2")
            gx = x.to(grouped_dtype)
            grouped_error = float((grouped_bf16(gx, ids, weights, dense).float() - want).norm() / want.norm())

            times = time_forms(x, gx, ids, weights, tensors, shared, router, dense, device, smoke, args.repeats,
                               tuning, ready, layout)  # fmt: skip
            distinct = int(ids.unique().numel())
            floor_bytes = distinct * expert_bytes + fixed_bytes
            floor_us = floor_bytes / ceilings["copy_Bps"] * 1e6
            row = {"routing": kind, "tokens": tokens, "distinct_experts": distinct, "floor_bytes": floor_bytes,
                   "floor_us": floor_us, **times, "layer_over_floor": times["layer_us"] / floor_us,
                   "kernel_relative_error": error, "grouped_bf16_relative_error": grouped_error}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.profile and kind == "random" and tokens in (1, 33):
                profile(x, ids, weights, ready, args.out_dir / f"int4_profile_T{tokens}.txt", smoke, layout)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(smoke), "command": " ".join(sys.argv), "ceilings": ceilings,
              "dims": {"hidden": hidden, "experts": experts, "width": width, "top_k": k, "group": GROUP},
              "layout": layout, "tuning": vars(tuning), "block_form": token_cuda.block_form(), "sweep": sweep,
              "rows": rows}  # fmt: skip
    (args.out_dir / "int4_moe_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
