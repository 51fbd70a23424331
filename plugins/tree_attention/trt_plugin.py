"""TensorRT plugin `ddtree::TreeAttention` (version 1): fields `scale` (float32), `latent_dim` (int32).

Inputs  q [T, H, D] (fp32/fp16/bf16), cache [S, D] (same type), cache_length [1] int64, new_kv [T, D] (same type),
        tree_mask [T, T] bool.  Output [T, H, latent_dim] (the type of q).
`enqueue` launches the GPU kernel (`kernel.py`) on TensorRT's stream: no host synchronisation, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

from plugins.trt_base import OpSpec, make_plugin_class

FIELDS = {"scale": "float", "latent_dim": "int"}


class _Spec(OpSpec):
    def output_shapes(self, plugin, inputs, exprs):
        out = self.trt.DimsExprs(3)
        out[0], out[1] = inputs[0][0], inputs[0][1]
        out[2] = exprs.constant(int(plugin.fields["latent_dim"]))
        return [out]

    def supports(self, plugin, pos, in_out, num_inputs):
        kind = in_out[pos].desc.type
        if pos == 2:
            return kind == self.trt.int64
        if pos == 4:
            return kind == self.trt.bool
        return kind in self.floats and kind == in_out[0].desc.type

    def enqueue(self, plugin, input_desc, output_desc, inputs, outputs, workspace, stream):
        from plugins.device_tensors import as_torch, torch_stream
        from plugins.tree_attention.kernel import tree_attention_cuda

        q, cache, length, new_kv, mask = (as_torch(d, p) for d, p in zip(input_desc, inputs))
        out = as_torch(output_desc[0], outputs[0])
        tree_attention_cuda(
            q,
            cache,
            length,
            new_kv,
            mask,
            plugin.fields["scale"],
            int(plugin.fields["latent_dim"]),
            out=out,
            stream=torch_stream(stream),
        )


def creator(trt):
    _, creator_cls = make_plugin_class(trt, "TreeAttention", FIELDS, _Spec(trt))
    return creator_cls()
