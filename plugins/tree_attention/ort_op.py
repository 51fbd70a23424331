"""ONNX Runtime (CPU) implementation of `ddtree::TreeAttention`, through onnxruntime-extensions' Python ops.

A second, numpy implementation of the contract in `reference.py` (tested against it). Importing this module
registers the op for the whole process.
"""

from __future__ import annotations

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, onnx_op

from plugins import ort_pyop

ort_pyop.install()  # outputs handed back as arrays, not lists

_F, _I64, _B = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64, PyCustomOpDef.dt_bool


def tree_attention_numpy(q, cache, cache_length, new_kv, tree_mask, scale, latent_dim):
    length = int(np.asarray(cache_length).reshape(-1)[0])
    keys = np.concatenate((cache[:length], new_kv), axis=0).astype(np.float32)  # [L + T, D]
    tokens = q.shape[0]
    visible = np.concatenate((np.ones((tokens, length), dtype=bool), tree_mask.astype(bool)), axis=1)
    heads = q.shape[1]
    # matrix products (BLAS) rather than np.einsum's loops: the 33-row verify is where the time goes
    scores = (q.astype(np.float32).reshape(tokens * heads, -1) @ keys.T).reshape(tokens, heads, -1) * np.float32(scale)
    scores = np.where(visible[:, None, :], scores, -np.inf)
    seen = visible.any(axis=-1)[:, None, None]
    peak = np.where(seen, scores.max(axis=-1, keepdims=True), 0.0)
    weights = np.where(visible[:, None, :], np.exp(scores - peak), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    probs = np.where(seen, weights / np.where(total == 0, 1.0, total), 0.0)
    out = probs.reshape(tokens * heads, -1).astype(np.float32) @ keys[:, :latent_dim]
    return out.reshape(tokens, heads, latent_dim).astype(np.float32)


@onnx_op(
    op_type="ddtree::TreeAttention",
    inputs=[_F, _F, _I64, _F, _B],
    outputs=[_F],
    attrs={"scale": PyCustomOpDef.dt_float, "latent_dim": PyCustomOpDef.dt_int64},
)
def _tree_attention(q, cache, cache_length, new_kv, tree_mask, **attrs):
    return tree_attention_numpy(q, cache, cache_length, new_kv, tree_mask, attrs["scale"], int(attrs["latent_dim"]))
