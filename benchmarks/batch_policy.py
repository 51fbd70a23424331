"""The batch's budget policy next to fixed budgets: what `auto` chose, and what its steps cost, through the CLI.

    PYTHONPATH=. python3 benchmarks/batch_policy.py OUT_DIR [--requests 16] [--slots N] [--tokens 128] [--device cuda]
        [--order auto,8,16,auto] (ar: autoregressive; NAME+eager / NAME+lazy: that job with DDTREE_LAZY_CONTEXT=0 / 1,
        an autoregressive step's drafter row committed at once or left pending (the default); NAME+group: with
        DDTREE_GROUP_ADMISSIONS=1, admissions put off to share them under a backlog; NAME+lone / NAME+profile:
        DDTREE_LONE_AS_GROUP=1 / 0, a lone admission as a group of one, the GPU default, or on the prefill profile;
        NAME+serial: DDTREE_RUN_AHEAD=0, no step queued before the tokens of the one in flight are read; NAME+ahead /
        NAME+stepwise: DDTREE_RUN_AHEAD_AUTO=1 / 0, an `auto` batch's steps queued so too, its budget chosen one step
        behind (the default where steps are queued ahead), or each chosen after the previous step is read;
        NAME+route: DDTREE_MOE_ROUTE=kernel, the bf16 experts' pairs sorted in one routing launch; NAME+router64:
        DDTREE_ROUTER_MAX_ROWS=64, a verify wider than 64 rows routed by the torch form)

The trained pair built as `benchmarks/concurrency.py` builds it (bf16 on a GPU), one discarded two-request job a mode
(kernels compiled), then one CLI job a name in `--order` (`auto`, `ar` or a fixed budget), each of N requests in-flight
batched (`--max_batch_size N`, or `--slots`: fewer slots than requests, each request joining as one leaves). For each
job: tokens/s, the budgets its steps took (for `auto` the batch policy's summary: steps and median ms a step by slots
and budget), the first request's budgets step by step, and whether its tokens equal the first job's and its mode's first
job's (in bf16 a batched verify rounds differently from a batched decode, so a speculative job's tokens may leave an
autoregressive one's; greedy float32 jobs agree). Writes OUT_DIR/batch_policy.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import concurrency  # noqa: E402
from benchmarks.common import environment  # noqa: E402

# an --order entry's +NAME: the environment it sets
SWITCHES = {"lazy": ("DDTREE_LAZY_CONTEXT", "1"), "eager": ("DDTREE_LAZY_CONTEXT", "0"),
            "group": ("DDTREE_GROUP_ADMISSIONS", "1"),
            "lone": ("DDTREE_LONE_AS_GROUP", "1"), "profile": ("DDTREE_LONE_AS_GROUP", "0"),
            "serial": ("DDTREE_RUN_AHEAD", "0"), "ahead": ("DDTREE_RUN_AHEAD_AUTO", "1"),
            "stepwise": ("DDTREE_RUN_AHEAD_AUTO", "0"), "route": ("DDTREE_MOE_ROUTE", "kernel"),
            "router64": ("DDTREE_ROUTER_MAX_ROWS", "64")}  # fmt: skip


def switched(choice: str, option: str) -> tuple[str, list[str], dict]:
    """(base, switches, environment) of a `NAME+switch+...` entry of `option`; an unknown switch is an error."""
    base, *switches = choice.split("+")
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise SystemExit(f"{option}: unknown switches {unknown} in {choice!r} (known: {sorted(SWITCHES)})")
    return base, switches, dict(SWITCHES[name] for name in switches)


def job(choice: str) -> tuple[str, str, dict]:
    """(label, CLI mode, environment) of an `--order` entry: a `mode_name` choice, then `+eager` / `+lazy` (an
    autoregressive step's drafter row committed at once, or left pending: the default), `+group` (admissions put off
    to share them), `+lone` / `+profile` (a lone admission as a group of one, the GPU default, or on the prefill
    profile), `+serial` (no step queued before the last one's tokens are read), `+ahead` / `+stepwise` (an `auto`
    batch's steps queued so too, or not), `+route` (the experts' pairs sorted in one launch), `+router64` (the
    router's kernels for at most 64 rows, a wider batch's verify routed by the torch form) as wanted."""
    base, switches, env = switched(choice, "--order")
    mode = mode_name(base)
    return " ".join([mode, *switches]), mode, env


def mode_name(choice: str) -> str:
    """A CLI mode of `concurrency.CLI_MODES` for `auto`, `ar` (autoregressive) or a budget (a budget it lacks is
    added)."""
    if choice == "auto":
        return "DDTree auto (8/16/32)"
    if choice == "ar":
        return "autoregressive"
    name = f"DDTree {int(choice)}"
    concurrency.CLI_MODES.setdefault(name, ["--ddtree_budget", str(int(choice))])
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--slots", type=int, help="the batch's slots (default: one a request; fewer: a steady load, "
                        "each request taking the slot one leaves)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--order", default="auto,8,16,auto", help="the jobs, in order: auto, ar or a budget each")
    args = parser.parse_args(argv)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    engine = concurrency.build_engine(out, False, "bfloat16" if args.device == "cuda" else "float32")
    texts = concurrency.prompts(args.requests, False)
    slots = args.slots or args.requests
    parsed = [job(choice) for choice in args.order.split(",")]
    jobs = {label: (mode, env) for label, mode, env in parsed}
    order = [label for label, _, _ in parsed]
    for label, (mode, env) in jobs.items():  # kernels compiled for new shapes land in Triton's disk cache first
        concurrency.cli_row(engine, out, texts[:2], 8, 2, mode, args.device, env=env, tag=label[len(mode) :])
    info = {**environment(False), "command": " ".join(sys.argv), "requests": args.requests, "slots": slots,
            "tokens": args.tokens, "jobs": []}  # fmt: skip
    outputs, firsts = None, {}  # the first job's tokens, and each mode's first job's
    for repeat, mode in enumerate(order):
        cli_mode, env = jobs[mode]
        row = concurrency.cli_row(engine, out, texts, args.tokens, slots, cli_mode, args.device, repeat, env,
                                  mode[len(cli_mode) :])  # fmt: skip
        outputs = row["outputs"] if outputs is None else outputs
        firsts.setdefault(mode, row["outputs"])
        info["jobs"].append({"mode": mode, "tokens_per_s": row["tokens_per_s"], "seconds": row["seconds"],
                             "budgets_chosen": row["budgets_chosen"], "policy": row["policy"],
                             "admissions": row["admissions"],
                             "first_request_budgets": row["budgets"][0],
                             "tokens_equal_to_the_first_job": row["outputs"] == outputs,
                             "tokens_equal_to_the_mode_s_first_job": row["outputs"] == firsts[mode]})  # fmt: skip
        admitted = {k: v["admissions"] for k, v in (row["admissions"] or {}).items()}  # group size -> admissions
        print(f"{mode:22s} {row['tokens_per_s']:9.1f} tokens/s  budgets {row.get('budgets_chosen')}  admissions "
              f"{admitted}", flush=True)  # fmt: skip
        (out / "batch_policy.json").write_text(json.dumps(info, indent=1) + "\n")
    rates = {m: [job["tokens_per_s"] for job in info["jobs"] if job["mode"] == m] for m in dict.fromkeys(order)}
    base = statistics.median(rates["autoregressive"]) if "autoregressive" in rates else None
    for mode, values in rates.items():
        median = statistics.median(values)
        versus = f"  ({median / base:.3f}x autoregressive)" if base else ""
        print(f"median {mode:22s} {median:9.1f} tokens/s of {len(values)} jobs{versus}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
