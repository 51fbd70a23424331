"""One place assembles a rank, for every caller: the CLI and `--serve` (so the Triton model), the benchmarks, the ONNX
check and the tests. A benchmark number therefore describes the program users launch.

The hardware choices are made here, once:
- torch backend on CUDA: the GPU form of every operator (`gpu_ops`: the TreeAttention and drafter attention kernels,
  grouped-GEMM MoE in bf16, fused RMSNorm and rotary, the in-place absorbed MLA, q/k/v and gate/up as one GEMM
  each), NCCL between ranks, one CUDA graph per fixed-shape profile (`CudaGraphSession`) and the device loop (a
  greedy step as one CUDA graph, `runner/device/loop.py`);
- torch backend on CPUs: the reference forms, MPI (or threads of one process) between ranks, eager sessions;
- ort / trt: the engine directory's ONNX graphs under ONNX Runtime, or its TensorRT engines.

Weights come from an engine directory (its checkpoint), a converted checkpoint (`CheckpointWeights`) or a named
preset with random weights built on the device (`PresetWeights`, `models/presets.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from engines.engine_dir import EngineDir
from engines.io import engine_io
from engines.spec import DEFAULT_PREFILL_CHUNK, BuildConfig, SpecConfig, check_runtime_spec, derive_profiles
from models.checkpoint import CheckpointConfig, load_checkpoint_config
from models.ops import ModelOps
from models.presets import Preset, preset
from runner.probes import Probes
from runner.ranks import LocalRanks
from runner.worker import RankWorker

log = logging.getLogger("ddtree.runner")
BACKENDS = ("trt", "ort", "torch")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RankOptions:
    """How to run a rank. backend: trt | ort | torch. device (torch backend): auto (CUDA where a GPU exists), cpu,
    cuda. device_loop: greedy steps as one tensor program a step (None: on CUDA, where it is one graph a step).
    autoregressive: the device loop decodes one token a step (the baseline) instead of speculating. probes:
    benchmarks' hooks (`runner/probes.py`), None for users. chunked_prefill_size: a prompt's forward in chunks of at
    most this many tokens, each attending to the ones before through the cache (0: the whole prompt at once), so
    a long prompt's T x T work and buffers stay bounded. max_batch_size: requests a step serves at most (in-flight
    batching on the device loop, `runner/device/batch.py`: a slot of caches each); 1: one request at a time."""

    backend: str = "torch"
    device: str = "auto"
    device_loop: bool | None = None
    autoregressive: bool = False
    probes: Probes | None = None
    chunked_prefill_size: int = DEFAULT_PREFILL_CHUNK
    max_batch_size: int = 1

    def __post_init__(self) -> None:
        if (
            isinstance(self.chunked_prefill_size, bool)
            or not isinstance(self.chunked_prefill_size, int)
            or (self.chunked_prefill_size < 0)
        ):
            raise ValueError(f"chunked_prefill_size must be an integer >= 0 (0: no chunks), got "
                             f"{self.chunked_prefill_size!r}")  # fmt: skip
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.device_loop and self.backend != "torch":
            raise ValueError(f"the device loop runs on the torch backend; got backend={self.backend!r}")
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.max_batch_size > 1 and (self.backend != "torch" or self.device_loop is False):
            raise ValueError(f"max_batch_size={self.max_batch_size}: batched steps run on the device loop of the torch "
                             f"backend; got backend={self.backend!r}, device_loop={self.device_loop}")  # fmt: skip


class CheckpointWeights:
    """A converted TP-N checkpoint directory (`build-engine convert`, or an engine directory's `checkpoint/`)."""

    standalone_rank = False

    def __init__(self, checkpoint_dir: Path):
        self.path = Path(checkpoint_dir)
        self.config = load_checkpoint_config(self.path)
        self.tp_size, self.dtype = self.config.tp_size, getattr(torch, self.config.dtype)

    def rank_configs(self, rank: int):
        return self.config.rank_configs(rank)

    def models(self, rank: int, ops: ModelOps, device: torch.device):
        from models.loader import load_rank_models

        _, target, drafter = load_rank_models(self.path, rank, ops, device)
        return target, drafter


class PresetWeights:
    """A named preset (`models/presets.py`) with random weights from a fixed seed, built directly on the device.
    Ranks built again with other options (a different spec, the device loop or not) share the modules of the same
    rank, forms and device."""

    def __init__(self, model: Preset | str, dtype: torch.dtype = torch.bfloat16, seed: int = 3, smoke: bool = False):
        self.preset = preset(model, smoke) if isinstance(model, str) else model
        self.dtype, self.seed = dtype, seed
        self.standalone_rank = self.preset.standalone_rank
        self.tp_size = 1 if self.standalone_rank else self.preset.target.mapping.tp_size
        self._built: dict = {}

    def rank_configs(self, rank: int):
        from models.mapping import Mapping

        target, drafter = self.preset.target, self.preset.drafter
        if self.standalone_rank:
            return target, drafter
        mapping = Mapping(self.tp_size, rank, self.tp_size)
        return target.for_rank(mapping), drafter.for_rank(mapping)

    def models(self, rank: int, ops: ModelOps, device: torch.device):
        from models.random_weights import random_rank_models

        forms = tuple(getattr(ops, f.name) for f in fields(ops) if f.name != "collectives")
        key = (rank, str(device), forms)
        if key not in self._built:
            self._built[key] = random_rank_models(*self.rank_configs(rank), ops, device, self.dtype, self.seed)
        return self._built[key]


def default_backend() -> str:
    """trt where full TensorRT imports and a GPU exists, else ort."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "ort"
    return "trt" if torch.cuda.is_available() else "ort"


def cpu_ops(collectives, target_cfg=None) -> ModelOps:
    """The reference forms (CPUs): the torch TreeAttention, plain norms, one linear per weight, and the MoE form for
    the model's experts (`models.moe.moe_form`: all experts at once while they are few, gathered otherwise)."""
    from models.moe import MoE, moe_form
    from plugins.tree_attention.reference import tree_attention

    return ModelOps(tree_attention, collectives, moe=moe_form(target_cfg) if target_cfg is not None else MoE)


def gpu_ops(collectives, target_cfg, dtype: torch.dtype) -> ModelOps:
    """The GPU forms: the Triton TreeAttention and drafter kernels, grouped-GEMM MoE (bf16; the gathered experts
    otherwise), the W4A16 grouped kernel for INT4 experts (their words reordered once at load where the dimensions
    allow), the router in two Triton launches, fused RMSNorm and rotary, the in-place absorbed MLA (q_a and kv_a one
    GEMM), q/k/v and gate/up as one GEMM each, the SwiGLU act one kernel; the MoE's shared expert and MLA's latent
    norm and rope on a second stream beside the rest of their layer (`models/streams.py`)."""
    from models.dflash import KernelDraftAttention
    from models.layers import FusedGatedMLP, FusedRMSNorm
    from models.mla import AbsorbedMLA, InPlaceAbsorbedMLA
    from models.moe import GroupedMoE, MoE, RoutedGroupedMoE, fused_router
    from models.triton_ops import ROUTER_MAX_TOKENS, fused_rotary
    from plugins.int4_moe.kernel import Int4MoEKernel
    from plugins.tree_attention.kernel import tree_attention_cuda

    # the bf16 experts' pairs sorted by `argsort` ("sort", the default) or in one routing launch ("kernel",
    # `RoutedGroupedMoE`: not yet timed on a GPU)
    route = os.environ.get("DDTREE_MOE_ROUTE", "") or "sort"
    if route not in ("sort", "kernel"):
        raise ValueError(f"DDTREE_MOE_ROUTE: expected 'sort' or 'kernel' (or unset: sort), got {route!r}")
    grouped = RoutedGroupedMoE if route == "kernel" else GroupedMoE
    # the rows the router's kernels take (unset: ROUTER_MAX_TOKENS, a batch's verify; 64: a lone request's verify,
    # a batch's wider one taking the torch form, as before the logits' token blocks)
    max_rows = os.environ.get("DDTREE_ROUTER_MAX_ROWS", "")
    if max_rows and not (max_rows.isdigit() and 1 <= int(max_rows) <= ROUTER_MAX_TOKENS):
        raise ValueError(f"DDTREE_ROUTER_MAX_ROWS: expected a row count from 1 to {ROUTER_MAX_TOKENS} (or unset: "
                         f"{ROUTER_MAX_TOKENS}), got {max_rows!r}")  # fmt: skip
    return ModelOps(
        tree_attention=tree_attention_cuda,
        collectives=collectives,
        moe=grouped if dtype == torch.bfloat16 else MoE,
        mla=InPlaceAbsorbedMLA if InPlaceAbsorbedMLA.supports(target_cfg) else AbsorbedMLA,
        norm=FusedRMSNorm,
        rotary=fused_rotary,
        draft_attention=KernelDraftAttention,
        fused_projections=True,
        int4_moe=Int4MoEKernel(),
        router=fused_router(int(max_rows) if max_rows else None),
        gated_mlp=FusedGatedMLP,
        side_stream=True,
    )


def model_ops(device: torch.device, collectives, target_cfg, dtype: torch.dtype) -> ModelOps:
    if device.type != "cuda":
        return cpu_ops(collectives, target_cfg)
    from models.streams import side_stream

    side_stream(device)  # made now, before any graph capture
    return gpu_ops(collectives, target_cfg, dtype)


def rank_device(options: RankOptions, rank: int) -> torch.device:
    """trt: this rank's GPU; ort: the CPU; torch: as `options.device` says (auto: CUDA where a GPU exists)."""
    cuda = options.backend == "trt" or (options.backend == "torch" and options.device != "cpu")
    if cuda and not torch.cuda.is_available():
        if options.device == "auto" and options.backend == "torch":
            return torch.device("cpu")
        raise ValueError(f"backend={options.backend!r} device={options.device!r} needs a CUDA GPU; none is visible")
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def rank_collectives(device: torch.device, weights, rank: int, comm=None, group=None):
    """Threads of one process (`group`), MPI ranks (`comm`: NCCL on GPUs, MPI on CPUs), or one rank alone."""
    from models.parallel import SingleRank

    if group is not None:
        return group.member(rank)
    if weights.standalone_rank or weights.tp_size == 1:
        return SingleRank()
    if comm is None:
        raise ValueError(f"tp_size={weights.tp_size} needs its ranks: run under mpirun -np {weights.tp_size}")
    if device.type == "cuda":
        from runner.nccl import NcclCollectives

        return NcclCollectives(comm, device)
    from runner.mpi import MpiCollectives

    return MpiCollectives(comm)


def build_rank(model, rank: int, options: RankOptions = RankOptions(), spec: SpecConfig | None = None,
               build: BuildConfig | None = None, comm=None, group=None) -> RankWorker:  # fmt: skip
    """Rank `rank` of `model` (an `EngineDir`, `CheckpointWeights` or `PresetWeights`) as `options` asks.

    spec: the speculation shape (an engine directory's own by default; its profiles must hold it); build: the limits
    of weights without an engine directory. comm / group: the MPI communicator or the in-process `ThreadGroup`."""
    if isinstance(model, EngineDir):
        model.check_files(options.backend)
        spec, profiles, capacity = spec or model.spec, model.profiles, model.build_config.max_seq_len
        checkpoint = CheckpointConfig.from_dict(model.config["pretrained_config"], str(model.path / "config.json"))
        dtype = getattr(torch, checkpoint.dtype)
        weights = CheckpointWeights(model.checkpoint_dir) if options.backend == "torch" else checkpoint
    else:
        if options.backend != "torch":
            raise ValueError(f"the {options.backend} backend runs an engine directory; got {type(model).__name__}")
        if spec is None or build is None:
            raise ValueError("weights without an engine directory need a spec and a build config")
        weights, profiles, capacity, dtype = model, derive_profiles(spec, build), build.max_seq_len, model.dtype
    check_runtime_spec(spec, profiles)
    target_cfg, drafter_cfg = weights.rank_configs(rank)
    io = engine_io(target_cfg, drafter_cfg)
    device = rank_device(options, rank)
    forms = {"ort": "the engine directory's ONNX graphs under ONNX Runtime",
             "trt": "the TensorRT engines, a CUDA graph per fixed-shape profile"}.get(options.backend)  # fmt: skip
    if options.backend == "ort":
        from runner.sessions.ort import OrtSession

        if dtype != torch.float32:
            raise ValueError(f"the ort backend runs float32 engines on the CPU; this one is {checkpoint.dtype}")
        session = OrtSession(model.rank_dir(rank), profiles, io)
    elif options.backend == "trt":
        from runner.sessions.trt import TrtSession

        session = TrtSession(model, rank, profiles, io, device)
    else:
        ops = model_ops(device, rank_collectives(device, weights, rank, comm, group), target_cfg, dtype)
        target, drafter = weights.models(rank, ops, device)
        forms = describe_ops(ops, int4_experts=target_cfg.quantization is not None)
        if device.type == "cuda":
            from runner.sessions.cuda_graphs import CudaGraphSession

            record = options.probes is not None and options.probes.record_events
            session = CudaGraphSession(target, drafter, profiles, io, device, record_events=record)
            forms += ", a CUDA graph per fixed-shape profile"
        else:
            from runner.sessions.base import TorchSession

            session = TorchSession(target, drafter, profiles, io)
    worker = RankWorker(session, spec, target_cfg, drafter_cfg, capacity, dtype, device)
    worker.prefill_chunk = options.chunked_prefill_size
    device_loop = options.device_loop if options.device_loop is not None else device.type == "cuda"
    if device_loop and options.backend == "torch":
        worker.enable_device_loop(options.autoregressive, _on_device(options.probes, device))
    if options.max_batch_size > 1:
        if not device_loop:
            raise ValueError(f"max_batch_size={options.max_batch_size}: batched steps run on the device loop "
                             f"(--loop device on {device.type})")  # fmt: skip
        worker.enable_batching(options.max_batch_size)
    worker.description = f"{options.backend} backend on {device}: {forms}"
    log.info("rank %d: %s", rank, worker.description)
    return worker


def local_ranks(model, options: RankOptions = RankOptions(), spec: SpecConfig | None = None,
                build: BuildConfig | None = None) -> LocalRanks:  # fmt: skip
    """Every rank of `model` in this process (threads, with an in-process all-reduce, when tp_size > 1): the CPU
    reference the tests compare against, and one GPU's rank for benchmarks."""
    from models.parallel import ThreadGroup

    tp_size = model.tp_size
    if tp_size > 1 and rank_device(options, 0).type == "cuda":
        raise ValueError(f"in-process ranks on a GPU run one rank; tp_size={tp_size} runs under mpirun -np {tp_size}")
    if tp_size > 1 and options.backend != "torch":
        raise ValueError(f"the {options.backend} backend's collectives are MPI's: run tp_size={tp_size} under mpirun")
    group = ThreadGroup(tp_size) if tp_size > 1 else None
    return LocalRanks([build_rank(model, rank, options, spec, build, group=group) for rank in range(tp_size)], group)


def describe_ops(ops: ModelOps, int4_experts: bool = False) -> str:
    """The forms a rank runs, in words (printed by the CLI, logged by every rank)."""
    attention = getattr(ops.tree_attention, "__name__", type(ops.tree_attention).__name__)
    int4 = getattr(ops.int4_moe, "__name__", type(ops.int4_moe).__name__)
    moe = f"INT4 experts by {int4}" if int4_experts else ops.moe.__name__
    return (
        f"{attention}, {ops.mla.__name__}, {moe}, {ops.norm.__name__}, {ops.draft_attention.__name__}"
        + (", fused projections" if ops.fused_projections else "")
        + (", side stream" if ops.side_stream else "")
    )


def _on_device(probes: Probes | None, device: torch.device) -> Probes | None:
    if probes is None or probes.oracle is None:
        return probes
    return replace(probes, oracle=torch.as_tensor(probes.oracle).to(device))
