"""Export form of the collectives: `ddtree::AllReduce` and `ddtree::AllGather{world_size}`.

During tracing the forward only has to produce the right shapes; the graph node does the communication at run
time (ONNX Runtime: mpi4py, `ort_op.py`; TensorRT: NCCL, `trt_plugin.py`).
"""

from __future__ import annotations

import torch


class AllReduceOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def symbolic(g, x):
        out = g.op("ddtree::AllReduce", x)
        out.setType(x.type())
        return out


class AllGatherOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world_size: int):
        return torch.cat([x] * world_size, dim=-1)

    @staticmethod
    def symbolic(g, x, world_size):
        out = g.op("ddtree::AllGather", x, world_size_i=world_size)
        sizes = x.type().varyingSizes()
        if sizes is not None and sizes[-1] is not None:
            out.setType(x.type().with_sizes([*sizes[:-1], sizes[-1] * world_size]))
        return out


class ExportCollectives:
    """What the per-rank modules call while being exported."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return AllReduceOp.apply(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return AllGatherOp.apply(x, self.world_size)
