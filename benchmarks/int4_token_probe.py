"""Launch shapes of the INT4 one-token CUDA C kernels (`plugins/int4_moe/token_cuda.py`) at Kimi K2.x per-rank TP-8
dimensions on one GPU: each gate/up and down form timed alone and the pair in a sequence, with its registers.

    PYTHONPATH=. python3 benchmarks/int4_token_probe.py OUT_DIR [--repeats 3] [--block-only | --token-only]
        [--diagnostics]
        [--compile REPEATS]

Forms: `split` (`gate_up_split`, a warp a 16-byte chunk of RPB row pairs, SPLIT_MIN_BLOCKS: blocks an SM the
compiler keeps registers for; then `down`, ROWS output rows a warp, WARPS warps a block) and `mma` (`gate_up_mma` with
KSPLIT warps over a row tile's 16-word steps, then `down_mma`: tensor cores). (Earlier runs of this script also timed
a warp-a-row-pair form and a one-launch form, since removed: `results/int4_token_probe_h100*.json`.)
Each is checked against the torch reference through the pair of launches (relative error < 1e-2), then timed by
CUDA-graph replay with the L2 left clean (`benchmarks.common.graph_time_us(flush="read")`), and 8 calls over other
experts back to back in one graph (a call's share: as inside a forward), and by the profiler (kernel time alone).
The byte floor: the bytes each kernel reads at the copy rate of this run. Then the block form (`int4_moe_block`: 8
and 33 tokens, random and skewed routing) at `BLOCK_SHAPES` beside the Triton tensor-core form (`block_rows`; with
`--diagnostics`, the bulk gate/up form copying only and multiplying only). With `--compile N`, the time NVRTC takes to
compile every kernel at first use: one compile of the source for all names against one a name (`compile_s`).
Writes OUT_DIR/int4_token_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, graph_time_us, measure_ceilings  # noqa: E402
from benchmarks.int4_moe_gpu import GROUP, make_weights, rank_config, routing  # noqa: E402
from plugins.int4_moe import token_cuda  # noqa: E402
from plugins.int4_moe.kernel import Int4MoEKernel  # noqa: E402
from plugins.int4_moe.reference import int4_moe  # noqa: E402

VARIANTS = 8
# the block form's launch shapes timed: (gate/up form, down form, constants); the first is the forms before streaming,
# the second what runs (runs of tiles even in work), the third the bulk form's tiles from a queue instead
BLOCK_SHAPES = (
    ("tiles", "tiles", {}),
    ("bulk", "stream", {}),
    ("bulk", "stream", {"BALANCE": 0}),
)
# where the bulk-copy gate/up kernel's time goes: its source changed so that it only copies (the column passes never
# run) or only multiplies (no copies past the first tiles: the sums are wrong, the time is the passes'); timed, not
# checked
DIAGNOSTICS = {
    "gate/up copies only": ("bulk", (
        ("        gate_up_columns<PARTS>(gw, uw, sg, su, x, token, first, pairs, tile, part, act, pass);\n    };",
         "        if (pairs < 0) gate_up_columns<PARTS>(gw, uw, sg, su, x, token, first, pairs, tile, part, act, pass);"
         "\n        else __syncthreads();\n    };"),
    )),
    "gate/up multiplies only": ("bulk", (  # every stage's phase completed by the arrival alone, nothing copied
        ('"r"(16 * (WORDS_IN * 4 + (HIDDEN / GROUP) * 2))', '"r"(0)'),
        ("        if (kind < 2)\n            bulk_copy(", "        if (kind < 0)\n            bulk_copy("),
        ("        else\n            bulk_copy(", "        else if (kind < 0)\n            bulk_copy("),
    )),
}  # fmt: skip


def attributes(kernel) -> dict:
    """Registers a thread and local (spilled) bytes of a compiled kernel."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    out = {}
    for name, attr in (("registers", 4), ("local_bytes", 3)):
        value = ctypes.c_int()
        lib.cuFuncGetAttribute(ctypes.byref(value), attr, kernel.func)
        out[name] = value.value
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-only", action="store_true", help="only the block form's shapes (`block_rows`)")
    parser.add_argument("--token-only", action="store_true", help="only the one-token forms (no `block_rows`)")
    parser.add_argument("--diagnostics", action="store_true", help="also the bulk gate/up form's `DIAGNOSTICS`")
    parser.add_argument("--compile", type=int, default=0, metavar="REPEATS",
                        help="also time compiling the kernels, the median of REPEATS (`compile_s`)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(False)
    config = rank_config(False)
    gen = torch.Generator().manual_seed(0)
    tensors, _, _, width = make_weights(config, device, dtype, gen)
    ready, layout = Int4MoEKernel.prepared(tensors, GROUP)
    assert layout == "rows"
    hidden, experts, k = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    calls = []
    for _ in range(VARIANTS):
        ids, weights = routing("random", 1, experts, k, gen)
        x = torch.randn(1, hidden, generator=gen).to(device, dtype)
        calls.append((x, ids.reshape(-1).to(device), weights.reshape(-1).to(device, torch.float32)))
    act = torch.empty(k, width, dtype=dtype, device=device)
    out = torch.empty(1, hidden, dtype=dtype, device=device)
    x0, ids0, w0 = calls[0]
    want = int4_moe(x0.float(), ids0[None], w0[None], *[t if t.dtype == torch.int32 else t.float() for t in tensors],
                    GROUP)  # fmt: skip
    words_in, words_w = hidden // 8, width // 8
    gate_bytes = k * 2 * width * (words_in * 4 + hidden // GROUP * 2)
    down_bytes = k * hidden * (words_w * 4 + width // GROUP * 2)
    copy = ceilings["copy_Bps"]
    info = {**environment(False), "command": " ".join(sys.argv), "copy_GBps": copy / 1e9, "rows": [],
            "gate_up_floor_us": gate_bytes / copy * 1e6, "down_floor_us": down_bytes / copy * 1e6}  # fmt: skip
    print(f"copy {copy / 1e9:.0f} GB/s; floors: gate/up {info['gate_up_floor_us']:.1f} us, down "
          f"{info['down_floor_us']:.1f} us", flush=True)  # fmt: skip
    if args.compile:
        info["compile_s"] = compile_seconds(hidden, width, k, args.compile)
        print(json.dumps({"compile_s": info["compile_s"]}), flush=True)
    split = "split"
    shapes = [(split, {"RPB": 4, "ROWS": 4, "SPLIT_MIN_BLOCKS": 2}), ("bulk", {}), ("bulk", {"TB_MATH": 0})]
    shapes += [("bulk", {"TB_ROWS": 1}), ("bulk", {"TB_ROWS": 4}), ("mma", {})]
    shapes = [] if args.block_only else shapes
    split_out = None  # the split form's output for calls[0]: the one-launch form must give the same bits
    for form, overrides in shapes:
        defines, compiled = token_cuda.kernels(device, hidden, width, GROUP, k, ids0.dtype, **overrides)
        mma, bulk = form == "mma", form == "bulk"
        gate_name, down_name = ("gate_up_mma", "down_mma") if mma else ("gate_up_split", "down")
        if bulk:
            gate_name = down_name = "token_bulk"
        row = {"gate_form": form, **overrides, "gate_regs": attributes(compiled[gate_name]),
               "down_regs": attributes(compiled[down_name])}  # fmt: skip
        if bulk:
            row["fits"] = token_cuda.token_bulk_fits(defines, device, *ready)
            row["shared_bytes"] = token_cuda._token_bulk_bytes(
                defines, torch.cuda.get_device_properties(device).multi_processor_count
            )

        def both(c, form=form, overrides=overrides):
            token_cuda.launch(c[0], c[1], c[2], *ready, act, out, GROUP, gate_form=form, **overrides)

        out.fill_(float("nan"))
        both(calls[0])
        torch.cuda.synchronize()
        row["relative_error"] = float((out.float() - want).norm() / want.norm())
        if form == split and split_out is None:
            split_out = out.clone()
        elif split_out is not None and not mma:
            row["equal_to_split"] = bool(torch.equal(out, split_out))
        row["kernel_us"] = kernel_time_us(lambda: both(calls[0]))
        if overrides.get("TB_MATH") == 0:  # copies and the wait only: timed, its output not written
            row["relative_error"] = None
        elif row["relative_error"] > 1e-2:  # wrong: recorded, not timed
            row["wrong"] = True
            info["rows"].append(row)
            print(json.dumps(row), flush=True)
            continue
        times = {
            "pair_us": lambda: both(calls[0]),
            "sequence_us": lambda: [both(c) for c in calls],
        }
        for name, fn in times.items():
            t = statistics.median(graph_time_us(fn, device, False, flush="read") for _ in range(args.repeats))
            row[name] = t / (VARIANTS if name == "sequence_us" else 1)
        # each kernel alone: the gate/up launch, and the down launch over the act it left
        gate = lambda g=compiled["gate_up_split"], d=defines: _gate(g, d, calls[0], ready, act, k, width)  # noqa: E731
        down = lambda g=compiled["down"], d=defines: _down(g, d, calls[0], ready, act, out, hidden)  # noqa: E731
        for name, fn in (("gate_us", gate), ("down_us", down)) if form == split else ():
            row[name] = statistics.median(graph_time_us(fn, device, False, flush="read") for _ in range(args.repeats))
        info["rows"].append(row)
        print(json.dumps(row), flush=True)
    info["block_rows"] = [] if args.token_only else block_rows(tensors, ready, hidden, experts, k, gen, device, dtype,
                                                                args.repeats, args.diagnostics)  # fmt: skip
    (args.out_dir / "int4_token_probe.json").write_text(json.dumps(info, indent=1) + "\n")
    return 1 if any(r.get("wrong") for r in info["rows"] + info["block_rows"]) else 0


def compile_seconds(hidden: int, width: int, k: int, repeats: int) -> dict:
    """Median seconds to compile every kernel a process uses at these dimensions (the one-token and the block forms)
    as `token_cuda.kernels` does at first use: one NVRTC compile of the source a set of names ("together") against one
    a name ("one_a_name"), each a fresh compile (nothing cached)."""
    import time

    source = token_cuda.kernel_source(token_cuda._defines(hidden, width, GROUP, k, torch.int32))
    major, minor = torch.cuda.get_device_capability()
    out = {"kernels": len(token_cuda.TOKEN_KERNELS) + len(token_cuda.BLOCK_KERNELS)}
    token_cuda.compile_source(source, ("sum_pairs",), f"{major}{minor}")  # NVRTC and the driver loaded first
    for name, together in (("together", True), ("one_a_name", False)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for names in (token_cuda.TOKEN_KERNELS, token_cuda.BLOCK_KERNELS):
                token_cuda.compile_source(source, names, f"{major}{minor}", together=together)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def block_rows(tensors, ready, hidden, experts, k, gen, device, dtype, repeats: int, diagnostics: bool) -> list[dict]:
    """The block form (`token_cuda.int4_moe_block`, the routing launch included) at T = 8 and 33, random and skewed
    routing (`benchmarks.int4_moe_gpu.routing`),
    at each of `BLOCK_SHAPES` (the gate/up and down forms, their stages and warps) beside the Triton tensor-core form
    (`rows_triton`); each checked against the reference, then timed by CUDA-graph replay with the L2 left clean, and
    each of its kernels by the profiler."""
    from benchmarks.int4_moe_gpu import triton_tensor_cores
    from plugins.int4_moe.kernel import DEFAULT_TUNING, int4_moe_cuda, route

    rows = []
    triton = triton_tensor_cores(DEFAULT_TUNING)
    for kind, tokens in (("random", 8), ("random", 33), ("skewed", 8), ("skewed", 33)):
        ids, weights = routing(kind, tokens, experts, k, gen)
        ids, weights = ids.to(device), weights.to(device)
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        want = int4_moe(x.float(), ids, weights, *[t if t.dtype == torch.int32 else t.float() for t in tensors],
                        GROUP)  # fmt: skip
        call = (x, ids, weights)
        forms = {"rows_triton": lambda c=call: int4_moe_cuda(*c, *ready, GROUP, tuning=triton, layout="rows")}
        for gate, down, shape in BLOCK_SHAPES:
            o = {"gate": gate, "down": down, **shape}
            name = f"block gate {gate} down {down}" + "".join(f" {k} {v}" for k, v in shape.items())
            forms[name] = lambda c=call, o=o: token_cuda.int4_moe_block(c[0], route(c[1], experts), c[2], *ready,
                                                                        GROUP, **o)  # fmt: skip
        for name, (gate, changes) in DIAGNOSTICS.items() if diagnostics and kind == "random" else ():
            source = token_cuda.SOURCE
            for before, after in changes:
                assert token_cuda.SOURCE.count(before) == 1, before
                token_cuda.SOURCE = token_cuda.SOURCE.replace(before, after)
            try:  # compiled now, under a key of its own (DIAG), and kept for the timed calls
                shape = {"DIAG": len(name), "gate": gate}
                token_cuda.int4_moe_block(x, route(ids, experts), weights, *ready, GROUP, **shape)
            finally:
                token_cuda.SOURCE = source

            def fn(c=call, o=shape):
                return token_cuda.int4_moe_block(c[0], route(c[1], experts), c[2], *ready, GROUP, **o)

            timed = [graph_time_us(fn, device, False, flush="read") for _ in range(repeats)]
            row = {"routing": kind, "tokens": tokens, "form": name, "diagnostic": True,
                   "kernels_us": kernel_times_us(fn), "graph_us": statistics.median(timed)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        for name, fn in forms.items():
            got = fn().float()
            row = {"routing": kind, "tokens": tokens, "form": name, "distinct_experts": int(ids.unique().numel()),
                   "relative_error": float((got - want).norm() / want.norm())}  # fmt: skip
            if row["relative_error"] < 1e-2:
                row["graph_us"] = statistics.median(graph_time_us(fn, device, False, flush="read")
                                                    for _ in range(repeats))  # fmt: skip
                row["kernels_us"] = kernel_times_us(fn)
            else:
                row["wrong"] = True
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _profiled(fn, calls: int):
    """The profiler's CUDA events of `calls` calls of fn, the L2 left clean before each (a 256 MB read) and the GPU
    kept busy while the next call is launched."""
    from torch.profiler import ProfilerActivity, profile

    buffer = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            buffer.max()
            torch.cuda._sleep(20000)
            fn()
        torch.cuda.synchronize()
    return prof.events()


def kernel_times_us(fn, calls: int = 20) -> dict:
    """{kernel name: median over `calls` of its GPU time a call (the profiler's durations, summed a call)}, the L2
    left clean before each call."""
    from collections import defaultdict

    times = defaultdict(list)
    for e in _profiled(fn, calls):
        if e.device_time > 0 and "max" not in e.name and "sleep" not in e.name.lower():
            times[e.name[:40]].append(e.device_time)
    return {name: statistics.median(t) * len(t) / calls for name, t in times.items()}


def kernel_time_us(fn, calls: int = 20) -> float:
    """Median over `calls` of the GPU time of fn's kernels alone (the profiler's kernel durations, summed a call;
    no launch), the L2 left clean before each call."""
    names = ("gate_up_split", "down", "gate_up_mma", "down_mma", "token_bulk")
    times = [e.device_time for e in _profiled(fn, calls) if e.device_time > 0 and e.name in names]
    per_call = len(times) // calls
    sums = [sum(times[i * per_call : (i + 1) * per_call]) for i in range(calls)]
    return statistics.median(sums) if sums else float("nan")


def _gate(kernel, defines, call, ready, act, k, width):
    x, ids, _ = call
    args = [x, ids, ready[0], ready[1], ready[2], ready[3], act, ready[0].stride(0), ready[0].stride(1),
            ready[1].stride(0), ready[1].stride(1)]  # fmt: skip
    kernel(grid=(k * width // defines["RPB"], 1, 1), block=(32 * defines["CHUNKS"], 1, 1), args=args)


def _down(kernel, defines, call, ready, act, out, hidden):
    _, ids, weights = call
    rows = defines["WARPS"] * defines["ROWS"]
    kernel(grid=(-(-hidden // rows), 1, 1), block=(32 * defines["WARPS"], 1, 1),
           args=[act, ids, weights, ready[4], ready[5], out, ready[4].stride(0), ready[4].stride(1), ready[5].stride(0),
                 ready[5].stride(1)])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
