"""One rank's worker for a chosen backend, from an engine directory.

ort    the engine dir's ONNX graphs under ONNX Runtime (CPU), collectives through MPI inside the graphs
trt    the TensorRT engines (users' GPUs), plugins registered, one execution context per named profile
torch  the per-rank torch modules from the engine dir's checkpoint; CUDA (GPU kernel + NCCL) or CPU (MPI)
"""

from __future__ import annotations

import logging

import torch

from engines.engine_dir import EngineDir
from engines.io import role_io
from engines.spec import SpecConfig, check_runtime_spec
from models.checkpoint import CheckpointConfig
from runner.worker import RankWorker

log = logging.getLogger("ddtree.runner")
BACKENDS = ("trt", "ort", "torch")


def default_backend() -> str:
    """trt where full TensorRT imports and a GPU exists, else ort."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "ort"
    return "trt" if torch.cuda.is_available() else "ort"


def rank_worker(engine: EngineDir, backend: str, rank: int, comm, spec: SpecConfig | None = None) -> RankWorker:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    engine.check_files(backend)
    spec = spec or engine.spec
    profiles = engine.profiles
    check_runtime_spec(spec, profiles)
    checkpoint = CheckpointConfig.from_dict(engine.config["pretrained_config"], str(engine.path / "config.json"))
    target_cfg, drafter_cfg = checkpoint.rank_configs(rank)
    io = {role: role_io(role, target_cfg, drafter_cfg) for role in ("target", "draft")}
    dtype = getattr(torch, checkpoint.dtype)
    device = torch.device("cpu")
    if backend == "ort":
        from runner.ort_session import OrtSession

        if checkpoint.dtype != "float32":
            raise ValueError(f"the ort backend runs float32 engines on the CPU; this one is {checkpoint.dtype}")
        session = OrtSession(engine.rank_dir(rank), profiles, io)
    elif backend == "trt":
        from runner.trt_session import TrtSession

        device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
        session = TrtSession(engine, rank, profiles, io, device)
    else:
        session, device = _torch_session(engine, rank, comm, profiles, io)
    log.info("rank %d: %s backend on %s", rank, backend, device)
    return RankWorker(session, spec, target_cfg, drafter_cfg, engine.build_config.max_seq_len, dtype, device)


def _torch_session(engine: EngineDir, rank: int, comm, profiles, io):
    from models.kimi import ModelOps
    from models.loader import load_rank_models
    from runner.session import TorchSession

    if torch.cuda.is_available():
        from plugins.tree_attention.kernel import tree_attention_cuda
        from runner.nccl import NcclCollectives

        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        ops = ModelOps(tree_attention_cuda, NcclCollectives(comm, device))
    else:
        from plugins.tree_attention.reference import tree_attention
        from runner.mpi import MpiCollectives

        device = torch.device("cpu")
        ops = ModelOps(tree_attention, MpiCollectives(comm))
    _, target, drafter = load_rank_models(engine.checkpoint_dir, rank, ops, "absorbed", device)
    return TorchSession(target, drafter, profiles, io), device
