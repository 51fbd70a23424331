"""HF checkpoints (Kimi target + DFlash drafter) -> TP-N checkpoint directory (`models/checkpoint.py`).

Splits follow `models/layout.py`. INT4 routed experts stay packed as the checkpoint ships them (compressed-tensors
pack-quantized int32 words and bf16 group scales), cut per rank along the expert width on group boundaries; the
checkpoint's config records the quantization and every backend runs them through `ddtree::Int4MoE`
(`plugins/int4_moe`). `dequantize_experts` writes them dequantized (value * group scale, exactly as
compressed-tensors defines it) in the output dtype instead, at 4x the bytes (8x in float32).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from builder.hf_checkpoint import DrafterCheckpoint, TargetCheckpoint
from builder.shard_writer import DEFAULT_MAX_BUFFER, ShardWriter
from engines.output_dir import staged_output_dir
from models.checkpoint import DTYPES, CheckpointConfig
from models.layout import (
    EXPERT_PROJECTIONS,
    check_tensor_set,
    expert_spec,
    hf_drafter_specs,
    hf_expert_name,
    hf_target_specs,
    packed_expert_names,
    packed_expert_shapes,
    rank_target_shapes,
    stacked_expert_name,
)
from models.mapping import Mapping

log = logging.getLogger("ddtree.builder")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "tokenization_kimi.py",
    "special_tokens_map.json",
    "generation_config.json",
)


ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def shard(tensor: torch.Tensor, split_dim: int | None, tp_size: int) -> list[torch.Tensor]:
    if split_dim is None:
        return [tensor] * tp_size
    return [piece.contiguous() for piece in torch.chunk(tensor, tp_size, dim=split_dim)]


def resolve_dtype(requested: str, checkpoint_dtype: str) -> str:
    dtype = checkpoint_dtype if requested == "auto" else requested
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    return dtype


def convert(
    model_dir: Path,
    draft_model_dir: Path,
    output_dir: Path,
    tp_size: int,
    dtype: str = "auto",
    force: bool = False,
    max_shard_size: int = DEFAULT_MAX_BUFFER,
    dequantize_experts: bool = False,
) -> CheckpointConfig:
    """Validates both checkpoints completely, then writes the TP-N checkpoint directory a layer at a time."""
    start = time.perf_counter()
    target = TargetCheckpoint(model_dir)
    drafter = DrafterCheckpoint(draft_model_dir)
    mapping = Mapping(tp_size, 0, tp_size)
    packed = not dequantize_experts and _experts_are_int4(target)
    source = None
    if target.quant:
        source = "int4-pack-quantized" if packed else "int4-pack-quantized-dequantized"
    config = CheckpointConfig(
        target=replace(target.config.for_rank(mapping), quantization=target.quant if packed else None),
        drafter=drafter.config.for_rank(mapping),
        dtype=resolve_dtype(dtype, target.dtype),
        tp_size=tp_size,
        source_quantization=source,
    )
    rank_target_shapes(config.target)  # an INT4 split off group boundaries is refused before anything is written
    target_specs = hf_target_specs(config.target)
    drafter_specs = hf_drafter_specs(config.drafter)
    check_tensor_set(target.shapes(), {k: s.shape for k, s in target_specs.items()}, f"target checkpoint {model_dir}")
    check_tensor_set(
        drafter.shapes(), {k: s.shape for k, s in drafter_specs.items()}, f"drafter checkpoint {draft_model_dir}"
    )
    log.info(
        "converting to tp_size=%d dtype=%s%s -> %s",
        tp_size,
        config.dtype,
        f", routed experts INT4 (W4A16, group {target.quant.group_size})" if packed else "",
        output_dir,
    )
    groups = [*_target_groups(target, config), *_drafter_groups(drafter, config)]
    total = sum(size for _, size, _ in groups)
    with staged_output_dir(output_dir, force, protect=(Path(model_dir), Path(draft_model_dir))) as staging:
        writer = ShardWriter(staging, max_shard_size)
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=None) as progress:
            for label, size, write in groups:
                progress.set_postfix_str(label, refresh=False)
                write(writer)
                writer.end_group()
                progress.update(size)
        totals = writer.close()
        (staging / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        _copy_tokenizer(Path(model_dir), staging / "tokenizer")
    seconds = time.perf_counter() - start
    for rank in range(tp_size):
        log.info(
            "rank %d: target %s in %d file(s), drafter %s in %d file(s)",
            rank,
            human_size(totals.get(("target", rank), 0)),
            writer.files("target", rank),
            human_size(totals.get(("drafter", rank), 0)),
            writer.files("drafter", rank),
        )
    log.info(
        "converted %d ranks in %.2f s: read %s (%.2f GB/s), at most %s of converted tensors held at once",
        tp_size,
        seconds,
        human_size(total),
        total / seconds / 1e9,
        human_size(writer.peak_buffered),
    )
    return config


Group = tuple[str, int, Callable[[ShardWriter], None]]


def _target_groups(target: TargetCheckpoint, config: CheckpointConfig) -> list[Group]:
    """The target in write order: the tensors outside layers, then one group per layer (its experts included)."""
    dtype = getattr(torch, config.dtype)
    specs = hf_target_specs(config.target, include_experts=False)
    by_layer: dict[int | None, list[str]] = {}
    for name in specs:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        by_layer.setdefault(layer, []).append(name)

    def dense(names: list[str]) -> Callable[[ShardWriter], None]:
        def write(writer: ShardWriter) -> None:
            for name in names:
                # the routing bias stays float32 whatever the dtype (Kimi ships it so; bf16 can flip near-tied choices)
                kept = torch.float32 if name.endswith(ROUTER_BIAS) else dtype
                for rank, piece in enumerate(shard(target.get(name).to(kept), specs[name].split_dim, config.tp_size)):
                    writer.add("target", rank, name, piece)

        return write

    def layer_group(layer: int) -> Callable[[ShardWriter], None]:
        def write(writer: ShardWriter) -> None:
            dense(by_layer[layer])(writer)
            if config.target.is_moe_layer(layer):
                for proj in EXPERT_PROJECTIONS:
                    _write_experts(writer, target, config, layer, proj, dtype)

        return write

    groups: list[Group] = [("embeddings and head", _bytes(target, by_layer[None]), dense(by_layer[None]))]
    for layer in range(config.target.num_hidden_layers):
        names = list(by_layer[layer])
        if config.target.is_moe_layer(layer):
            names += [
                hf_expert_name(layer, e, proj)
                for e in range(config.target.n_routed_experts)
                for proj in EXPERT_PROJECTIONS
            ]
        groups.append((f"layer {layer}", _bytes(target, names), layer_group(layer)))
    return groups


def _experts_are_int4(target: TargetCheckpoint) -> bool:
    cfg = target.config
    return bool(target.quant) and all(
        target.is_int4(hf_expert_name(layer, e, proj))
        for layer in range(cfg.num_hidden_layers)
        if cfg.is_moe_layer(layer)
        for e in range(cfg.n_routed_experts)
        for proj in EXPERT_PROJECTIONS
    )


def _write_experts(writer, target, config, layer: int, proj: str, dtype: torch.dtype) -> None:
    """One projection of a layer's routed experts, stacked per rank [E, out, in] (filled in place: no copies); kept
    INT4, the packed words and the scales are stacked and cut the same way (columns of down_proj: whole groups)."""
    tp, experts = config.tp_size, config.target.n_routed_experts
    spec = expert_spec(config.target, proj)
    if config.target.quantization:
        stacks = None  # [packed, scale][rank]: [E, out, in / 8] int32 and [E, out, in / group] as stored
        for e in range(experts):
            tensors = target.get_int4(hf_expert_name(layer, e, proj))
            if stacks is None:
                shapes = packed_expert_shapes(config.target, proj)
                stacks = [[torch.empty(shape, dtype=t.dtype) for _ in range(tp)] for shape, t in zip(shapes, tensors)]
            for stack, tensor in zip(stacks, tensors):
                for rank, piece in enumerate(torch.chunk(tensor, tp, dim=spec.split_dim)):
                    stack[rank][e].copy_(piece)
        for name, stack in zip(packed_expert_names(layer, proj), stacks):
            for rank in range(tp):
                writer.add("target", rank, name, stack[rank])
        return
    stacked = [torch.empty((experts, *spec.shard_shape(tp)), dtype=dtype) for _ in range(tp)]
    for e in range(experts):
        for rank, piece in enumerate(torch.chunk(target.get(hf_expert_name(layer, e, proj)), tp, dim=spec.split_dim)):
            stacked[rank][e].copy_(piece)
    for rank in range(tp):
        writer.add("target", rank, stacked_expert_name(layer, proj), stacked[rank])


def _drafter_groups(drafter: DrafterCheckpoint, config: CheckpointConfig) -> list[Group]:
    dtype = getattr(torch, config.dtype)
    specs = hf_drafter_specs(config.drafter)
    tp = config.tp_size

    def write(writer: ShardWriter) -> None:
        writer.flush()  # the target's last shards stay the target's
        for name, spec in specs.items():
            pieces = shard(drafter.get(name).to(dtype), spec.split_dim, spec.pieces(tp))
            for rank in range(tp):
                writer.add(
                    "drafter", rank, name, pieces[spec.rank_piece(rank, tp) if spec.split_dim is not None else 0]
                )

    return [("drafter", _bytes(drafter, list(specs)), write)]


def _bytes(checkpoint, names: list[str]) -> int:
    return sum(checkpoint.nbytes(name) for name in names)


def human_size(size: float) -> str:
    """Bytes in decimal units (1.08 MB), as the conversion log and the runner's errors print them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError


def _copy_tokenizer(model_dir: Path, destination: Path) -> None:
    found = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not found:
        log.warning("no tokenizer files in %s; the runner will need --tokenizer_dir", model_dir)
        return
    destination.mkdir(parents=True, exist_ok=True)
    for path in found:
        shutil.copy2(path, destination / path.name)
