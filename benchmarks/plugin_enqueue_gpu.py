"""The TensorRT plugins' `enqueue` bodies on a GPU, without TensorRT (none is installable on the lent machines).

    mpirun -np 2 python3 benchmarks/plugin_enqueue_gpu.py      (OMPI_ALLOW_RUN_AS_ROOT=1 ... as root)

TensorRT hands `enqueue` tensor descriptors (`.type`, `.dims`), raw device pointers and a stream handle. This
script builds exactly those from torch tensors and calls each plugin's enqueue on a side stream: TreeAttention
(bf16, against the torch reference), AllReduce and AllGather (NCCL over the MPI ranks). It also captures the
TreeAttention enqueue in a CUDA graph, as TensorRT does under graph capture.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

from plugins.collectives.trt_plugin import _AllGatherSpec, _AllReduceSpec
from plugins.tree_attention.reference import tree_attention
from plugins.tree_attention.trt_plugin import _Spec as TreeAttentionSpec

_TYPES = {torch.bfloat16: "DataType.BF16", torch.float32: "DataType.FLOAT", torch.int64: "DataType.INT64",
          torch.bool: "DataType.BOOL"}  # fmt: skip


def desc(tensor: torch.Tensor):
    return SimpleNamespace(type=_TYPES[tensor.dtype], dims=tuple(tensor.shape))


def enqueue(spec, fields: dict, inputs: list[torch.Tensor], output: torch.Tensor, stream: torch.cuda.Stream):
    plugin = SimpleNamespace(fields=fields)
    spec.enqueue(plugin, [desc(t) for t in inputs], [desc(output)], [t.data_ptr() for t in inputs],
                 [output.data_ptr()], 0, stream.cuda_stream)  # fmt: skip


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no flags: any is an error
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
    reduced = torch.empty_like(x)
    enqueue(_AllReduceSpec(fake_trt), {}, [x], reduced, stream)
    logits = torch.full((3, 5), float(rank), dtype=torch.float32, device=device)
    gathered = torch.empty(3, 5 * world, dtype=torch.float32, device=device)
    enqueue(_AllGatherSpec(fake_trt), {"world_size": world}, [logits], gathered, stream)
    stream.synchronize()
    ok &= bool((reduced == world * (world + 1) / 2).all())
    ok &= all(bool((gathered[:, r * 5 : (r + 1) * 5] == r).all()) for r in range(world))
    print(f"[rank {rank}] TreeAttention enqueue rel error {error:.1e}, under CUDA-graph replay {graph_error:.1e}; "
          f"AllReduce sum {reduced[0, 0].item()} (want {world * (world + 1) / 2}); AllGather slices "
          f"{[gathered[0, r * 5].item() for r in range(world)]}: {'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return 0 if comm.allreduce(int(ok), op=MPI.MIN) else 1


if __name__ == "__main__":
    sys.exit(main())
