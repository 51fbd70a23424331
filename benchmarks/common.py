"""What the benchmark programs share: one timing helper (a CUDA graph's median replay), the copy and matrix ceilings,
the environment block every result file carries, and the ranks every end-to-end row runs, built by the rank
factory (`runner/factory.py`) exactly as the CLI builds them."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from engines.spec import BuildConfig, SpecConfig
from runner.factory import PresetWeights, RankOptions, local_ranks
from runner.generator import Generator
from runner.probes import Probes

BUILD = BuildConfig(max_input_len=128, max_seq_len=1024, dtype="bfloat16")


@dataclass(frozen=True)
class Setup:
    """Where and how a benchmark runs: `--smoke` is tiny shapes on the CPU in float32 (checks the script)."""

    smoke: bool
    device: torch.device
    dtype: torch.dtype
    repeats: int = 3

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Setup:
        if args.smoke:
            return cls(True, torch.device("cpu"), torch.float32, args.repeats)
        return cls(False, torch.device("cuda"), torch.bfloat16, args.repeats)


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")


def preset_ranks(weights: PresetWeights, setup: Setup, spec: SpecConfig, device_loop: bool,
                 autoregressive: bool = False, probes: Probes | None = None,
                 limits: BuildConfig = BUILD, max_batch_size: int = 1) -> Generator:  # fmt: skip
    """One rank of a preset through the rank factory (the CLI's path), and rank 0's generator over it; `limits`:
    the prompt and sequence lengths the ranks are built for (their caches' capacity); max_batch_size: slots for
    in-flight batching (`runner/device/batch.py`)."""
    options = RankOptions("torch", setup.device.type, device_loop, autoregressive, probes,
                          max_batch_size=max_batch_size)  # fmt: skip
    build = BuildConfig(limits.max_input_len, limits.max_seq_len, dtype=str(setup.dtype).removeprefix("torch."))
    return Generator(local_ranks(weights, options, spec, build), autoregressive)


FLUSHES = ("write", "read", "none")


def graph_time_us(fn, device: torch.device, smoke: bool, flush: str = "write") -> float:
    """Median time of fn captured in one CUDA graph and replayed (warm-up, then 100 replays, the L2 flushed before
    each as `flush` says; see `replay_time_us`); on the CPU one eager call."""
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from runner.sessions.cuda_graphs import capture_graph

    graph, _ = capture_graph(fn, device, warmups=2)
    return replay_time_us(graph.replay, flush)


def replay_time_us(replay, flush: str = "write", reps: int = 100, warmup: int = 10) -> float:
    """Median of `reps` timed calls of `replay` (CUDA events around each call alone), the L2 cache flushed before
    each by a 256 MiB pass, not timed:
      write  zeroes the buffer, as triton.testing.do_bench does: the L2 is left full of dirty lines, so the timed
             call's reads evict them and DRAM also takes their write-back (about one byte written a byte read);
      read   reads it (a max over it): the L2 is left holding clean lines, as in a forward where the kernel before
             read weights;
      none   no flush: what the last call left in the L2 stays (warm data for anything smaller than the L2); the
             GPU spins for about 50 us instead, so the call is queued before the GPU reaches it (else a call shorter
             than its launch on the host measures the launch)."""
    if flush not in FLUSHES:
        raise ValueError(f"flush: expected one of {FLUSHES}, got {flush!r}")
    buffer = torch.ones(64 << 20, dtype=torch.int32, device="cuda")  # 256 MiB, five times an H200's L2
    passes = {"write": buffer.zero_, "read": buffer.max, "none": lambda: torch.cuda._sleep(100_000)}
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(warmup + reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(warmup + reps)]
    for start, end in zip(starts, ends):
        passes[flush]()
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts[warmup:], ends[warmup:])) * 1e3


def measure_ceilings(smoke: bool) -> dict:
    """Device-to-device copy rate (bytes read + written) and the bf16 matrix rate, measured now."""
    if smoke:
        return {"copy_Bps": 1e10, "bf16_flops": 1e11}
    import triton.testing

    n = 1 << 30
    src, dst = torch.randn(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_Bps": 2 * n * 2 / copy_ms * 1e3, "bf16_flops": 2 * 8192**3 / mm_ms * 1e3}


def environment(smoke: bool) -> dict:
    """Hardware, versions and date: the head of every result file (the commit, where the caller sets
    DDTREE_COMMIT: a copy of the source tree may not carry its git history)."""
    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
            "commit": os.environ.get("DDTREE_COMMIT")}  # fmt: skip
    if smoke or not torch.cuda.is_available():
        return {**info, "gpu": "none: the CPU" + (" (smoke)" if smoke else ""), "cpus": os.cpu_count()}
    import triton

    return {**info, "gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "triton": triton.__version__}  # fmt: skip


def tree_mask(tokens: int, device) -> torch.Tensor:
    """A fixed random tree's ancestor-or-self mask (each node's parent drawn among the earlier ones)."""
    gen = torch.Generator().manual_seed(tokens)
    mask = torch.eye(tokens, dtype=torch.bool)
    for node in range(1, tokens):
        mask[node] |= mask[int(torch.randint(0, node, (1,), generator=gen))]
    return mask.to(device)


def first_difference(tokens, reference) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
