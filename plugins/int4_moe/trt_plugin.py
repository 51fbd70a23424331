"""TensorRT plugin `ddtree::Int4MoE` (version 1): fields `group_size` (int32) and `rows` (int32: 1 when the packed
words are in the "rows" layout, `kernel.repack_rows`, which the exported graphs carry where the dimensions allow).

Inputs  x [T, H] (fp32/fp16/bf16), expert_ids [T, k] int64, expert_weights [T, k] float32,
        gate_packed, up_packed [E, W, H / 8] int32, gate_scale, up_scale [E, W, H / group_size] (the type of x),
        down_packed [E, H, W / 8] int32, down_scale [E, H, W / group_size] (the type of x).
Output  [T, H] (the type of x). The packed weights reach the plugin as the engine's int32 constants: the engine
holds the experts at 4 bits. `enqueue` launches the W4A16 grouped kernel (`kernel.py`) on TensorRT's stream: no
host synchronisation, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from plugins.trt_base import OpSpec, make_plugin_class

FIELDS = {"group_size": "int", "rows": "int"}
PACKED, SCALES = (3, 5, 7), (4, 6, 8)


class _Spec(OpSpec):
    def output_shapes(self, plugin, inputs, exprs):
        out = self.trt.DimsExprs(2)
        out[0], out[1] = inputs[0][0], inputs[0][1]
        return [out]

    def supports(self, plugin, pos, in_out, num_inputs):
        kind = in_out[pos].desc.type
        if pos == 1:
            return kind == self.trt.int64
        if pos == 2:
            return kind == self.trt.float32
        if pos in PACKED:
            return kind == self.trt.int32
        return kind in self.floats and kind == in_out[0].desc.type  # x, the scales, the output

    def enqueue(self, plugin, input_desc, output_desc, inputs, outputs, workspace, stream):
        from plugins.device_tensors import as_torch, torch_stream
        from plugins.int4_moe.kernel import int4_moe_cuda

        tensors = [as_torch(d, p) for d, p in zip(input_desc, inputs)]
        out = as_torch(output_desc[0], outputs[0])
        layout = "rows" if plugin.fields["rows"] else "compressed-tensors"
        int4_moe_cuda(*tensors, int(plugin.fields["group_size"]), out=out, stream=torch_stream(stream), layout=layout)


def creator(trt):
    _, creator_cls = make_plugin_class(trt, "Int4MoE", FIELDS, _Spec(trt))
    return creator_cls()
