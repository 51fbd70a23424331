"""Per-rank torch modules from a converted checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from models.checkpoint import CheckpointConfig, load_rank_weights
from models.dflash import DFlashDrafter
from models.kimi import KimiTarget
from models.layers import prepare_weights
from models.ops import ModelOps
from models.rope import Rotary


def load_rank_models(
    checkpoint_dir: Path, rank: int, ops: ModelOps, device: str | torch.device = "cpu"
) -> tuple[CheckpointConfig, KimiTarget, DFlashDrafter]:
    """Builds rank `rank`'s target and drafter in the forms `ops` names; weights keep the checkpoint's dtype."""
    config, target_weights, drafter_weights = load_rank_weights(checkpoint_dir, rank)
    target_cfg, drafter_cfg = config.rank_configs(rank)
    with torch.device("meta"):
        target = KimiTarget(target_cfg, drafter_cfg.target_layer_ids, ops)
        drafter = DFlashDrafter(drafter_cfg, target_cfg, ops)
    target.load_state_dict(target_weights, strict=True, assign=True)
    _ready(target, device)
    # the drafter borrows the target's embedding and head: the same device tensors, not a second copy
    borrowed = {"embed_tokens.weight": target.model.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
    drafter.load_state_dict({**drafter_weights, **borrowed}, strict=True, assign=True)
    _ready(drafter, device)
    return config, target, drafter


def _ready(module: torch.nn.Module, device) -> None:
    for sub in module.modules():
        if isinstance(sub, Rotary):
            sub.rebuild("cpu")
    module.to(device).eval().requires_grad_(False)
    prepare_weights(module)
