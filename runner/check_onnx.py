"""Checks an engine directory's ONNX graphs against the torch reference at every profile shape.

    mpirun -np N python -m runner.check_onnx ENGINE_DIR      (N = the engine's tp_size; N = 1 runs in-process)

Each rank runs its graphs under ONNX Runtime (custom ops, MPI collectives) and its torch modules (reference
TreeAttention, MPI collectives) on the same inputs, at each profile's smallest and largest size (prefill also at an
odd length in between), and compares every output. Rank 0 prints the table; exit status 1 if any error exceeds the
tolerance.
"""

from __future__ import annotations

import sys

import torch

TOLERANCE = {"float32": 1e-4}


def profile_cases(profiles) -> list[tuple[str, int]]:
    """(profile, size of its dynamic token dim) pairs: min and max of each range, plus one odd size."""
    cases = []
    for name, profile in profiles.items():
        dim = "tokens" if profile.role == "target" else "context"
        low, _, high = profile.dims[dim]
        sizes = sorted({low, high, (low + high) // 2 | 1} if low != high else {low})
        cases += [(name, size) for size in sizes]
    return cases


def make_feeds(inputs, profile, size: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic inputs: replicated tensors equal on all ranks, per-rank tensors (draft cache) differ."""
    gen = torch.Generator().manual_seed(seed)
    dims = {d: (size if d in ("tokens", "context", "logits") else bounds[0]) for d, bounds in profile.dims.items()}
    feeds = {}
    for tensor in inputs:
        shape = tuple(dims[d] if isinstance(d, str) else d for d in tensor.dims)
        if tensor.name == "tree_mask":
            feeds[tensor.name] = _random_tree_mask(size, gen)
        elif tensor.name in ("cache_length", "draft_cache_length"):
            feeds[tensor.name] = torch.tensor([int(torch.randint(0, 40, (1,), generator=gen))])
        elif tensor.name == "context_length":
            feeds[tensor.name] = torch.tensor([max(1, size - 2)])
        elif tensor.name in ("input_ids", "block_ids"):
            feeds[tensor.name] = torch.randint(0, 500, shape, generator=gen)
        elif tensor.dtype == "int64":  # positions, logit_indices
            feeds[tensor.name] = torch.arange(shape[0]) + (40 if "positions" in tensor.name else 0)
        else:
            local = torch.Generator().manual_seed(seed * 100 + rank) if tensor.name == "draft_cache" else gen
            feeds[tensor.name] = torch.randn(shape, generator=local)
    return feeds


def _random_tree_mask(size: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        mask[node] |= mask[parent]
    return mask


def check_rank(engine, rank: int, comm) -> list[tuple[str, int, str, float]]:
    from runner.factory import RankOptions, build_rank

    ort_session = build_rank(engine, rank, RankOptions("ort"), comm=comm).session
    torch_session = build_rank(engine, rank, RankOptions("torch", device="cpu", device_loop=False), comm=comm).session
    profiles, io = engine.profiles, torch_session.io
    rows = []
    for seed, (name, size) in enumerate(profile_cases(profiles)):
        profile = profiles[name]
        feeds = make_feeds(io[profile.role][0], profile, size, rank, seed)
        got, want = ort_session.run(name, feeds), torch_session.run(name, feeds)
        for output, value in want.items():
            error = float((got[output].float() - value.float()).norm() / value.float().norm().clamp_min(1e-30))
            rows.append((name, size, output, error))
    return rows


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from engines.engine_dir import load_engine_dir
    from runner.mpi import run_on_all_ranks

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: mpirun -np N python -m runner.check_onnx ENGINE_DIR", file=sys.stderr)
        return 2

    def run(comm) -> int:
        engine = load_engine_dir(Path(argv[0]))
        engine.check_world_size(comm.Get_size())
        rows = check_rank(engine, comm.Get_rank(), comm)
        every = comm.gather(rows, root=0)
        if comm.Get_rank() != 0:
            return 0
        tolerance = TOLERANCE[engine.build_config.dtype]
        worst = {}
        for rank_rows in every:
            for name, size, output, error in rank_rows:
                key = (name, size, output)
                worst[key] = max(worst.get(key, 0.0), error)
        print(f"ONNX Runtime vs torch reference, {comm.Get_size()} ranks (max relative error over ranks):")
        for (name, size, output), error in worst.items():
            flag = "" if error <= tolerance else "  <-- FAIL"
            print(f"  {name:14s} {size:4d} tokens  {output:15s} {error:.2e}{flag}")
        failed = [k for k, e in worst.items() if e > tolerance]
        print(f"{'FAIL' if failed else 'OK'}: {len(worst) - len(failed)}/{len(worst)} within {tolerance:g}")
        return 1 if failed else 0

    return run_on_all_ranks(run)


if __name__ == "__main__":
    sys.exit(main())
