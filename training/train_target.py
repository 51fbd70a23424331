"""Trains the pair's target (`training/pair.py`) on the prepared stdlib tokens; writes an HF checkpoint.

    python -m training.data out/train-data
    python -m training.train_target --data out/train-data --output_dir out/trained/kimi-k2-py [--steps auto]

Next-token cross-entropy on random 512-token windows, AdamW, bf16 autocast on GPUs (float32 weights), the routers
balanced by DeepSeek-V3's loss-free bias update. The checkpoint (bf16, router in fp32) carries the data's
tokenizer and `training.json`: the arguments, steps, time, losses and the held-out perplexity.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.output_dir import staged_output_dir
from training import loop
from training.data import load_split
from training.model import balance_routers, build_models, save_checkpoint, target_forward, target_hf_state
from training.pair import drafter_config, target_config


@torch.no_grad()
def heldout_perplexity(target, windows: torch.Tensor, device) -> float:
    target.eval()
    total, count = 0.0, 0
    for chunk in windows.split(16):
        with loop.autocast(device):
            logits, _, _ = target_forward(target, chunk)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1),
                               reduction="sum")  # fmt: skip
        total, count = total + float(loss), count + chunk[:, 1:].numel()
    target.train()
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop.add_arguments(parser, steps=3000, lr=2e-3, batch=64)
    parser.add_argument("--balance_rate", type=float, default=1e-3, help="router bias update per step")
    args = loop.start(parser, argv)
    device = torch.device(args.device)
    data = Path(args.data)
    batches = loop.Batches(load_split(data, "train"), args.batch, args.seq_len, args.seed, device)
    heldout = loop.heldout_windows(load_split(data, "heldout"), args.seq_len, 256, device)
    hf_config = target_config()
    target, _ = build_models(hf_config, drafter_config(), device)
    target.train()

    def step(_: int) -> torch.Tensor:
        ids = batches.next()
        with loop.autocast(device):
            logits, _, counts = target_forward(target, ids)
        balance_routers(target, counts, args.balance_rate)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    record = loop.run(step, list(target.named_parameters()), args, warmup=200, log=logging.info)
    record["heldout_perplexity"] = round(heldout_perplexity(target, heldout, device), 3)
    record["heldout_tokens"] = int(heldout[:, 1:].numel())
    logging.info("held-out perplexity %.3f over %d tokens", record["heldout_perplexity"], record["heldout_tokens"])
    record = loop.describe_run(record, "training.train_target", argv, args)
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} | {"do_sample": False}
    with staged_output_dir(Path(args.output_dir), args.force) as out:
        extra = {"generation_config.json": generation, "training.json": record}
        save_checkpoint(out, target_hf_state(target), hf_config, extra)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(data / "tokenizer" / name, out / name)
    logging.info("wrote %s", args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
