"""The torch backend assembled in one process: per-rank modules, sessions and workers behind `LocalRanks`.

TP ranks run as threads with an in-process all-reduce (`models.parallel.ThreadGroup`). This is the CPU reference
the tests compare everything against; under mpirun the same pieces run one rank per process (`runner.mpi`).
"""

from __future__ import annotations

from pathlib import Path

from engines.io import role_io
from engines.spec import BuildConfig, SpecConfig, derive_profiles
from models.kimi import ModelOps
from models.loader import load_rank_models
from models.parallel import SingleRank, ThreadGroup
from plugins.tree_attention.reference import tree_attention
from runner.ranks import LocalRanks
from runner.session import TorchSession
from runner.worker import RankWorker


def torch_rank_worker(
    checkpoint_dir: Path,
    rank: int,
    spec: SpecConfig,
    build: BuildConfig,
    collectives,
    tree_attention_fn=tree_attention,
    attention: str = "absorbed",
    device="cpu",
) -> RankWorker:
    config, target, drafter = load_rank_models(
        checkpoint_dir, rank, ModelOps(tree_attention_fn, collectives), attention, device
    )
    target_cfg, drafter_cfg = config.rank_configs(rank)
    io = {role: role_io(role, target_cfg, drafter_cfg) for role in ("target", "draft")}
    session = TorchSession(target, drafter, derive_profiles(spec, build), io)
    dtype = next(target.parameters()).dtype
    return RankWorker(session, spec, target_cfg, drafter_cfg, build.max_seq_len, dtype, device)


def local_torch_engine(
    checkpoint_dir: Path, spec: SpecConfig, build: BuildConfig, attention: str = "absorbed", device="cpu"
) -> LocalRanks:
    from models.checkpoint import load_checkpoint_config

    tp_size = load_checkpoint_config(checkpoint_dir).tp_size
    group = ThreadGroup(tp_size) if tp_size > 1 else None
    workers = [
        torch_rank_worker(
            checkpoint_dir,
            rank,
            spec,
            build,
            group.member(rank) if group else SingleRank(),
            attention=attention,
            device=device,
        )
        for rank in range(tp_size)
    ]
    return LocalRanks(workers, group)
