"""Export form: `ddtree::Int4MoE` in the ONNX graph (TorchScript exporter), carrying the packed weights as its
inputs (int32 initializers), so graphs and engines hold the experts at 4 bits. Attribute: `group_size` (int)."""

from __future__ import annotations

import torch

from plugins.int4_moe.reference import int4_moe


class Int4MoEOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size: int):
        return int4_moe(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size)

    @staticmethod
    def symbolic(g, x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size):
        out = g.op(
            "ddtree::Int4MoE", x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size_i=group_size
        )
        out.setType(x.type())
        return out


def export_int4_moe(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size: int):
    return Int4MoEOp.apply(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size)
