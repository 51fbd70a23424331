"""ONNX Runtime backend: the engine directory's ONNX graphs (the ones the TensorRT engines were built from),
with the `ddtree` custom ops from `plugins/*/ort_op.py` and real MPI collectives inside the graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engines.io import ROLES
from runner.sessions.base import EngineSession


class OrtSession(EngineSession):
    backend = "ort"

    def __init__(self, rank_dir: Path, profiles, io, threads: int = 1):
        import onnxruntime as ort
        from onnxruntime_extensions import get_library_path

        import plugins.collectives.ort_op  # noqa: F401  (registers ddtree::AllReduce / AllGather)
        import plugins.int4_moe.ort_op  # noqa: F401  (registers ddtree::Int4MoE)
        import plugins.tree_attention.ort_op  # noqa: F401  (registers ddtree::TreeAttention)

        super().__init__(profiles, io)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # custom ops (MPI) on the calling thread
        options.register_custom_ops_library(get_library_path())
        self.sessions = {}
        for role in ROLES:
            path = Path(rank_dir) / f"{role}.onnx"
            if not path.is_file():
                raise FileNotFoundError(f"engine directory lacks {path}")
            self.sessions[role] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def execute(self, profile, feeds):
        inputs, outputs = self.io[profile.role]
        arrays = {t.name: np.ascontiguousarray(feeds[t.name].detach().cpu().numpy()) for t in inputs}
        results = self.sessions[profile.role].run([t.name for t in outputs], arrays)
        return {t.name: torch.from_numpy(value) for t, value in zip(outputs, results)}
