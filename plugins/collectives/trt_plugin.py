"""TensorRT plugins `ddtree::AllReduce` (sum, no fields) and `ddtree::AllGather` (field `world_size`, int32; the
last axis grows world_size-fold). `enqueue` calls NCCL through torch.distributed on TensorRT's stream; the runner
initialises the process group (`runner.nccl`) before the first execute."""

from __future__ import annotations

from plugins.trt_base import OpSpec, make_plugin_class


class _AllReduceSpec(OpSpec):
    def output_shapes(self, plugin, inputs, exprs):
        return [inputs[0]]

    def supports(self, plugin, pos, in_out, num_inputs):
        kind = in_out[pos].desc.type
        return kind in self.floats and kind == in_out[0].desc.type

    def enqueue(self, plugin, input_desc, output_desc, inputs, outputs, workspace, stream):
        import torch
        import torch.distributed as dist

        from plugins.device_tensors import as_torch, torch_stream

        x, out = as_torch(input_desc[0], inputs[0]), as_torch(output_desc[0], outputs[0])
        with torch.cuda.stream(torch_stream(stream)):
            out.copy_(x)
            dist.all_reduce(out)


class _AllGatherSpec(_AllReduceSpec):
    def output_shapes(self, plugin, inputs, exprs):
        dims = inputs[0]
        out = self.trt.DimsExprs(len(dims))
        for i in range(len(dims)):
            out[i] = dims[i]
        last = len(dims) - 1
        out[last] = exprs.operation(
            self.trt.DimensionOperation.PROD, dims[last], exprs.constant(int(plugin.fields["world_size"]))
        )
        return [out]

    def enqueue(self, plugin, input_desc, output_desc, inputs, outputs, workspace, stream):
        import torch
        import torch.distributed as dist

        from plugins.device_tensors import as_torch, torch_stream

        x, out = as_torch(input_desc[0], inputs[0]), as_torch(output_desc[0], outputs[0])
        world = int(plugin.fields["world_size"])
        with torch.cuda.stream(torch_stream(stream)):
            gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(gathered, x.contiguous())
            out.copy_(gathered.movedim(0, -2).reshape(out.shape))


def creators(trt) -> list:
    _, all_reduce = make_plugin_class(trt, "AllReduce", {}, _AllReduceSpec(trt))
    _, all_gather = make_plugin_class(trt, "AllGather", {"world_size": "int"}, _AllGatherSpec(trt))
    return [all_reduce(), all_gather()]
