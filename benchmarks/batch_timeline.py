"""Where a batched job's GPU time goes: its steps, its admissions and the GPU's idle time between them.

    PYTHONPATH=. python3 benchmarks/batch_timeline.py OUT_DIR [--requests 64] [--slots 16] [--tokens 128]
        [--modes ar,8,8+profile] [--engine DIR] (ar: autoregressive, auto, or a tree budget; +profile, +lone, +group,
        +eager, +lazy, +serial, +ahead, +stepwise, +route, +router64: the switches of benchmarks/batch_policy.py)
        [--profile-steps]

The trained pair's engine as `benchmarks/concurrency.py` builds it (bf16 on a GPU), in process through the rank factory
with the benchmarks' `Probes(record_events=True)`: the batch records CUDA events around each of its calls (a step, an
admission's prefill, its requests' loads, a request's move to a lower slot; `BatchLoop.timed`). One warm-up job, then
one job a mode of `--requests` held-out prompts through `--slots` slots (each request joining as one leaves), what the
CLI's `--max_batch_size` runs. For each job: tokens/s and a digest of every request's tokens; each kind of call's
count (steps by their slots and batch-wide budget, admissions by their number of requests), its GPU span (start to end
event: the work it queued; a step's ends before its tokens' copy is waited on) and the host's wall time of the
Batcher's steps; and the GPU's idle time before each kind (from the previous call's end to its start: the host's work
between them, its waits included). The timeline on GPUs only (events time graph replays; `--device cpu` runs the
jobs). `--profile-steps`: after each job, the graphs of its steps over every slot, each replayed under the profiler
(`profile_forward.graph_replay_profile`: kernels by name, the GPU's idle time between them) and back to back, the
slots' state put back after. Writes OUT_DIR/batch_timeline.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import concurrency  # noqa: E402
from benchmarks.common import environment  # noqa: E402


def timeline(events: list[tuple]) -> dict:
    """Per kind of call: count, GPU span (ms: sum, median) and the GPU idle before it (ms: sum, median); the whole
    timeline's span and idle share. events: (kind, start, end) CUDA events in order, already completed."""
    kinds: dict[str, dict] = {}
    idle_total = 0.0
    for i, (kind, start, end) in enumerate(events):
        entry = kinds.setdefault(kind, {"count": 0, "span": [], "idle_before": []})
        entry["count"] += 1
        entry["span"].append(start.elapsed_time(end))
        if i:
            gap = max(events[i - 1][2].elapsed_time(start), 0.0)
            entry["idle_before"].append(gap)
            idle_total += gap
    whole = events[0][1].elapsed_time(events[-1][2]) if events else 0.0
    summary = {}
    for kind, entry in kinds.items():
        summary[kind] = {"count": entry["count"], "span_ms": round(sum(entry["span"]), 2),
                         "span_ms_median": round(statistics.median(entry["span"]), 4),
                         "idle_before_ms": round(sum(entry["idle_before"]), 2),
                         "idle_before_ms_median": round(statistics.median(entry["idle_before"]), 4)
                         if entry["idle_before"] else None}  # fmt: skip
    return {
        "kinds": summary,
        "timeline_ms": round(whole, 2),
        "idle_ms": round(idle_total, 2),
        "idle_share": round(idle_total / whole, 4) if whole else None,
    }


def profile_steps(batch, slots: int) -> dict:
    """Each captured step graph over `slots` slots (`BatchLoop.graphs`), profiled over replays and timed back to back
    (`profile_forward`); every slot's state is put back after each (the replays step the slots' last requests on)."""
    from benchmarks.profile_forward import back_to_back_us, graph_replay_profile, print_replay_profile
    from runner.device.budget import DECODE

    rows = {}
    for key, graph in list(batch.graphs.items()):
        if key[0] == "flush":  # ("flush", count): before a tree step, more than a block of pending rows committed
            count, name = key[1], "flush"
        else:
            count, _, budget, report, width, append = key
            name = "autoregressive" if batch.autoregressive or budget == DECODE else f"budget {budget or 'per slot'}"
            name += (f" committing {width} rows" if width else "") + (" append" if append else "")
            name += " statistics" if report else ""
        if count != slots:
            continue
        with batch.state_kept(slots):
            prof = graph_replay_profile(graph.replay)
            prof["back_to_back_us"] = back_to_back_us(graph.replay, 8)
        print_replay_profile(f"{slots} slots, {name}", None, prof)
        rows[name] = prof
    return rows


def run_mode(engine: Path, mode: str, prompts: list[list[int]], tokens: int, slots: int, device: str,
             profile: bool = False) -> dict:  # fmt: skip
    """One job in `mode` (its `+NAME` switches set in this process's environment while its ranks run)."""
    from benchmarks.batch_policy import switched

    base, switches, env = switched(mode, "--modes")
    with mock.patch.dict(os.environ, env):
        row = _run_mode(engine, base, prompts, tokens, slots, device, profile)
    row["mode"] = " ".join([row["mode"], *switches])
    return row


def _run_mode(engine: Path, mode: str, prompts: list[list[int]], tokens: int, slots: int, device: str,
              profile: bool = False) -> dict:  # fmt: skip
    import torch

    from engines.engine_dir import load_engine_dir
    from engines.spec import SpecConfig
    from runner.factory import RankOptions, local_ranks
    from runner.generator import Generator
    from runner.probes import Probes
    from runner.sampling import SamplingParams

    autoregressive, auto = mode == "ar", mode == "auto"
    loaded = load_engine_dir(engine)
    base = loaded.spec
    if auto:  # as the CLI's --ddtree_budget auto: every budget the engine verifies, one chosen a step
        spec = SpecConfig(base.block_size, max(base.budgets), base.max_topk, extra_budgets=base.budgets)
    else:
        spec = base if autoregressive else base.with_budget(int(mode))
    options = RankOptions("torch", device, True, autoregressive, Probes(record_events=True), max_batch_size=slots)
    ranks = local_ranks(loaded, options, spec)
    generator = Generator(ranks, autoregressive)
    if auto:
        generator.enable_auto_budget()
    generator.warm_up((SamplingParams(),))
    batch = ranks.lead.batch
    params = [SamplingParams()] * len(prompts)
    generator.generate_many(prompts[:slots], tokens, params[:slots])  # a first job: graphs of every slot count
    timed = batch.events is not None  # GPUs: events around graph replays
    if timed:
        torch.cuda.synchronize()
        batch.events.clear()
    started = time.perf_counter()
    results = generator.generate_many(prompts, tokens, params)
    if timed:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    batcher = generator.last_batcher
    emitted = sum(len(r.tokens) for r in results)
    name = "autoregressive" if autoregressive else f"DDTree {mode}"
    row = {"mode": name, "requests": len(prompts),
           "slots": slots, "tokens": emitted, "seconds": round(wall, 4), "tokens_per_s": round(emitted / wall, 1),
           "step_wall_ms_median": round(statistics.median(batcher.step_times) * 1e3, 4),
           "step_wall_ms_sum": round(sum(batcher.step_times) * 1e3, 2),
           "outputs_sha1": hashlib.sha1(json.dumps([r.tokens for r in results]).encode()).hexdigest()[:12],
           "admissions": batcher.admission_summary(), "moves": batcher.moves,
           **timeline(batch.events if timed else [])}  # fmt: skip
    if auto and generator.batch_policy is not None:  # the batch's choices: steps and median ms by slots and budget
        row["policy"] = generator.batch_policy.summary()
    if profile and timed:
        row["step_profiles"] = profile_steps(batch, slots)
    ranks.close()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", default="ar,8,8+profile", help="comma-separated: ar, auto or a budget")
    parser.add_argument("--engine", type=Path, help="an engine directory built as concurrency.py builds it")
    parser.add_argument("--device", default="cuda", help="cpu: the jobs without a timeline (a check of the script)")
    parser.add_argument("--smoke", action="store_true", help="the tiny demo checkpoints (no trained weights needed)")
    parser.add_argument("--profile-steps", action="store_true", help="the kernels of each job's steps over every slot")
    args = parser.parse_args(argv)
    from engines.engine_dir import load_engine_dir
    from runner.tokenizer import load_tokenizer

    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = args.engine or concurrency.build_engine(args.out_dir, args.smoke, dtype)
    tokenizer = load_tokenizer(load_engine_dir(engine).tokenizer_dir, 1 << 20)
    prompts = [tokenizer.encode(t) for t in concurrency.prompts(args.requests, args.smoke)]
    rows = []
    for mode in args.modes.split(","):
        row = run_mode(engine, mode, prompts, args.tokens, args.slots, args.device, args.profile_steps)
        rows.append(row)
        steps = {k: v for k, v in row["kinds"].items() if k.startswith("step")}
        calls = {k: v for k, v in row["kinds"].items() if not k.startswith("step")}
        if steps:  # every step together, then the others by kind
            calls["steps"] = {"count": sum(v["count"] for v in steps.values()),
                              "span_ms": round(sum(v["span_ms"] for v in steps.values()), 2),
                              "idle_before_ms": round(sum(v["idle_before_ms"] for v in steps.values()), 2)}  # fmt: skip
        kinds = ", ".join(f"{k} {v['count']}x span {v['span_ms']} ms idle before {v['idle_before_ms']} ms"
                          for k, v in calls.items())  # fmt: skip
        print(f"{row['mode']}: {row['tokens_per_s']} tokens/s, {row['seconds']} s; GPU timeline {row['timeline_ms']} "
              f"ms, idle {row['idle_ms']} ms ({row['idle_share'] or 0:.1%}); {kinds}; step wall median "
              f"{row['step_wall_ms_median']} ms", flush=True)  # fmt: skip
    out = {"environment": environment(args.device != "cuda"), "command": " ".join(sys.argv), "rows": rows}
    (args.out_dir / "batch_timeline.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
