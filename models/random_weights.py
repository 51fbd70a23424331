"""Random weights with the scales of a trained model (activations O(1), peaked logits), for the demo checkpoints
and for benchmarks that build models directly on a GPU."""

from __future__ import annotations

import torch

from models.rope import Rotary


def random_weight(
    name: str, shape: tuple[int, ...], gen: torch.Generator, device="cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    def normal():
        return torch.randn(shape, generator=gen, device=device)

    if name.endswith("weight_packed"):  # INT4 experts: random words (values -8..7, std ~4.6 before the scale)
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen, device=device)
    if name.endswith("weight_scale"):  # one scale a group of 32 inputs (Kimi's): std ~ 1 / sqrt(fan-in) dequantized
        fan_in = shape[-1] * 32
        return torch.full(shape, 1.0 / (4.6 * fan_in**0.5), device=device).to(dtype)
    if name.endswith("e_score_correction_bias"):
        value = (torch.rand(shape, generator=gen, device=device) - 0.5) * 0.2
    elif len(shape) == 1:  # RMSNorm weights
        value = 1.0 + 0.1 * normal()
    elif name.endswith("embed_tokens.weight"):
        value = normal()
    elif name.endswith("lm_head.weight"):
        value = normal() * (4.0 / shape[1] ** 0.5)  # logits with std ~4: peaked, not uniform
    else:
        value = normal() / shape[-1] ** 0.5
    return value.to(dtype).contiguous()


def random_state(shapes: dict[str, tuple[int, ...]], seed: int, device="cpu", dtype=torch.float32) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: random_weight(name, shape, gen, device, dtype) for name, shape in shapes.items()}


def router_in_fp32(state: dict) -> dict:
    """The MoE router (`mlp.gate.weight`, `e_score_correction_bias`) stays fp32, as transformers keeps it."""
    return {k: v.float() if "mlp.gate." in k else v for k, v in state.items()}


def random_rank_models(target_cfg, drafter_cfg, ops, device, dtype: torch.dtype, seed: int = 0):
    """One rank's target and drafter with random weights, built directly on `device`."""
    from models.dflash import DFlashDrafter
    from models.kimi import KimiTarget
    from models.layers import prepare_weights
    from models.layout import rank_drafter_shapes, rank_target_shapes

    with torch.device("meta"):
        target = KimiTarget(target_cfg, drafter_cfg.target_layer_ids, ops)
        drafter = DFlashDrafter(drafter_cfg, target_cfg, ops)
    target_state = router_in_fp32(random_state(rank_target_shapes(target_cfg), seed, device, dtype))
    target.load_state_dict(target_state, strict=True, assign=True)
    drafter_state = random_state(rank_drafter_shapes(drafter_cfg), seed + 1, device, dtype)
    drafter_state["embed_tokens.weight"] = target_state["model.embed_tokens.weight"]
    drafter_state["lm_head.weight"] = target_state["lm_head.weight"]
    drafter.load_state_dict(drafter_state, strict=True, assign=True)
    for module in (target, drafter):
        for sub in module.modules():
            if isinstance(sub, Rotary):
                sub.rebuild(device)
        module.eval().requires_grad_(False)
        prepare_weights(module)
    return target, drafter
