"""The TensorRT plugins' `enqueue` bodies on a GPU, without TensorRT (none is installable on the GPU machines this
project is tested on).

    mpirun -np 2 python3 benchmarks/plugin_enqueue_gpu.py [--out DIR]     (OMPI_ALLOW_RUN_AS_ROOT=1 ... as root)

TensorRT hands `enqueue` tensor descriptors (`.type`, `.dims`), raw device pointers and a stream handle. This
script builds exactly those from torch tensors and calls each plugin's enqueue on a side stream: TreeAttention
(bf16, against the torch reference), AllReduce and AllGather (NCCL over the MPI ranks), and Int4MoE at Kimi K2.x's
per-rank TP-8 dimensions (384 experts, hidden 7168, width 256, groups of 32, top-8; bf16) with the words in the
checkpoint's order (`rows` = 0) and in the rows layout exported graphs carry where it fits (`rows` = 1), each
against the float32 reference at T = 1, 8 and 33. It also captures the TreeAttention and the Int4MoE (rows, T = 33)
enqueues in a CUDA graph, as TensorRT does under graph capture, and rank 0 times each Int4MoE form by CUDA-graph
replay with the L2 left clean (`--out DIR`: DIR/plugin_enqueue_gpu.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from plugins.collectives.trt_plugin import _AllGatherSpec, _AllReduceSpec
from plugins.tree_attention.reference import tree_attention
from plugins.tree_attention.trt_plugin import _Spec as TreeAttentionSpec

_TYPES = {torch.bfloat16: "DataType.BF16", torch.float32: "DataType.FLOAT", torch.int64: "DataType.INT64",
          torch.int32: "DataType.INT32", torch.bool: "DataType.BOOL"}  # fmt: skip


def desc(tensor: torch.Tensor):
    return SimpleNamespace(type=_TYPES[tensor.dtype], dims=tuple(tensor.shape))


def enqueue(spec, fields: dict, inputs: list[torch.Tensor], output: torch.Tensor, stream: torch.cuda.Stream):
    plugin = SimpleNamespace(fields=fields)
    spec.enqueue(plugin, [desc(t) for t in inputs], [desc(output)], [t.data_ptr() for t in inputs],
                 [output.data_ptr()], 0, stream.cuda_stream)  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the Int4MoE rows (rank 0) to DIR/plugin_enqueue_gpu.json")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from runner.nccl import init_nccl

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if world > 1:
        init_nccl(comm, device)
    fake_trt = SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16", int64="i64", bool="b")
    stream = torch.cuda.Stream(device)
    ok = True

    gen = torch.Generator(device=device).manual_seed(rank)
    tokens, heads, length = 33, 8, 5000
    q = torch.randn(tokens, heads, 576, generator=gen, device=device).to(torch.bfloat16)
    cache = torch.randn(length + 100, 576, generator=gen, device=device).to(torch.bfloat16)
    new_kv = torch.randn(tokens, 576, generator=gen, device=device).to(torch.bfloat16)
    mask = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    cache_length = torch.tensor([length], device=device)
    out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device=device)
    fields = {"scale": 0.1, "latent_dim": 512}
    inputs = [q, cache, cache_length, new_kv, mask]
    enqueue(TreeAttentionSpec(fake_trt), fields, inputs, out, stream)
    stream.synchronize()
    ref = tree_attention(q.double(), cache.double(), cache_length, new_kv.double(), mask, 0.1, 512)
    error = float((out.double() - ref).norm() / ref.norm())
    ok &= error < 1e-2 and not out.isnan().any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        enqueue(TreeAttentionSpec(fake_trt), fields, inputs, out, stream)
    cache_length.fill_(1234)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = tree_attention(q.double(), cache.double(), cache_length, new_kv.double(), mask, 0.1, 512)
    graph_error = float((out.double() - ref).norm() / ref.norm())
    ok &= graph_error < 1e-2

    x = torch.full((4, 7), float(rank + 1), dtype=torch.bfloat16, device=device)
    reduced = x.clone()  # one rank: no NCCL group, the collectives are not run (their sums are the inputs)
    logits = torch.full((3, 5), float(rank), dtype=torch.float32, device=device)
    gathered = logits.clone()
    if world > 1:
        enqueue(_AllReduceSpec(fake_trt), {}, [x], reduced, stream)
        gathered = torch.empty(3, 5 * world, dtype=torch.float32, device=device)
        enqueue(_AllGatherSpec(fake_trt), {"world_size": world}, [logits], gathered, stream)
    stream.synchronize()
    ok &= bool((reduced == world * (world + 1) / 2).all())
    ok &= all(bool((gathered[:, r * 5 : (r + 1) * 5] == r).all()) for r in range(world))
    collectives = (f"AllReduce sum {reduced[0, 0].item()} (want {world * (world + 1) / 2}); AllGather slices "
                   f"{[gathered[0, r * 5].item() for r in range(world)]}" if world > 1
                   else "AllReduce and AllGather not run (one rank)")  # fmt: skip
    print(f"[rank {rank}] TreeAttention enqueue rel error {error:.1e}, under CUDA-graph replay {graph_error:.1e}; "
          f"{collectives}: {'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    int4_ok, rows = int4_moe_enqueue(fake_trt, device, stream, timed=rank == 0)
    print(f"[rank {rank}] Int4MoE enqueue: {json.dumps(rows)}: {'PASS' if int4_ok else 'FAIL'}", flush=True)
    if rank == 0 and args.out is not None:
        from benchmarks.common import environment

        args.out.mkdir(parents=True, exist_ok=True)
        info = {**environment(False), "command": " ".join(sys.argv), "ranks": world, "int4_moe": rows}
        (args.out / "plugin_enqueue_gpu.json").write_text(json.dumps(info, indent=1) + "\n")
    ok &= int4_ok
    return 0 if comm.allreduce(int(ok), op=MPI.MIN) else 1


def int4_moe_enqueue(fake_trt, device, stream, timed: bool) -> tuple[bool, list[dict]]:
    """The Int4MoE plugin's enqueue at Kimi's per-rank dimensions, both word layouts, T = 1, 8, 33: relative error
    against the float32 reference, the rows form's output under CUDA-graph replay at T = 33, and (`timed`) each
    form's time by CUDA-graph replay with the L2 left clean."""
    from benchmarks.common import graph_time_us
    from plugins.int4_moe.kernel import repack_rows
    from plugins.int4_moe.reference import int4_moe
    from plugins.int4_moe.trt_plugin import _Spec as Int4MoESpec

    experts, hidden, width, group, top_k = 384, 7168, 256, 32, 8
    gen = torch.Generator(device=device).manual_seed(7)

    def words(rows, cols):
        return torch.randint(-(2**31), 2**31 - 1, (experts, rows, cols // 8), generator=gen, device=device,
                             dtype=torch.int32)  # fmt: skip

    def scales(rows, cols):
        return (torch.rand(experts, rows, cols // group, generator=gen, device=device) * 0.02).to(torch.bfloat16)

    checkpoint = [words(width, hidden), scales(width, hidden), words(width, hidden), scales(width, hidden),
                  words(hidden, width), scales(hidden, width)]  # fmt: skip
    layouts = {0: checkpoint, 1: [repack_rows(t) if i % 2 == 0 else t for i, t in enumerate(checkpoint)]}
    spec, ok, rows = Int4MoESpec(fake_trt), True, []
    for tokens in (1, 8, 33):
        x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, generator=gen, device=device).softmax(-1)
        want = int4_moe(x.float(), ids, weights, *[t if t.dtype == torch.int32 else t.float() for t in checkpoint],
                        group)  # fmt: skip
        for rows_layout, experts_words in layouts.items():
            fields = {"group_size": group, "rows": rows_layout}
            inputs = [x, ids, weights, *experts_words]
            out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)
            enqueue(spec, fields, inputs, out, stream)
            stream.synchronize()
            row = {"tokens": tokens, "rows": rows_layout, "relative_error": float((out.float() - want).norm()
                                                                                / want.norm())}  # fmt: skip
            ok &= row["relative_error"] < 1e-2
            if rows_layout and tokens == 33:  # under graph capture, as TensorRT captures it; replayed on new x
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    enqueue(spec, fields, inputs, out, stream)
                x.copy_(torch.randn(tokens, hidden, generator=gen, device=device))
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                again = int4_moe(x.float(), ids, weights, *[t if t.dtype == torch.int32 else t.float()
                                                            for t in checkpoint], group)  # fmt: skip
                row["graph_relative_error"] = float((out.float() - again).norm() / again.norm())
                ok &= row["graph_relative_error"] < 1e-2
            if timed:

                def call(i=inputs, f=fields, o=out):  # on the stream being captured, as TensorRT's
                    enqueue(spec, f, i, o, torch.cuda.current_stream())

                row["enqueue_us"] = graph_time_us(call, device, False, flush="read")
            rows.append(row)
    return ok, rows


if __name__ == "__main__":
    sys.exit(main())
