"""What the two training commands share: arguments, batches, the optimiser and its schedule, the step count."""

from __future__ import annotations

import argparse
import logging
import math
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch


def add_arguments(parser: argparse.ArgumentParser, steps: int, lr: float, batch: int) -> None:
    parser.add_argument("--data", required=True, help="the folder `python -m training.data` wrote")
    parser.add_argument("--output_dir", required=True, help="where the HF checkpoint goes")
    what = "optimiser steps, or 'auto': as many as fit --minutes, timed on the first steps"
    parser.add_argument("--steps", default=str(steps), help=what)
    parser.add_argument("--minutes", type=float, default=4.0, help="--steps auto: the training time to fill")
    parser.add_argument("--batch", type=int, default=batch, help="sequences a step")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--force", action="store_true", help="replace an existing --output_dir")


class Batches:
    """Random windows of seq_len tokens from a token array, from a seeded generator (the same batches every run)."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int, device):
        if tokens.size <= seq_len + 1:
            raise ValueError(f"the data has {tokens.size} tokens, fewer than one window of --seq_len {seq_len} + 1")
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.batch, self.seq_len = batch, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch,), generator=self.gen)
        index = starts.to(self.tokens.device)[:, None] + torch.arange(self.seq_len, device=self.tokens.device)
        return self.tokens[index]


def heldout_windows(tokens: np.ndarray, seq_len: int, limit: int, device) -> torch.Tensor:
    """Non-overlapping windows from the start of the held-out tokens: [n, seq_len]."""
    n = min(limit, tokens.size // seq_len)
    return torch.from_numpy(tokens[: n * seq_len].astype(np.int64)).view(n, seq_len).to(device)


@dataclass
class Schedule:
    """Linear warm-up, then cosine to 10 % of the peak."""

    lr: float
    warmup: int
    steps: int = 0

    def at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(named_params, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms, biases and embeddings."""
    decay, plain = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        (plain if param.dim() < 2 or "embed_tokens" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available())


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def run(step_fn, params, args, warmup: int, log) -> dict:
    """Runs `step_fn(step) -> loss tensor` under the schedule; --steps auto times the warm-up's steps 5..25 (the
    warm-up does not depend on the total, so a run with the printed --steps repeats this one). Returns the record."""
    opt = optimizer(params, args.lr)
    schedule = Schedule(args.lr, warmup, 0 if args.steps == "auto" else int(args.steps))
    trainable = [p for _, p in params if p.requires_grad]
    losses, start, mark = [], time.perf_counter(), None
    step = 0
    while schedule.steps == 0 or step < schedule.steps:
        for group in opt.param_groups:
            group["lr"] = schedule.at(step)
        loss = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        if schedule.steps == 0 and step in (5, 25):
            if trainable[0].is_cuda:
                torch.cuda.synchronize()
            if step == 5:
                mark = time.perf_counter()
            else:
                per_step = (time.perf_counter() - mark) / 20
                budget = args.minutes * 60 - (time.perf_counter() - start)
                schedule.steps = max(warmup, 25 + int(budget / per_step))
                log(f"{per_step * 1e3:.1f} ms a step: {schedule.steps} steps (re-run with --steps {schedule.steps})")
        if step % 100 == 0 or step == schedule.steps:
            losses.append([step, float(loss.detach())])
            log(f"step {step}/{schedule.steps or '?'}  loss {float(loss.detach()):.4f}  lr {schedule.at(step - 1):.2e}")
    seconds = time.perf_counter() - start
    return {"steps": schedule.steps, "seconds": round(seconds, 1), "losses": losses}


def start(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses the command line, refuses missing data and an existing --output_dir without --force (before any
    training), seeds."""
    from pathlib import Path

    from engines.output_dir import check_output_dir

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    missing = [name for name in ("train.npy", "heldout.npy", "manifest.json") if not (Path(args.data) / name).is_file()]
    if missing:
        parser.error(f"--data {args.data} lacks {', '.join(missing)}: prepare it with `python -m training.data "
                     f"{args.data}`")  # fmt: skip
    try:
        check_output_dir(Path(args.output_dir), args.force)
    except FileExistsError as err:
        parser.error(str(err))
    torch.manual_seed(args.seed)
    return args


def describe_run(record: dict, module: str, argv: list[str] | None, args: argparse.Namespace) -> dict:
    """The run's record for `training.json`: the command, its arguments, the data it read, the environment."""
    import json
    import sys
    from pathlib import Path

    manifest = json.loads((Path(args.data) / "manifest.json").read_text())
    return {
        **record,
        "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "arguments": vars(args),
        "data": {k: manifest[k] for k in ("source", "python", "split", "vocab_size")},
        **environment(torch.device(args.device)),
    }


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "python": platform.python_version()}
