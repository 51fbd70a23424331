"""ONNX Runtime (CPU) implementation of `ddtree::Int4MoE`, through onnxruntime-extensions' Python ops: a second,
numpy implementation of the contract in `reference.py` (tested against it). Importing this module registers the op
for the whole process."""

from __future__ import annotations

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, onnx_op

from plugins import ort_pyop

ort_pyop.install()  # outputs handed back as arrays, not lists

_F, _I32, _I64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64


def dequantize_numpy(packed: np.ndarray, scale: np.ndarray, group_size: int, rows_layout: bool = False) -> np.ndarray:
    """packed [..., out, in / 8] (the "rows" layout where `rows_layout`, else the checkpoint's) -> float32
    [..., out, in]."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    values = ((packed.view(np.uint32)[..., None] >> shifts) & 0xF).astype(np.int32) - 8  # nibble j of word w
    if rows_layout:  # nibble j of word w is input j * words + w
        values = values.swapaxes(-1, -2)
    *lead, rows, words = packed.shape
    grouped = values.reshape(*lead, rows, -1, group_size).astype(np.float32)
    return (grouped * scale.astype(np.float32)[..., None]).reshape(*lead, rows, words * 8)


def int4_moe_numpy(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size: int,
                   rows_layout: bool = False) -> np.ndarray:  # fmt: skip
    """Each chosen expert dequantized once, applied to the tokens that chose it."""
    x = x.astype(np.float32)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gate = x[rows] @ dequantize_numpy(gate_p[e], gate_s[e], group_size, rows_layout).T
        up = x[rows] @ dequantize_numpy(up_p[e], up_s[e], group_size, rows_layout).T
        act = gate / (1.0 + np.exp(-gate)) * up
        routed = act @ dequantize_numpy(down_p[e], down_s[e], group_size, rows_layout).T
        np.add.at(out, rows, weights[rows, slots].astype(np.float32)[:, None] * routed)
    return out


@onnx_op(
    op_type="ddtree::Int4MoE",
    inputs=[_F, _I64, _F, _I32, _F, _I32, _F, _I32, _F],
    outputs=[_F],
    attrs={"group_size": PyCustomOpDef.dt_int64, "rows": PyCustomOpDef.dt_int64},
)
def _int4_moe(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, **attrs):
    return int4_moe_numpy(x, ids, weights, gate_p, gate_s, up_p, up_s, down_p, down_s, int(attrs["group_size"]),
                          bool(attrs.get("rows", 0)))  # fmt: skip
