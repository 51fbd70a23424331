"""TensorRT backend (users' GPUs, full TensorRT): one execution context per named profile, static I/O buffers
bound once, and a CUDA graph per fixed-shape profile, replayed after the new inputs are copied *into* the bound
buffers (a graph ignores a fresh tensor).

Caches (`latent_cache`, `draft_cache`) are the runner's own device tensors, bound in place (no copy); their
addresses never change for a sequence cache, so the captured graphs stay valid. Outputs are views of static
buffers, valid until the same profile runs again: the worker consumes them before that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.io import ROLES, TensorIO
from engines.spec import Profile
from runner.sessions.base import EngineSession

BOUND_IN_PLACE = ("latent_cache", "draft_cache")
TORCH_DTYPES = {"int64": torch.int64, "bool": torch.bool, "float32": torch.float32}


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]  # the largest shape the profile admits
    dtype: str
    in_place: bool  # bound to the caller's tensor instead of a static buffer


def resolve_dims(tensor: TensorIO, profile: Profile, extra: dict[str, int]) -> tuple[int, ...]:
    return tuple(
        d if isinstance(d, int) else (profile.dims[d][2] if d in profile.dims else extra[d]) for d in tensor.dims
    )


def plan_buffers(profile: Profile, inputs: list[TensorIO], outputs: list[TensorIO]) -> list[BufferSpec]:
    """Static buffers of one profile at its maximum shapes (pure: unit-tested without a GPU)."""
    extra = {"draft_rows": profile.dims["block"][2] - 1} if "block" in profile.dims else {}
    return [
        BufferSpec(t.name, resolve_dims(t, profile, extra), t.dtype, t.name in BOUND_IN_PLACE) for t in inputs + outputs
    ]


def graph_capturable(profile: Profile) -> bool:
    """Only profiles whose every dimension is fixed (min = max) replay one CUDA graph."""
    return all(low == high for low, _, high in profile.dims.values())


class TrtSession(EngineSession):
    backend = "trt"

    def __init__(self, engine_dir, rank: int, profiles, io, device: torch.device, model_dtype: torch.dtype = None):
        from plugins.registry import register_plugins
        from plugins.tensorrt import import_tensorrt

        super().__init__(profiles, io)
        trt = import_tensorrt("tensorrt").module  # TensorRT-RTX cannot run on data-center GPUs
        register_plugins(trt)
        self.trt, self.device = trt, device
        self.model_dtype = model_dtype or getattr(torch, engine_dir.build_config.dtype)
        self.stream = torch.cuda.Stream(device)
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        self.engines, self.contexts, self.buffers, self.graphs = {}, {}, {}, {}
        for role in ROLES:
            plan = engine_dir.engine_path(rank, role).read_bytes()
            self.engines[role] = runtime.deserialize_cuda_engine(plan)
            if self.engines[role] is None:
                raise RuntimeError(f"TensorRT could not deserialize {engine_dir.engine_path(rank, role)}")
        for name, profile in profiles.items():
            info = engine_dir.build_info(rank, profile.role)["profiles"][name]
            context = self.engines[profile.role].create_execution_context()
            context.set_optimization_profile_async(info["index"], self.stream.cuda_stream)
            self.contexts[name] = context
            inputs, outputs = io[profile.role]
            self.buffers[name] = {
                spec.name: None
                if spec.in_place
                else torch.empty(spec.shape, dtype=self._dtype(spec.dtype), device=device)
                for spec in plan_buffers(profile, inputs, outputs)
            }

    def _dtype(self, name: str) -> torch.dtype:
        return self.model_dtype if name == "model" else TORCH_DTYPES[name]

    def execute(self, profile, feeds):
        context, buffers = self.contexts[profile.name], self.buffers[profile.name]
        inputs, outputs = self.io[profile.role]
        rebind = False
        with torch.cuda.stream(self.stream):
            for tensor in inputs:
                value = feeds[tensor.name]
                if tensor.name in BOUND_IN_PLACE:
                    if buffers[tensor.name] is None or buffers[tensor.name].data_ptr() != value.data_ptr():
                        buffers[tensor.name], rebind = value, True
                else:
                    target = buffers[tensor.name][tuple(slice(0, n) for n in value.shape)]
                    target.copy_(value, non_blocking=True)
                context.set_input_shape(tensor.name, tuple(value.shape))
            for name, buffer in buffers.items():
                if rebind or profile.name not in self.graphs:
                    context.set_tensor_address(name, buffer.data_ptr())
            if graph_capturable(profile):
                self._replay(profile.name, context, rebind)
            elif not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError(f"TensorRT execute failed for profile {profile.name}")
            result = {}
            for tensor in outputs:
                shape = tuple(context.get_tensor_shape(tensor.name))
                result[tensor.name] = buffers[tensor.name][tuple(slice(0, n) for n in shape)]
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return result

    def _replay(self, name: str, context, rebind: bool) -> None:
        if name not in self.graphs or rebind:
            if not context.execute_async_v3(self.stream.cuda_stream):  # warm-up outside capture
                raise RuntimeError(f"TensorRT execute failed for profile {name}")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                context.execute_async_v3(self.stream.cuda_stream)
            self.graphs[name] = graph
        self.graphs[name].replay()
