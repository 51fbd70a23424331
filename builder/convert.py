"""HF checkpoints (Kimi target + DFlash drafter) -> TP-N checkpoint directory (`models/checkpoint.py`).

Splits follow `models/layout.py`. INT4 routed experts are dequantized here (value * group scale, exactly as
compressed-tensors defines it) and written in the output dtype: engines carry plain bf16/fp32 expert weights.
That costs 4x the expert storage of the INT4 original; keeping them packed needs a W4A16 MoE plugin (not built).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from builder.hf_checkpoint import DrafterCheckpoint, TargetCheckpoint
from engines.output_dir import staged_output_dir
from models.checkpoint import DTYPES, CheckpointConfig, rank_file
from models.layout import (
    EXPERT_PROJECTIONS,
    check_tensor_set,
    expert_spec,
    hf_drafter_specs,
    hf_expert_name,
    hf_target_specs,
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
    model_dir: Path, draft_model_dir: Path, output_dir: Path, tp_size: int, dtype: str = "auto", force: bool = False
) -> CheckpointConfig:
    """Validates both checkpoints completely, then writes the TP-N checkpoint directory."""
    start = time.perf_counter()
    target = TargetCheckpoint(model_dir)
    drafter = DrafterCheckpoint(draft_model_dir)
    mapping = Mapping(tp_size, 0, tp_size)
    config = CheckpointConfig(
        target=target.config.for_rank(mapping),
        drafter=drafter.config.for_rank(mapping),
        dtype=resolve_dtype(dtype, target.dtype),
        tp_size=tp_size,
        source_quantization="int4-pack-quantized-dequantized" if target.quant else None,
    )
    target_specs = hf_target_specs(config.target)
    drafter_specs = hf_drafter_specs(config.drafter)
    check_tensor_set(target.shapes(), {k: s.shape for k, s in target_specs.items()}, f"target checkpoint {model_dir}")
    check_tensor_set(
        drafter.shapes(), {k: s.shape for k, s in drafter_specs.items()}, f"drafter checkpoint {draft_model_dir}"
    )
    log.info("converting to tp_size=%d dtype=%s -> %s", tp_size, config.dtype, output_dir)
    with staged_output_dir(output_dir, force, protect=(Path(model_dir), Path(draft_model_dir))) as staging:
        torch_dtype = getattr(torch, config.dtype)
        ranks = _shard_target(target, config, torch_dtype)
        for rank, tensors in enumerate(ranks):
            _save(tensors, rank_file(staging, "target", rank))
        ranks = [{} for _ in range(tp_size)]
        for name, spec in drafter_specs.items():
            pieces = shard(drafter.get(name).to(torch_dtype), spec.split_dim, spec.pieces(tp_size))
            for rank in range(tp_size):
                ranks[rank][name] = pieces[spec.rank_piece(rank, tp_size) if spec.split_dim is not None else 0]
        for rank, tensors in enumerate(ranks):
            _save(tensors, rank_file(staging, "drafter", rank))
        (staging / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        _copy_tokenizer(Path(model_dir), staging / "tokenizer")
    log.info("converted %d ranks in %.2f s", tp_size, time.perf_counter() - start)
    return config


def _shard_target(target: TargetCheckpoint, config: CheckpointConfig, dtype: torch.dtype) -> list[dict]:
    tp = config.tp_size
    ranks: list[dict] = [{} for _ in range(tp)]
    for name, spec in hf_target_specs(config.target, include_experts=False).items():
        # the routing bias stays float32 whatever the dtype (Kimi ships it so; bf16 can flip near-tied expert choices)
        kept = torch.float32 if name.endswith(ROUTER_BIAS) else dtype
        for rank, piece in enumerate(shard(target.get(name).to(kept), spec.split_dim, tp)):
            ranks[rank][name] = piece
    for layer in range(config.target.num_hidden_layers):
        if not config.target.is_moe_layer(layer):
            continue
        for proj in EXPERT_PROJECTIONS:
            split_dim = expert_spec(config.target, proj).split_dim
            pieces = [
                shard(target.get(hf_expert_name(layer, e, proj)).to(dtype), split_dim, tp)
                for e in range(config.target.n_routed_experts)
            ]  # pieces[expert][rank]
            for rank in range(tp):
                ranks[rank][stacked_expert_name(layer, proj)] = torch.stack([p[rank] for p in pieces])
    return ranks


def _save(tensors: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_tokenizer(model_dir: Path, destination: Path) -> None:
    found = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not found:
        log.warning("no tokenizer files in %s; the runner will need --tokenizer_dir", model_dir)
        return
    destination.mkdir(parents=True, exist_ok=True)
    for path in found:
        shutil.copy2(path, destination / path.name)
