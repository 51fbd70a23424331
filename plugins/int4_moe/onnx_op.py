"""Export form: `ddtree::Int4MoE` in the ONNX graph (TorchScript exporter), carrying the packed weights as its
inputs (int32 initializers), so graphs and engines hold the experts at 4 bits. Attributes: `group_size` (int) and
`rows` (int: 1 when the words are in the "rows" layout, `kernel.repack_rows`; 0 for the checkpoint's own order).

`export_int4_moe` is what `ModelOps.int4_moe` holds for an export: its `prepare_experts` (called once at load by
`models.moe.PackedMoE`) reorders the words into the rows layout where the dimensions allow, as the torch backend's
GPU kernel does, so the TensorRT plugin runs the GPU kernels' fastest forms on the engine's own constants."""

from __future__ import annotations

import torch

from plugins.int4_moe.reference import check_layout, int4_moe


class Int4MoEOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size: int, rows: int):
        layout = "rows" if rows else "compressed-tensors"
        return int4_moe(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size, layout)

    @staticmethod
    def symbolic(g, x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size, rows):
        out = g.op(
            "ddtree::Int4MoE",
            x,
            ids,
            weights,
            gate_p,
            gate_s,
            up_p,
            up_s,
            down_p,
            down_s,
            group_size_i=group_size,
            rows_i=rows,
        )
        out.setType(x.type())
        return out


class ExportInt4MoE:
    """`ModelOps.int4_moe` for an export: the op in the graph, the experts' words in the rows layout where it fits."""

    def __call__(self, x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size: int,
                 layout: str = "compressed-tensors") -> torch.Tensor:  # fmt: skip
        check_layout(layout)
        rows = int(layout == "rows")
        return Int4MoEOp.apply(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size, rows)

    @staticmethod
    def prepare_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group_size: int):
        from plugins.int4_moe.kernel import Int4MoEKernel

        return Int4MoEKernel.prepare_experts(gate, up, down, group_size)


export_int4_moe = ExportInt4MoE()
