"""The first request after warm-up against the ones after it, through the CLI users launch.

    PYTHONPATH=. python benchmarks/first_request.py OUT_DIR [--device cuda] [--dtypes bfloat16 float32]
        [--modes autoregressive "DDTree auto (8/16/32)"] [--requests 4] [--tokens 128] [--profile]
    PYTHONPATH=. python benchmarks/first_request.py OUT_DIR --smoke      (tiny demo checkpoints: checks the script)

A job of the CLI (`mpirun -np 1 python -m runner --backend torch --loop device`, the trained pair's engine as
`benchmarks/concurrency.py` builds it) warms up, then serves N distinct prompts one at a time; each request's wall
time, prefill and decode come from `--output_json`. A first request that costs more than the others is paid by
every server's first user and by every one-at-a-time row of the concurrency table (its jobs are fresh processes).
`--profile` runs the same job once more under cProfile with the profile limited to the first request
(`DDTREE_PROFILE_FIRST_REQUEST`, read by `runner/cli.py`): where the host's time went. Writes
OUT_DIR/first_request.json and OUT_DIR/profile-*.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment  # noqa: E402
from benchmarks.concurrency import CLI_MODES, build_engine, prompts, run_cli  # noqa: E402


def run_job(engine: Path, out: Path, texts: list[str], tokens: int, mode: str, device: str,
            profile: Path | None = None) -> dict:  # fmt: skip
    slug = "".join(c for c in mode if c.isalnum())
    path = out / f"first-{slug}-{engine.parent.name}{'-profiled' if profile else ''}.json"
    env = {"DDTREE_PROFILE_FIRST_REQUEST": str(profile)} if profile is not None else None
    result = run_cli(engine, path, texts, tokens, mode, device, env=env)
    rows = [{"prompt_tokens": len(r["prompt_ids"]), "tokens": len(r["output_ids"]),
             "elapsed_ms": round(r["elapsed"] * 1e3, 2), "prefill_ms": round(r["prefill_seconds"] * 1e3, 2),
             "decode_ms": round(r["decode_seconds"] * 1e3, 2), "phases_ms": {k: round(v * 1e3, 2)
                                                                              for k, v in r["seconds"].items()}}
            for r in result["results"]]  # fmt: skip
    later = rows[1:] or rows
    return {"mode": mode, "dtype": engine.parent.name, "requests": rows, "startup": result["startup"],
            "first_ms": rows[0]["elapsed_ms"], "later_median_ms": statistics.median(r["elapsed_ms"] for r in later),
            "first_prefill_ms": rows[0]["prefill_ms"],
            "later_prefill_median_ms": statistics.median(r["prefill_ms"] for r in later),
            "first_decode_ms": rows[0]["decode_ms"],
            "later_decode_median_ms": statistics.median(r["decode_ms"] for r in later)}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--modes", nargs="+", default=["autoregressive", "DDTree auto (8/16/32)"],
                        choices=list(CLI_MODES))  # fmt: skip
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="a cProfile of each job's first request as well")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.tokens, args.dtypes = 2, 16, ["float32"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    texts = prompts(args.requests, args.smoke)
    command = " ".join(["benchmarks/first_request.py", *sys.argv[1:]])
    report = {**environment(args.smoke), "device": args.device, "command": command, "rows": []}
    for dtype in args.dtypes:
        engine = build_engine(args.out_dir / dtype, args.smoke, dtype)
        for mode in args.modes:
            row = run_job(engine, args.out_dir, texts, args.tokens, mode, args.device)
            if args.profile:
                profile = args.out_dir / f"profile-{dtype}-{''.join(c for c in mode if c.isalnum())}.txt"
                run_job(engine, args.out_dir, texts, args.tokens, mode, args.device, profile)
                row["profile"] = profile.name
            report["rows"].append(row)
            print(
                f"{dtype:9s} {mode:24s} first {row['first_ms']:8.1f} ms (prefill {row['first_prefill_ms']:.1f}, "
                f"decode {row['first_decode_ms']:.1f}); later median {row['later_median_ms']:8.1f} ms (prefill "
                f"{row['later_prefill_median_ms']:.1f}, decode {row['later_decode_median_ms']:.1f})",
                flush=True,
            )
            (args.out_dir / "first_request.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
