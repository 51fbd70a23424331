"""TreeAttention on the GPU, in one run: ceilings, correctness, CUDA-graph safety, timings vs floor and vs SDPA.

    PYTHONPATH=. python3 benchmarks/tree_attention_gpu.py OUT_DIR [--variants | --variants-only | --combine-only]

1. Ceilings measured in this run: device-to-device copy bandwidth (bytes read + written) and the bf16 matrix rate
   (8192^3 product on random data); medians of repeats.
2. Every shape T x H x S (plus odd sizes): fresh random bf16 inputs, the output and the cache's spare rows past its
   length (never read) poisoned with NaN before the run, relative error against the torch reference in float64.
3. The kernel captured in a CUDA graph, then replayed after the cache length and the inputs change in place.
4. Median time of the kernel (split + combine), the floor max(bytes / copy rate, flops / matmul rate), the ratio,
   and the same for torch's scaled_dot_product_attention with an explicit boolean mask (keys pre-concatenated).
Writes OUT_DIR/tree_attention.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from plugins.tree_attention.kernel import tree_attention_cuda
from plugins.tree_attention.reference import tree_attention

LATENT, ROPE = 512, 64
SHAPES = [(t, h, s) for t in (1, 8, 33) for h in (8, 16) for s in (0, 1, 127, 4096, 32768, 131072)]
ODD = [(5, 8, 1000), (33, 16, 77777), (17, 8, 4099), (65, 8, 2050)]
TOLERANCE = 1e-2  # bf16 inputs and outputs, fp32 accumulation: expect ~3e-3


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16
    src, dst = torch.randn(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_GBps": 2 * n * 2 / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def tree_mask(tokens: int, gen) -> torch.Tensor:
    mask = torch.eye(tokens, dtype=torch.bool)
    for node in range(1, tokens):
        mask[node] |= mask[int(torch.randint(0, node, (1,), generator=gen))]
    return mask.cuda()


def inputs(tokens, heads, length, seed):
    gen = torch.Generator().manual_seed(seed)
    width = LATENT + ROPE
    q = torch.randn(tokens, heads, width, generator=gen).to("cuda", torch.bfloat16)
    cache = torch.randn(length + 37, width, generator=gen).to("cuda", torch.bfloat16)  # spare capacity
    new_kv = torch.randn(tokens, width, generator=gen).to("cuda", torch.bfloat16)
    return q, cache, torch.tensor([length], device="cuda"), new_kv, tree_mask(tokens, gen)


def relative_error(out, q, cache, length, new_kv, mask, scale):
    ref = tree_attention(q.double(), cache.double(), length, new_kv.double(), mask, scale, LATENT)
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(tokens, heads, length, scale, config=None) -> dict:
    """One shape (and tile configuration, None: the defaults) against the float64 reference: the output and the
    cache's spare rows past the length NaN first (those rows are never read)."""
    q, cache, length_t, new_kv, mask = inputs(tokens, heads, length, seed=tokens * 1000 + heads + length)
    cache[length:] = float("nan")
    out = torch.full((tokens, heads, LATENT), float("nan"), dtype=torch.bfloat16, device="cuda")
    tree_attention_cuda(q, cache, length_t, new_kv, mask, scale, LATENT, out=out, **(config or {}))
    torch.cuda.synchronize()
    return {"nan": bool(out.isnan().any()), "rel_error": relative_error(out, q, cache, length_t, new_kv, mask, scale)}


def graph_check(scale) -> dict:
    """Capture at one cache length, replay after changing length and inputs in place."""
    q, cache, length_t, new_kv, mask = inputs(33, 8, 3000, seed=7)
    out = torch.empty(33, 8, LATENT, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tree_attention_cuda(q, cache, length_t, new_kv, mask, scale, LATENT, out=out)  # warm-up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tree_attention_cuda(q, cache, length_t, new_kv, mask, scale, LATENT, out=out)
    errors = []
    for length in (3000, 17, 2999, 0):
        q2, cache2, _, new2, mask2 = inputs(33, 8, 3000, seed=length + 11)
        q.copy_(q2), cache.copy_(cache2), new_kv.copy_(new2), mask.copy_(mask2), length_t.fill_(length)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errors.append(relative_error(out, q, cache, length_t, new_kv, mask, scale))
    return {"lengths": [3000, 17, 2999, 0], "rel_errors": errors}


def bytes_moved(tokens, heads, length) -> int:
    """The bytes one call reads and writes at least (bf16): the cache, the new rows, the queries and the output."""
    width = LATENT + ROPE
    return 2 * (length * width + tokens * width + tokens * heads * width + tokens * heads * LATENT)


def floor_us(tokens, heads, length, ceil) -> tuple[float, float, float]:
    moved = bytes_moved(tokens, heads, length)
    flops = 2 * tokens * heads * (length + tokens) * (LATENT + ROPE + LATENT)
    t_bytes = moved / (ceil["copy_GBps"] * 1e9) * 1e6
    t_flops = flops / (ceil["bf16_TFLOPs"] * 1e12) * 1e6
    return max(t_bytes, t_flops), moved, flops


def graph_time_us(fn) -> float:
    """Median time of `fn` captured in a CUDA graph (launch overhead excluded), 20 replays per sample."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(20):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / 20


def time_shape(tokens, heads, length, scale, ceil, config=None, with_sdpa=True) -> dict:
    q, cache, length_t, new_kv, mask = inputs(tokens, heads, length, seed=1)
    out = torch.empty(tokens, heads, LATENT, dtype=torch.bfloat16, device="cuda")
    kwargs = config or {}

    def run():
        tree_attention_cuda(q, cache, length_t, new_kv, mask, scale, LATENT, out=out, **kwargs)

    ours = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
    graphed = graph_time_us(run)
    floor, bytes_moved, flops = floor_us(tokens, heads, length, ceil)
    row = {
        "T": tokens,
        "H": heads,
        "S": length,
        "ours_us": ours,
        "graph_us": graphed,
        "floor_us": floor,
        "ratio": graphed / floor,
        "bytes": bytes_moved,
        "flops": flops,
    }
    if not with_sdpa:
        return row
    keys = torch.cat((cache[:length], new_kv))[None, None]  # [1, 1, S + T, 576]
    values = keys[..., :LATENT]
    query = q.transpose(0, 1)[None]  # [1, H, T, 576]
    visible = torch.cat((torch.ones(tokens, length, dtype=torch.bool, device="cuda"), mask), dim=1)
    try:
        sdpa = (
            triton.testing.do_bench(
                lambda: F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
                ),
                warmup=25,
                rep=200,
                return_mode="median",
            )
            * 1e3
        )
        row.update(sdpa_us=sdpa, sdpa_ratio=sdpa / floor, speedup_vs_sdpa=sdpa / graphed)
    except RuntimeError as err:
        row.update(sdpa_us=None, sdpa_error=str(err)[:200])
    return row


WHOLE = dict(whole_blocks=True)
TMA = dict(whole_blocks=True, tma=True)
VARIANTS = {  # shape -> tile configurations tried on it ({}: the defaults); the verify shapes first
    (33, 8, 32768): [{}, WHOLE, TMA],
    (33, 8, 131072): [{}, WHOLE, TMA],
    (1, 8, 32768): [{}, WHOLE, TMA],
    (8, 8, 32768): [{}, WHOLE, TMA],
    (1, 8, 131072): [{}, WHOLE, TMA],
    (33, 16, 32768): [{}, WHOLE, TMA],
    (1, 8, 4096): [{}, WHOLE, TMA],
    (33, 8, 4096): [{}, WHOLE, TMA],
    (512, 8, 8192): [{}, WHOLE, TMA],  # a prefill chunk over a cached prefix (the descriptors not taken by default)
}
TILES = {  # other tiles at the verify shape, with and without tensor descriptors
    (33, 8, 32768): [dict(block_m=64, block_n=64, num_warps=8, num_stages=2, **extra) for extra in ({}, TMA)]
    + [
        dict(block_m=64, block_n=32, num_warps=8, num_stages=3, **TMA),
        dict(block_m=32, block_n=32, num_warps=4, num_stages=3, **TMA),
        dict(block_m=32, block_n=64, num_warps=8, num_stages=2, **TMA),
    ],
}

# every product keys-major (config "keys_major": scores = keys x queries, the output accumulated transposed), so a
# 64-key block is the M = 64 of Hopper's wgmma however few query rows a tile has, its whole blocks by pointers or by
# tensor descriptors; beside the default in the same run
# (tiles whose compiled shared memory fits a Hopper block, `benchmarks/kernel_resources.py`: three stages of 32-row
# tiles take 256 KB)
KEYS_MAJOR = {
    shape: [{}]
    + [dict(keys_major=True, block_m=m, block_n=64, num_warps=w, num_stages=2, **extra)
       for m, w in ((32, 4), (32, 8)) for extra in ({}, WHOLE)]
    + [dict(keys_major=True, block_m=m, block_n=64, num_warps=w, num_stages=2, **TMA)
       for m, w in ((32, 4), (32, 8), (16, 4))]
    + [dict(keys_major=True, block_m=m, block_n=64, num_warps=w, num_stages=2, **WHOLE) for m, w in ((16, 4), (64, 8))]
    for shape in ((33, 8, 32768), (33, 8, 131072), (8, 8, 32768), (1, 8, 32768))
}  # fmt: skip

# the merge of the splits' partial results where a launch has few query rows (a decode: T = 1 or 8 at 8 heads, up to
# 256 splits over a long cache): columns a merge program takes (fewer: more programs), splits it loads at a time, and
# fewer splits (less to write and merge, fewer programs in the split kernel)
COMBINE = {
    shape: [{}]
    + [dict(combine_columns=c, split_group=g) for c in (128, 64, 32) for g in (16, 32, 64) if (c, g) != (128, 16)]
    + [dict(splits=n) for n in (64, 128)]
    for shape in ((1, 8, 131072), (1, 8, 32768), (8, 8, 131072), (8, 8, 32768), (1, 16, 131072))
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--variants", action="store_true", help="also time other tile configurations")
    parser.add_argument("--variants-only", action="store_true", help="only the tile configurations (no table)")
    parser.add_argument("--combine-only", action="store_true", help="only the merge's configurations at few rows")
    parser.add_argument("--keys-major-only", action="store_true", help="only the keys-major forms, the default beside")
    args = parser.parse_args(argv)
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    scale = (192**-0.5) * (0.1 * 4.1588830833596715 + 1.0) ** 2  # Kimi: qk 192, yarn mscale(64)^2
    started = time.time()
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    variants = []
    only = args.variants_only or args.combine_only or args.keys_major_only
    if args.variants or only:
        tried = [*VARIANTS.items(), *TILES.items()]
        tried = COMBINE.items() if args.combine_only else KEYS_MAJOR.items() if args.keys_major_only else tried
        for shape, configs in tried:
            for config in configs:
                try:
                    checked = check(*shape, scale, config)
                    error = float("nan") if checked["nan"] else checked["rel_error"]
                    row = time_shape(*shape, scale, ceil, config, with_sdpa=False)
                    variants.append({"shape": shape, **config, "graph_us": row["graph_us"], "ratio": row["ratio"],
                                     "rel_error": error})  # fmt: skip
                    print(f"variant {shape} {config}: {row['graph_us']:.1f} us ({row['ratio']:.2f}x floor), "
                          f"error {error:.1e}", flush=True)  # fmt: skip
                except Exception as err:  # a config that does not compile (shared memory) is reported, not fatal
                    variants.append({"shape": shape, **config, "error": str(err)[:200]})
                    print(f"variant {shape} {config}: FAILED {str(err)[:120]}", flush=True)
                if only:  # after each: what is measured so far, if the run is cut
                    (out_dir / "tree_attention_variants.json").write_text(
                        json.dumps({"ceilings": ceil, "variants": variants})
                    )
    if only:
        return 0
    checks = {f"{t}x{h}x{s}": check(t, h, s, scale) for t, h, s in SHAPES + ODD}
    graph = graph_check(scale)
    timings = [time_shape(t, h, s, scale, ceil) for t, h, s in SHAPES + ODD if s > 0]
    worst = max(c["rel_error"] for c in checks.values())
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "ceilings": ceil,
        "checks": checks,
        "graph": graph,
        "timings": timings,
        "variants": variants,
        "tolerance": TOLERANCE,
        "seconds": time.time() - started,
    }
    (out_dir / "tree_attention.json").write_text(json.dumps(result, indent=1))
    print(
        f"\ncorrectness: {len(checks)} shapes, worst rel error {worst:.2e} (tolerance {TOLERANCE}), "
        f"NaN: {any(c['nan'] for c in checks.values())}; graph replays: {[f'{e:.1e}' for e in graph['rel_errors']]}"
    )
    print(
        "\n| T | H | S | ours, graph (us) | ours, eager (us) | floor (us) | ours/floor | SDPA (us) | SDPA/floor "
        "| speedup vs SDPA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in timings:
        sdpa = (
            f"{r['sdpa_us']:.1f} | {r['sdpa_ratio']:.2f} | {r['speedup_vs_sdpa']:.2f}"
            if r.get("sdpa_us")
            else "n/a | | "
        )
        print(
            f"| {r['T']} | {r['H']} | {r['S']} | {r['graph_us']:.1f} | {r['ours_us']:.1f} | {r['floor_us']:.1f} "
            f"| {r['ratio']:.2f} | {sdpa} |"
        )
    ok = worst < TOLERANCE and not any(c["nan"] for c in checks.values()) and max(graph["rel_errors"]) < TOLERANCE
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
