"""What the serving path adds to a request: the same requests through the runner's serving pipe and through
tritonserver, one at a time.

    PYTHONPATH=. python benchmarks/serving_overhead.py OUT_DIR [--device cpu|cuda] [--tokens 1,64] [--requests 12]
        [--modes "DDTree 8,DDTree auto,autoregressive"] [--direct] [--slots 16] [--smoke]

The trained pair's TP-1 engine (built as `benchmarks/concurrency.py` builds it: budgets 32, 8 and 16, float32 on a
CPU, bf16 on a GPU) served two ways, the in-flight batched form a deployment runs (`--max_batch_size 16 --loop
device`), each request alone (the next sent when the last one's reply is in):
1. **pipe**: `mpirun -np 1 python -m runner --serve --engine_dir E --backend torch ...`, the job the Triton model
   starts, its requests written to its stdin; a request's time from its line to its done event. The done event's
   `elapsed` is the runner's own time (prefill to last token), so pipe - elapsed is the runner's request handling
   (parsing, tokenizing, the events' JSON).
2. **triton**: the model repository of the same engine (`runner.serving.triton_repo`), the real server, `/generate`
   and `/generate_stream` over HTTP (a connection a request, as `urllib` makes), and `/generate` over one connection
   kept open from request to request (as a client that pools its connections sends them: tritonclient, a requests
   session); a request's time from sending to its whole reply (streamed: also to its first token).
Each mode's DDTree requests name their budget (`ddtree_budget`); autoregressive is a job and a model of its own
(`--autoregressive`). Both paths run side by side: each prompt goes through the pipe, `/generate` and
`/generate_stream` in turn (the order rotating from prompt to prompt, so a drifting machine touches each alike),
after one warm-up request each (`--direct`: a fourth path, the same job started without mpirun, so what the
launcher's forwarding of the pipes costs shows apart: the two jobs' handling, pipe less own time); per mode and
request length (`--tokens`: one token shows the fixed cost a request pays) the medians and, paired by prompt, what
Triton adds over the pipe. Writes OUT_DIR/serving_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment  # noqa: E402
from benchmarks.concurrency import KeptConnection, build_engine, free_port, prompts, triton_time  # noqa: E402

MODES = {"DDTree 8": "8", "DDTree auto": "auto", "DDTree 32": "32", "autoregressive": None}
SLOTS = 16  # the batched form's slots (a deployment's `max_batch_size`)


def request_body(text: str, tokens: int, budget: str | None) -> dict:
    body = {"text_input": text, "max_tokens": tokens, "end_id": -1}
    if budget is not None:
        body["ddtree_budget"] = budget
    return body


class PipeJob:
    """A serving job (`python -m runner --serve`) and its pipes: `time(body)` sends one request and waits for its done
    event."""

    def __init__(self, engine: Path, env: dict, autoregressive: bool, log: Path, launcher: bool = True,
                 slots: int = SLOTS):  # fmt: skip
        """launcher: under `mpirun -np 1`, as the Triton model starts it; else the one rank started directly (its
        pipes without the launcher's forwarding of standard input and output). Started here; `wait_ready` before a
        request (several jobs warm up at once)."""
        mpirun = Path(sys.executable).parent / "mpirun"
        command = [*([str(mpirun if mpirun.exists() else "mpirun"), "-np", "1"] if launcher else []),
                   sys.executable, "-m", "runner", "--serve", "--engine_dir", str(engine), "--backend", "torch",
                   "--max_batch_size", str(slots), "--loop", "device",
                   *(["--autoregressive"] if autoregressive else [])]  # fmt: skip
        with open(log, "a") as err:
            self.job = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                        bufsize=1, env=env, cwd=ROOT)  # fmt: skip
        self.count, self.log, self.started = 0, log, time.perf_counter()

    def wait_ready(self) -> float:
        """Waits for the job's ready event; returns the seconds since it was started."""
        while json.loads(self.job.stdout.readline() or '{"event": "exited"}').get("event") not in ("ready", "exited"):
            pass
        if self.job.poll() is not None:
            raise RuntimeError(f"the serving job exited (code {self.job.returncode}); see {self.log}")
        return time.perf_counter() - self.started

    def time(self, body: dict) -> tuple[float, float]:
        """(seconds from the request's line to its done event, the runner's own elapsed)."""
        self.count += 1
        line = json.dumps({"id": f"r{self.count}", **body})
        started = time.perf_counter()
        self.job.stdin.write(line + "\n")
        self.job.stdin.flush()
        while True:
            event = json.loads(self.job.stdout.readline())
            if event.get("event") in ("done", "error"):
                break
        if event["event"] == "error":
            raise RuntimeError(f"the runner refused a request: {event['error']}")
        return time.perf_counter() - started, event["elapsed"]

    def close(self) -> None:
        self.job.stdin.close()
        self.job.wait(timeout=60)


def start_triton(engine: Path, out: Path, models: dict[str, bool], slots: int = SLOTS):
    """tritonserver on a repository of `models` ({name: autoregressive}) of `engine`, started (its models warm up
    while the caller goes on; `wait_ready` before a request): (process, HTTP port)."""
    from runner.serving.triton_repo import write_repository
    from runner.serving.triton_server import start_server

    venv = Path(os.environ.get("DDTREE_TRITON_VENV", ROOT / ".venv-triton"))
    repo = out / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    for name, autoregressive in models.items():
        staging = out / f"staging-{name}"
        write_repository(engine, staging, model_name=name, backend="torch", force=True, max_batch_size=slots,
                         autoregressive=autoregressive, max_queue=4 * slots)  # fmt: skip
        (staging / name).rename(repo / name)
    ports = [free_port() for _ in range(3)]
    return start_server(venv, repo, out, *ports, out / "server.log"), ports[0]


def ms(values) -> float:
    return round(statistics.median(values) * 1e3, 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", default="64", help="tokens a request (no end token), comma-separated lengths")
    parser.add_argument("--requests", type=int, default=12, help="prompts through each path and mode")
    parser.add_argument("--modes", default="DDTree 8,DDTree auto,autoregressive",
                        help=f"comma-separated, among {', '.join(MODES)}")  # fmt: skip
    parser.add_argument(
        "--direct",
        action="store_true",
        help="also a serving job started without mpirun: what the launcher's forwarding costs",
    )
    parser.add_argument("--slots", type=int, default=SLOTS,
                        help="the batched form's slots (fewer: fewer step graphs to warm up on a GPU)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="the tiny demo model, 4 requests of 8 tokens")
    args = parser.parse_args(argv)
    if args.slots < 2:
        parser.error(f"--slots: the batched form needs at least 2 slots, got {args.slots}")
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: expected names among {list(MODES)}, got {unknown}")
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        parser.error(f"--tokens: expected comma-separated positive token counts, got {args.tokens!r}")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    requests, lengths = (4, [8]) if args.smoke else (args.requests, lengths)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = build_engine(out, args.smoke, dtype)
    texts = prompts(requests, args.smoke)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the server's runner too
    info = {**environment(args.smoke), "device": args.device, "command": " ".join(sys.argv), "tokens": lengths,
            "requests": requests, "dtype": dtype, "slots": args.slots, "rows": []}  # fmt: skip
    speculative = any(MODES[m] is not None for m in modes)
    models = {**({"ddtree": False} if speculative else {}), **({"ar": True} if "autoregressive" in modes else {})}
    from runner.serving.triton_server import stop_server, wait_ready

    # the server's models and the pipe jobs warm up at once (on a GPU with a cold kernel cache: minutes each)
    process, port = start_triton(engine, out, models, args.slots)
    jobs: dict = {}
    try:
        for name, autoregressive in models.items():
            jobs[name] = PipeJob(engine, env, autoregressive, out / "pipe.log", slots=args.slots)
            if args.direct:
                jobs[f"{name}-direct"] = PipeJob(engine, env, autoregressive, out / "pipe.log", launcher=False,
                                                 slots=args.slots)  # fmt: skip
        for name, job in jobs.items():  # all warming up at once, as the server's models are
            print(f"serving job {name} ready after {job.wait_ready():.1f} s", flush=True)
        wait_ready(process, port, out / "server.log", timeout=900)
        print("tritonserver ready", flush=True)
        print("| mode | tokens | runner's elapsed (ms) | pipe (ms) | triton /generate (ms) | the same, one connection "
              "kept (ms) | triton stream (ms) | first streamed (ms) | triton - pipe, paired (ms) | kept - pipe, paired "
              "(ms) | the launcher's forwarding (ms) |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)  # fmt: skip
        # each prompt through the paths in turn, the order rotating (a drifting machine touches each alike)
        for mode, tokens in ((m, t) for m in modes for t in lengths):
            budget, model = MODES[mode], "ar" if MODES[mode] is None else "ddtree"
            kept = KeptConnection(port)
            paths = {"pipe": lambda b, m=model: jobs[m].time(b),
                     "triton": lambda b, m=model: triton_time(port, m, b, False),
                     "triton_kept": lambda b, m=model, k=kept: k.time(m, b),
                     "triton_stream": lambda b, m=model: triton_time(port, m, b, True)}  # fmt: skip
            if args.direct:
                paths["direct"] = lambda b, m=model: jobs[f"{m}-direct"].time(b)
            for name in paths:  # warm-up: each path once
                paths[name](request_body(texts[0], tokens, budget))
            timed: dict = {name: [] for name in paths}
            for i, text in enumerate(texts):
                names = list(paths)[i % len(paths) :] + list(paths)[: i % len(paths)]
                for name in names:
                    timed[name].append(paths[name](request_body(text, tokens, budget)))
            kept.close()
            pipe, whole, streamed, direct = (timed.get(name) for name in ("pipe", "triton", "triton_stream", "direct"))
            row = {"mode": mode, "tokens": tokens, "elapsed_ms": ms(e for _, e in pipe),
                   "pipe_ms": ms(p for p, _ in pipe),
                   "triton_ms": ms(t for t, _ in whole), "triton_stream_ms": ms(t for t, _ in streamed),
                   "first_streamed_ms": ms(f for _, f in streamed),
                   "triton_minus_pipe_ms": ms(t - p for (t, _), (p, _) in zip(whole, pipe)),
                   "triton_kept_ms": ms(t for t, _ in timed["triton_kept"]),
                   "kept_minus_pipe_ms": ms(t - p for (t, _), (p, _) in zip(timed["triton_kept"], pipe)),
                   "kept_reused": kept.reused,
                   "pipe": pipe, "triton": whole, "triton_kept": timed["triton_kept"],
                   "triton_stream": streamed}  # fmt: skip
            if direct:
                # the runner's own time moves more between two jobs than the pipes cost: compare each job's handling
                # (its pipe's time less its own), not the two jobs' whole times
                row.update(direct_ms=ms(d for d, _ in direct), direct=direct,
                           launcher_ms=round(ms(p - e for p, e in pipe) - ms(d - e for d, e in direct), 3))  # fmt: skip
            info["rows"].append(row)
            print(f"| {mode} | {tokens} | {row['elapsed_ms']} | {row['pipe_ms']} | {row['triton_ms']} "
                  f"| {row['triton_kept_ms']} | {row['triton_stream_ms']} | {row['first_streamed_ms']} "
                  f"| {row['triton_minus_pipe_ms']} | {row['kept_minus_pipe_ms']} | {row.get('launcher_ms', '')} |",
                  flush=True)  # fmt: skip
            (out / "serving_overhead.json").write_text(json.dumps(info, indent=1) + "\n")  # each mode as it ends
    finally:
        stop_server(process)
        for job in jobs.values():
            job.close()
    (out / "serving_overhead.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
