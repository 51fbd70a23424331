"""Trains the pair's DFlash drafter on the frozen trained target's hidden states; writes an HF checkpoint.

    python -m training.train_drafter --data out/train-data --target_dir out/trained/kimi-k2-py \\
        --output_dir out/trained/kimi-k2-py-dflash [--steps auto]

DFlash's block objective: in every 512-token window, --blocks anchors a (random, 1 <= a <= L - 8); the block holds
the token at a and mask tokens after it, sees the target's tapped hidden states of every position < a, and learns
the target's own next-token distributions at a+1 .. a+7 (cross-entropy against the target's probabilities, the
block's positions weighted exp(-(i - 1) / 4) as the DFlash paper weights them). The target, its embedding and its
head stay frozen. `training.json` records the held-out top-1 agreement with the target per block position and the
chain acceptance length it implies (teacher-forced, on held-out text).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from engines.output_dir import staged_output_dir
from models.config import DrafterConfig
from training import loop
from training.data import load_split
from training.model import (
    build_models,
    drafter_forward,
    drafter_hf_state,
    load_target_hf,
    save_checkpoint,
    target_forward,
)
from training.pair import drafter_config


def anchors(batch: int, blocks: int, length: int, size: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randint(1, length - size + 1, (batch, blocks), generator=gen).to(device)


def targets(logits: torch.Tensor, ids: torch.Tensor, where: torch.Tensor, size: int):
    """The target's distribution logits and the text's tokens for block rows 1 .. size - 1: [B, K, size - 1, ...]."""
    rows = where[..., None] + torch.arange(1, size, device=where.device)  # positions a+1 .. a+size-1
    flat = rows.reshape(rows.shape[0], -1)
    target_logits = logits.gather(1, (flat - 1)[..., None].expand(-1, -1, logits.shape[-1]))
    return target_logits.view(*rows.shape, -1), ids.gather(1, flat).view(rows.shape)


@torch.no_grad()
def heldout_agreement(target, drafter, cfg: DrafterConfig, windows, device, gen) -> dict:
    """Top-1 agreement of drafter and target per block position on held-out text, and E[accepted] of the chain
    (the mean over blocks of the longest agreeing prefix)."""
    drafter.eval()
    size, hits, runs, count = cfg.block_size, 0, 0.0, 0
    for chunk in windows.split(16):
        where = anchors(chunk.shape[0], 16, chunk.shape[1], size, gen, device)
        with loop.autocast(device):
            logits, taps, _ = target_forward(target, chunk)
            draft = drafter_forward(drafter, cfg, taps, chunk, where)
        target_logits, _ = targets(logits, chunk, where, size)
        agree = draft.argmax(-1) == target_logits.argmax(-1)  # [B, K, size - 1]
        hits = hits + agree.sum(dim=(0, 1)).double()
        runs += float(agree.int().cumprod(-1).sum())
        count += agree.shape[0] * agree.shape[1]
    drafter.train()
    per_position = (hits / count).tolist()
    return {"top1_agreement_by_position": [round(p, 4) for p in per_position],
            "chain_accepted_mean": round(runs / count, 3), "blocks": count}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop.add_arguments(parser, steps=2000, lr=1e-3, batch=64)
    parser.add_argument("--target_dir", required=True, help="the trained target's HF checkpoint")
    parser.add_argument("--blocks", type=int, default=32, help="anchored blocks per window")
    args = loop.start(parser, argv)
    if not (Path(args.target_dir) / "config.json").is_file():
        parser.error(f"--target_dir {args.target_dir} holds no config.json: train the target first "
                     "(`python -m training.train_target`)")  # fmt: skip
    device, data, target_dir = torch.device(args.device), Path(args.data), Path(args.target_dir)
    target_hf = json.loads((target_dir / "config.json").read_text())
    hf_config = drafter_config()
    cfg = DrafterConfig.from_hf(hf_config)
    target, drafter = build_models(target_hf, hf_config, device)
    load_target_hf(target, target_dir)
    target.eval().requires_grad_(False)
    batches = loop.Batches(load_split(data, "train"), args.batch, args.seq_len, args.seed + 1, device)
    heldout = loop.heldout_windows(load_split(data, "heldout"), args.seq_len, 128, device)
    gen = torch.Generator().manual_seed(args.seed + 2)
    size = cfg.block_size
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32, device=device) / 4.0)
    drafter.train()

    def step(_: int) -> torch.Tensor:
        ids = batches.next()
        where = anchors(ids.shape[0], args.blocks, ids.shape[1], size, gen, device)
        with loop.autocast(device):
            with torch.no_grad():
                logits, taps, _ = target_forward(target, ids)
            draft = drafter_forward(drafter, cfg, taps, ids, where)
        target_logits, _ = targets(logits, ids, where, size)
        probs = torch.softmax(target_logits.float(), dim=-1)
        per_row = -(probs * torch.log_softmax(draft.float(), dim=-1)).sum(-1)  # [B, K, size - 1]
        return (per_row * weights).sum(-1).mean() / weights.sum()

    params = [(n, p) for n, p in drafter.named_parameters() if n not in ("embed_tokens.weight", "lm_head.weight")]
    record = loop.run(step, params, args, warmup=100, log=logging.info)
    record["heldout"] = heldout_agreement(target, drafter, cfg, heldout, device, torch.Generator().manual_seed(7))
    logging.info("held-out: %s", record["heldout"])
    record = loop.describe_run(record, "training.train_drafter", argv, args)
    with staged_output_dir(Path(args.output_dir), args.force) as out:
        save_checkpoint(out, drafter_hf_state(drafter, cfg), hf_config, {"training.json": record})
    logging.info("wrote %s", args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
