"""Raw TensorRT device pointers as torch tensors (no copy), for Python plugins' `enqueue`.

Only used on a GPU inside a TensorRT execution context; torch is imported lazily there.
"""

from __future__ import annotations

_TORCH_DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "INT8": "int8",
}
_TYPESTR = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<V2",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "|b1",
    "int8": "|i1",
}


class _CudaArray:
    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {
            "data": (int(pointer), False),
            "shape": shape,
            "typestr": typestr,
            "version": 3,
            "strides": None,
        }


def as_torch(desc, pointer: int):
    """A torch view of a plugin input/output given its PluginTensorDesc and device pointer."""
    import torch

    name = _TORCH_DTYPES[str(desc.type).split(".")[-1]]
    shape = tuple(int(d) for d in desc.dims)
    if name == "bfloat16":  # CUDA array interface has no bf16: view int16 storage as bf16
        raw = torch.as_tensor(_CudaArray(pointer, shape, "<i2"), device="cuda")
        return raw.view(torch.bfloat16)
    return torch.as_tensor(_CudaArray(pointer, shape, _TYPESTR[name]), device="cuda")


def torch_stream(stream: int):
    import torch

    return torch.cuda.ExternalStream(int(stream))
