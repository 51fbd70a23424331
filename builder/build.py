"""`build-engine build`: TP-N checkpoint -> engine directory (`engines/engine_dir.py`), one short pipeline:

spec + limits -> named profiles -> for each rank: export ONNX (target, draft) -> TensorRT engines -> config.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

from builder import __version__
from engines.engine_dir import EngineDir, load_engine_dir, write_engine_dir_config
from engines.io import ROLES, role_io
from engines.output_dir import staged_output_dir
from engines.spec import BuildConfig, SpecConfig, derive_profiles
from models.checkpoint import load_checkpoint_config

log = logging.getLogger("ddtree.builder")


def build_engines(
    checkpoint_dir: Path,
    output_dir: Path,
    spec: SpecConfig,
    build: BuildConfig,
    force: bool = False,
    tensorrt: str | None = None,
    onnx: bool = True,
    protect: tuple[Path, ...] = (),
) -> EngineDir:
    """Exports and builds every rank's target and draft engines; config.json is written last.

    `tensorrt`: None picks full TensorRT, else TensorRT-RTX; "none" writes the ONNX graphs and the checkpoint
    only (the ort and torch backends run from those; GPU machines without TensorRT). `onnx=False` (with "none")
    writes the checkpoint only: the torch backend's engine directory, without exporting large models. Everything
    is written beside `output_dir` first and moves into place when complete (`engines/output_dir.py`); `protect`:
    more inputs the output must not replace (the HF checkpoints of the one-step command)."""
    from plugins.registry import register_plugins
    from plugins.tensorrt import import_tensorrt

    start = time.perf_counter()
    checkpoint = load_checkpoint_config(checkpoint_dir)
    if build.dtype != checkpoint.dtype:
        raise ValueError(f"build dtype={build.dtype} differs from the checkpoint's dtype={checkpoint.dtype}")
    profiles = derive_profiles(spec, build)
    if spec.block_size != checkpoint.drafter.block_size:
        log.warning(
            "block_size=%d differs from the drafter's trained block_size=%d",
            spec.block_size,
            checkpoint.drafter.block_size,
        )
    max_positions = min(checkpoint.target.max_position_embeddings, checkpoint.drafter.max_position_embeddings)
    if build.max_seq_len > max_positions:
        raise ValueError(f"max_seq_len={build.max_seq_len} exceeds the models' max_position_embeddings={max_positions}")
    if not onnx and tensorrt != "none":
        raise ValueError("TensorRT engines are built from the ONNX graphs: --no_onnx needs --no_tensorrt")
    trt = None if tensorrt == "none" else import_tensorrt(tensorrt)
    if trt is not None:
        register_plugins(trt.module)
    log.info(
        "building %s: tp_size=%d dtype=%s spec=%s limits=%s with %s",
        output_dir,
        checkpoint.tp_size,
        checkpoint.dtype,
        spec.to_dict(),
        build.to_dict(),
        f"{trt.flavor} {trt.version}" if trt else "no TensorRT (ONNX only)",
    )
    with staged_output_dir(output_dir, force, protect=(Path(checkpoint_dir), *protect)) as staging:
        _write_ranks(staging, Path(checkpoint_dir), checkpoint, profiles, trt, onnx)
        engines = {"builder": trt.flavor if trt else "none", "builder_version": trt.version if trt else None,
                   "onnx": onnx}  # fmt: skip
        write_engine_dir_config(staging, __version__, checkpoint.to_dict(), spec, build, profiles, engines)
    log.info("built %d ranks x %d roles in %.1f s", checkpoint.tp_size, len(ROLES), time.perf_counter() - start)
    return load_engine_dir(output_dir)


def _write_ranks(out: Path, checkpoint_dir: Path, checkpoint, profiles: dict, trt, onnx: bool) -> None:
    """The checkpoint (hard links), the tokenizer, and every rank's ONNX graphs and TensorRT engines, into `out`."""
    from builder.export import custom_ops, export_rank
    from builder.trt_build import build_engine

    _link_tree(checkpoint_dir, out / "checkpoint")
    if (checkpoint_dir / "tokenizer").is_dir():
        shutil.copytree(checkpoint_dir / "tokenizer", out / "tokenizer")
    for rank in range(checkpoint.tp_size if onnx else 0):
        rank_dir = out / f"rank{rank}"
        graphs = export_rank(checkpoint_dir, rank, profiles, rank_dir)
        target_cfg, drafter_cfg = checkpoint.rank_configs(rank)
        for role in ROLES if trt is not None else ():
            inputs, _ = role_io(role, target_cfg, drafter_cfg)
            role_profiles = [p for p in profiles.values() if p.role == role]
            plan, record = build_engine(trt, graphs[role], inputs, role_profiles)
            record["plugins"] = [
                {"layer": name, "op": op, "fields": fields} for name, op, fields in custom_ops(graphs[role])
            ]
            (rank_dir / f"{role}.engine").write_bytes(plan)
            (rank_dir / f"{role}.build.json").write_text(json.dumps(record, indent=1) + "\n")
            log.info(
                "rank %d %s engine: %.1f MB, %d plugin layers, %.2f s",
                rank,
                role,
                len(plan) / 1e6,
                len(record["plugin_layers"]),
                record["build_seconds"],
            )


def _link_tree(source: Path, destination: Path) -> None:
    """Hard links where the filesystem allows (no second copy of the weights), else copies."""

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, destination, copy_function=link, ignore=shutil.ignore_patterns("tokenizer"))


def build_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineDir:
    checkpoint = load_checkpoint_config(args.checkpoint_dir)
    block_size = args.block_size or checkpoint.drafter.block_size
    if args.max_num_tokens is not None and args.max_num_tokens < 1:
        parser.error(f"--max_num_tokens must be >= 1, got {args.max_num_tokens}")
    spec = SpecConfig(block_size=block_size, budget=args.ddtree_budget, max_topk=args.max_topk,
                      extra_budgets=getattr(args, "extra_budgets", ()))  # fmt: skip
    build = BuildConfig(
        max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        dtype=checkpoint.dtype,
    )
    logging.getLogger("ddtree.builder").setLevel(args.log_level.upper() if args.log_level != "verbose" else "DEBUG")
    tensorrt = "none" if args.no_tensorrt or args.no_onnx else None
    inputs = tuple(Path(p) for p in (getattr(args, "model_dir", None), getattr(args, "draft_model_dir", None)) if p)
    return build_engines(args.checkpoint_dir, args.output_dir, spec, build, args.force, tensorrt, not args.no_onnx,
                         protect=inputs)  # fmt: skip
