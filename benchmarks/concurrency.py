"""Many requests at once: in-flight batching against one request at a time, through the CLI and a real tritonserver.

    PYTHONPATH=. python benchmarks/concurrency.py OUT_DIR [--levels 1,2,4,8,16] [--tokens 64] [--device cpu|cuda]
        [--rounds K] [--repeats R]
    PYTHONPATH=. python benchmarks/concurrency.py OUT_DIR --smoke       (tiny: checks the script)

The trained pair (`trained/`: a small Kimi K2.x-architecture target and its DFlash drafter, real acceptance) is built
into a TP-1 engine directory (torch backend) and run by what users launch:
1. The CLI (`mpirun -np 1 python -m runner --backend torch --loop device`): N prompts in one job, one at a time
   (`--max_batch_size 1`) and in-flight batched (`--max_batch_size N`), DDTree 32, DDTree 8, DDTree auto (budgets
   8, 16 and 32; batched: one budget a step for the batch, `StepBudgetPolicy`), the DFlash chain (an engine of its
   own: budget 7, one branch a depth) and autoregressive (`--modes` picks some); the rate is every
   request's tokens over the job's generation time; the batched tokens must equal the one-at-a-time ones, and the
   budgets the steps took are recorded. `--rounds K`: N x K prompts through N slots (each joins when one leaves:
   steady in-flight batching, as a server under N concurrent clients sees it; with K = 1 the batch drains to its
   slowest request at the end). `--repeats R`: each batched job R times, the modes interleaved and each repeat
   starting at another mode; a row is the median run, with every run's rate.
2. Triton: one tritonserver with five models (DDTree and autoregressive, each one at a time and batched up to the
   largest level, and the DFlash chain's engine batched; `--triton-models` picks some); N clients, each sending two
   requests in turn over one connection kept open (`--triton-requests`; `--triton-connection fresh`: a connection a
   request, `kept,fresh`: each row both ways, one after the other; `max_tokens` tokens, no end token;
   `--triton-budgets`: the DDTree models' rows once a request `ddtree_budget` each); aggregate tokens/s over the
   wall time, per-request latency (median, 90th percentile, worst) and a request's tokens/s.
3. In process, a DDTree 32 batched step's phases (draft, tree, verify, accept) and the batch's autoregressive step
   (a block's drafter context or one row's; the median of 10 steps, eager: on a CPU) at 1, 8 and 16 requests: where
   a batch's time goes (`--phases-only` runs just this).
Writes OUT_DIR/concurrency.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment  # noqa: E402

TRAINED = ROOT / "trained"
MODELS = {
    "ddtree": (False, False),
    "ddtree-batched": (False, True),
    "ar": (True, False),
    "ar-batched": (True, True),
    "chain-batched": (False, True),
}  # (autoregressive, batched); "chain-*" serve the DFlash chain's engine
CLI_MODES = {  # the baseline first: a run cut short still has it
    "autoregressive": ["--autoregressive"],
    "DFlash chain": [],  # its own engine (CHAIN): a block's tokens in a line, a verify of 8
    "DDTree 8": ["--ddtree_budget", "8"],
    "DDTree auto (8/16/32)": ["--ddtree_budget", "auto"],
    "DDTree 32": ["--ddtree_budget", "32"],
}


CHAIN = ("--ddtree_budget", "7", "--max_topk", "1")  # the DFlash chain's engine: budget 7 with one branch a depth


def build_engine(out: Path, smoke: bool, dtype: str = "float32", name: str = "engine",
                 spec: tuple = ("--extra_budgets", "8,16")) -> Path:  # fmt: skip
    """The TP-1 engine directory `out/name` (float32 on a CPU; on a GPU bf16, as the acceptance benchmark runs the
    pair); `spec`: its tree budgets (default 32, 8 and 16: `auto`'s choices)."""
    from builder.cli import main as build_main

    if smoke:  # the tiny demo checkpoints: no trained weights needed
        from builder.demo_checkpoints import write_drafter, write_target

        target = write_target(out / "hf" / "kimi-k2-tiny", int4_experts=False, force=True)
        drafter = write_drafter(out / "hf" / "kimi-k2-tiny-dflash", force=True)
    else:
        target, drafter = TRAINED / "kimi-k2-py", TRAINED / "kimi-k2-py-dflash"
    engine = out / name
    args = ["--model_dir", str(target), "--draft_model_dir", str(drafter), "--output_dir", str(engine),
            "--max_input_len", "128", "--max_seq_len", "512", "--dtype", dtype, "--no_onnx", "--force",
            *spec]  # fmt: skip
    if build_main(args) != 0:
        raise RuntimeError("build-engine failed")
    return engine


def prompts(count: int, smoke: bool) -> list[str]:
    if smoke:
        return [f"Hello {i} world" for i in range(count)]
    held = json.loads((TRAINED / "heldout_prompts.json").read_text())
    return [held[i % len(held)]["text"][-200:] for i in range(count)]  # the end of each: a short prompt


def run_cli(engine: Path, path: Path, texts: list[str], tokens: int, mode: str, device: str, flags: tuple = (),
            env: dict | None = None) -> dict:  # fmt: skip
    """One job of the CLI (`mpirun -np 1 python -m runner --backend torch --loop device`) on `texts`, in `mode`
    (`CLI_MODES`) with `flags` and `env` added; returns its --output_json (written to `path`)."""
    args = [sys.executable, "-m", "runner", "--engine_dir", str(engine), "--backend", "torch", "--loop", "device",
            "--max_output_len", str(tokens), "--end_id", "-1", "--output_json", str(path), *flags]  # fmt: skip
    args += CLI_MODES[mode]
    for text in texts:
        args += ["--input_text", text]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads, **(env or {})}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = Path(sys.executable).parent / "mpirun"
    done = subprocess.run([str(launcher if launcher.exists() else "mpirun"), "-np", "1", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=3600)  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(path.read_text())


def cli_row(engine: Path, out: Path, texts: list[str], tokens: int, batch: int, mode: str, device: str,
            repeat: int = 0, env: dict | None = None, tag: str = "") -> dict:  # fmt: skip
    """One CLI job of `texts` in batches of `batch` (`env`: added to the job's environment; `tag`: in its file's
    name)."""
    slug = "".join(c for c in mode + tag if c.isalnum())
    path = out / f"cli-{slug}-{len(texts)}-{batch}{f'-r{repeat}' if repeat else ''}.json"
    result = run_cli(engine, path, texts, tokens, mode, device, ("--max_batch_size", str(batch)), env)
    rows = result["results"]
    total = sum(len(r["output_ids"]) for r in rows)
    seconds = result["batch"]["seconds"] if result["batch"] else sum(r["elapsed"] for r in rows)
    return {"requests": len(texts), "max_batch_size": batch, "cli_mode": mode, "tokens": total,
            "seconds": seconds, "tokens_per_s": total / seconds, "outputs": [r["output_ids"] for r in rows],
            "latency_s": [r["elapsed"] for r in rows], "mode": rows[0]["mode"],
            "budgets": [r["budgets"] for r in rows],
            "budgets_chosen": _histogram(b for r in rows for b in r["budgets"]),  # 0: autoregressive steps
            "policy": (result["batch"] or {}).get("policy"),
            "admissions": (result["batch"] or {}).get("admissions")}  # fmt: skip


def median_row(rows: list[dict]) -> dict:
    """The repeats of one batched job: the median-rate repeat's row (the lower middle one of an even count), with
    every repeat's rate; equal to one at a time only if every repeat was."""
    ordered = sorted(rows, key=lambda r: r["tokens_per_s"])
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "repeats_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rows],
            "equal_to_one_at_a_time": all(r["equal_to_one_at_a_time"] for r in rows)}  # fmt: skip


def one_at_a_time(row: dict, n: int) -> dict:
    """The first n requests of a one-at-a-time job (`--max_batch_size 1`): their tokens over their own times."""
    outputs, latency = row["outputs"][:n], row["latency_s"][:n]
    tokens = sum(len(o) for o in outputs)
    return {**row, "requests": n, "tokens": tokens, "seconds": sum(latency), "tokens_per_s": tokens / sum(latency),
            "outputs": outputs, "latency_s": latency, "budgets": row["budgets"][:n],
            "budgets_chosen": _histogram(b for budgets in row["budgets"][:n] for b in budgets)}  # fmt: skip


def _histogram(values) -> dict:
    counts: dict = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def triton_rows(engines: dict[str, Path], out: Path, levels: list[int], tokens: int, smoke: bool, models: list[str],
                budgets: list[str | None], per_client: int = 2, rows: list | None = None,
                saved=lambda: None, kept: tuple[bool, ...] = (True,)) -> list[dict]:  # fmt: skip
    """The Triton rows: `models` (names in MODELS) in one server, each of `engines[name]`; each DDTree model once a
    request budget in `budgets` (None: the engine's own, the request sends none; "auto" or a budget: the request's
    `ddtree_budget`; the chain's model: its own budget only). rows: the list each row is appended to (returned),
    `saved()` called after each, so a run stopped early keeps the rows it measured. kept: each row in each form in
    turn, True: each client's requests over one connection kept open, False: a connection a request (`load`)."""
    from runner.serving.triton_repo import write_repository
    from runner.serving.triton_server import start_server, stop_server, wait_ready

    venv = Path(os.environ.get("DDTREE_TRITON_VENV", ROOT / ".venv-triton"))
    repo = out / "repo"
    for name in models:
        autoregressive, batched = MODELS[name]
        staging = out / f"staging-{name}"
        write_repository(engines[name], staging, model_name=name, backend="torch", force=True,
                         max_batch_size=max(levels) if batched else 1, autoregressive=autoregressive,
                         max_queue=4 * max(levels))  # fmt: skip
        repo.mkdir(exist_ok=True)
        shutil.rmtree(repo / name, ignore_errors=True)  # an earlier run's, in this benchmark's own folder
        (staging / name).rename(repo / name)
    ports = [free_port() for _ in range(3)]
    process = start_server(venv, repo, out, *ports, out / "server.log")
    rows = [] if rows is None else rows
    try:
        wait_ready(process, ports[0], out / "server.log", timeout=900)
        texts = prompts(per_client * max(levels), smoke)
        fixed = [n for n in models if MODELS[n][0] or n.startswith("chain")]  # their requests name no budget
        for clients in levels:
            served = ((n, b, k) for n in models for b in ([None] if n in fixed else budgets) for k in kept)
            for name, budget, form in served:
                rows.append(load(ports[0], name, texts, clients, tokens, per_client, budget, form))
                label = name + (f" ({budget})" if budget else "") + ("" if form else ", fresh")
                print(f"triton {label:22s} {clients:3d} clients: {rows[-1]['tokens_per_s']:8.1f} tokens/s, latency "
                      f"median {rows[-1]['latency_median_s']:.3f} s, p90 {rows[-1]['latency_p90_s']:.3f} s, worst "
                      f"{rows[-1]['latency_max_s']:.3f} s; a request {rows[-1]['request_tokens_per_s_median']:.1f} "
                      "tokens/s (median)",
                      flush=True)  # fmt: skip
                saved()
    finally:
        stop_server(process)
    return rows


def triton_time(port: int, model: str, body: dict, stream: bool, timeout: float = 600) -> tuple[float, float | None]:
    """(seconds to the whole reply, seconds to the first streamed line or None) of one request over a connection of
    its own (as `urllib` makes)."""
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/{endpoint}",
                                     data=json.dumps({**body, **({"stream": True} if stream else {})}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    started, first = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        if stream:
            for _ in reply:
                first = first or time.perf_counter() - started
        else:
            reply.read()
    return time.perf_counter() - started, first


class KeptConnection:
    """One HTTP/1.1 connection to the server, kept open from request to request, as an HTTP client that pools its
    connections (tritonclient's, a requests session) sends them; `time`: (seconds to the whole reply of one
    `/generate` request, None). `reused` counts the requests that went over a connection already open (the server
    kept it)."""

    def __init__(self, port: int, timeout: float = 600):
        import http.client

        self.connection, self.reused = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout), 0

    def time(self, model: str, body: dict) -> tuple[float, None]:
        started, sock = time.perf_counter(), self.connection.sock
        self.connection.request("POST", f"/v2/models/{model}/generate", body=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})  # fmt: skip
        reply = self.connection.getresponse()
        reply.read()
        seconds = time.perf_counter() - started
        if reply.status != 200:
            raise RuntimeError(f"the server refused a request ({reply.status})")
        self.reused += sock is not None and sock is self.connection.sock
        return seconds, None

    def close(self) -> None:
        self.connection.close()


def load(port: int, model: str, texts: list[str], clients: int, tokens: int, per_client: int = 2,
         budget: str | None = None, kept: bool = True) -> dict:  # fmt: skip
    """N clients, each sending its requests in turn to `/generate`: over one connection kept open (`kept`, as a
    client that pools its connections sends them) or a connection a request (as `urllib` makes)."""
    latencies, errors = [], []

    def client(c: int) -> None:
        connection = KeptConnection(port, timeout=1800) if kept else None
        for k in range(per_client):
            body = {"text_input": texts[(c * per_client + k) % len(texts)], "max_tokens": tokens, "end_id": -1}
            if budget is not None:
                body["ddtree_budget"] = budget
            try:
                if connection is not None:
                    latencies.append(connection.time(model, body)[0])
                else:
                    latencies.append(triton_time(port, model, body, False, timeout=1800)[0])
            except (OSError, RuntimeError) as err:
                errors.append(str(err))
        if connection is not None:
            connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{model}, {clients} clients: {errors[:3]}")
    return {"model": model, "budget": budget, "clients": clients, "requests": len(latencies),
            "connection": "kept" if kept else "a connection a request", "tokens": len(latencies) * tokens,
            "seconds": wall, "tokens_per_s": len(latencies) * tokens / wall,
            "latency_median_s": statistics.median(latencies), "latency_p90_s": float(np.quantile(latencies, 0.9)),
            "latency_max_s": max(latencies),
            "request_tokens_per_s_median": tokens / statistics.median(latencies)}  # fmt: skip


def phase_times(engine: Path, batches: tuple[int, ...] = (1, 8, 16), steps: int = 10,
                smoke: bool = False) -> list[dict]:  # fmt: skip
    """Milliseconds per phase of a DDTree 32 batched step and of the batch's autoregressive steps (eager, timed
    around each phase), median of `steps`."""
    import torch

    from engines.engine_dir import load_engine_dir
    from engines.spec import SpecConfig
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.generator import Generator
    from runner.tokenizer import load_tokenizer

    loaded = load_engine_dir(engine)
    tokenizer = load_tokenizer(loaded.tokenizer_dir, 1 << 20)
    rows = []
    for batch in batches:
        options = RankOptions(device="cpu", device_loop=True, max_batch_size=max(batch, 2))
        ranks = local_ranks(CheckpointWeights(loaded.checkpoint_dir), options, SpecConfig(8, 32), loaded.build_config)
        generator = Generator(ranks)
        batcher = generator.batcher()
        for i, text in enumerate(prompts(batch, smoke)):
            generator.admit(batcher, tokenizer.encode(text), 4 * steps + 8, tag=i)
        step = ranks.lead.batch
        loops = step.loops[:batch]
        phases = _phases(step, loops)
        times = {name: [] for name in phases}
        with torch.no_grad():
            for _ in range(steps):
                for name, phase in phases.items():
                    started = time.perf_counter()
                    phase()
                    times[name].append((time.perf_counter() - started) * 1e3)
        ranks.close()
        rows.append({"requests": batch, **{name: statistics.median(t) for name, t in times.items()}})
        print(f"phases, {batch} requests: " + ", ".join(f"{name} {rows[-1][name]:.1f} ms" for name in phases))
    return rows


def _phases(step, loops) -> dict:
    """A batched step's phases (`runner/device/batch.py`), each callable alone; then an autoregressive step of the
    batch (`DECODE`, as `auto` takes it) committing a block's drafter context, as after a tree step, and one row's,
    as after a load or another such step."""
    return {"draft": lambda: step._draft(loops), "tree": lambda: step._trees(loops),
            "verify": lambda: step._verify(loops), "accept": lambda: step._accept(loops),
            "decode, a block's context": lambda: step._decode(loops, speculative=True),
            "decode, one row's context": lambda: step._decode(loops, speculative=True, width=1)}  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--levels", default=None, help="concurrent requests (default 1,2,4,8,16; smoke 1,2)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a request (default 64; smoke 8)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests a slot serves: level N sends N x ROUNDS requests through N slots, each joining "
                             "as one leaves (steady in-flight batching; default 1: N requests at once)")  # fmt: skip
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each batched job, the modes interleaved (each repeat in another order) so a "
        "drifting machine touches every mode alike; a row is the median run (default 1)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-triton", action="store_true", help="the CLI rows only")
    parser.add_argument("--no-cli", action="store_true", help="the Triton rows only")
    parser.add_argument("--modes", default=",".join(CLI_MODES),
                        help=f"the CLI's modes, comma-separated (default: all of {','.join(CLI_MODES)})")  # fmt: skip
    parser.add_argument("--triton-models", default=",".join(MODELS),
                        help=f"the Triton models served (default: all of {','.join(MODELS)})")  # fmt: skip
    parser.add_argument("--triton-requests", type=int, default=2, help="requests each Triton client sends in turn")
    parser.add_argument("--triton-connection", choices=["kept", "fresh", "kept,fresh"], default="kept",
                        help="each Triton client's requests over one connection kept open (as clients that pool "
                             "connections send them; the default) or a fresh connection a request (runs before "
                             "this switch); kept,fresh: each row both ways in turn")  # fmt: skip
    parser.add_argument("--triton-budgets", default="",
                        help="request budgets for the Triton DDTree models, comma-separated ('auto' or a budget the "
                             "engine verifies; default: none sent, the engine's own)")  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the engine's dtype (default: float32 on the CPU, bfloat16 on a GPU)")  # fmt: skip
    parser.add_argument("--phases-only", action="store_true", help="only the in-process phase times (part 3)")
    parser.add_argument("--smoke", action="store_true", help="the tiny demo model, two levels: checks the script")
    args = parser.parse_args(argv)
    models = [m for m in args.triton_models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--triton-models: expected names among {sorted(MODELS)}, got {unknown}")
    unknown = sorted(set(args.modes.split(",")) - set(CLI_MODES))
    if unknown:
        parser.error(f"--modes: expected names among {list(CLI_MODES)}, got {unknown}")
    budgets = [b for b in args.triton_budgets.split(",") if b] or [None]
    levels = [int(n) for n in (args.levels or ("1,2" if args.smoke else "1,2,4,8,16")).split(",")]
    tokens = args.tokens or (8 if args.smoke else 64)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    info = {**environment(args.smoke), "device": args.device, "command": " ".join(sys.argv), "levels": levels,
            "dtype": dtype, "tokens": tokens, "rounds": args.rounds, "repeats": args.repeats, "cli": [],
            "triton_server": []}  # fmt: skip
    if args.device == "cuda" and not args.smoke:
        info.update(environment(False))

    def save() -> None:
        (out / "concurrency.json").write_text(json.dumps(info, indent=1) + "\n")

    engine = build_engine(out, args.smoke, dtype)
    modes = [] if args.no_cli else [m for m in CLI_MODES if m in args.modes.split(",")]
    engines = {mode: engine for mode in CLI_MODES}
    chain_rows = "DFlash chain" in modes or (not args.no_triton and any(m.startswith("chain") for m in models))
    if chain_rows and not args.phases_only:
        engines["DFlash chain"] = build_engine(out, args.smoke, dtype, "engine-chain", CHAIN)
    if args.device == "cpu" or args.phases_only:  # eager phases timed on the host clock: a CPU measurement
        info["phases"] = phase_times(engine, (1, 8) if args.smoke else (1, 8, 16), smoke=args.smoke)
        save()
    if args.phases_only:
        return 0
    rounds = args.rounds
    texts = prompts(max(levels) * rounds, args.smoke)
    for mode in modes if args.device == "cuda" else ():  # a discarded job first: kernels compiled for new
        cli_row(
            engines[mode], out, texts[:2], 8, 2, mode, args.device
        )  # shapes land in Triton's disk cache, as on a server
    # one at a time: the largest level's prompts in one job a mode, each request alone (a request's rate does not
    # depend on the others), so the rate of the first n requests is the one-at-a-time row at level n
    single = {mode: cli_row(engines[mode], out, texts, tokens, 1, mode, args.device) for mode in modes}
    for n in levels:
        batched = n > 1 or rounds > 1
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats if batched else 1):
            shift = repeat % max(len(modes), 1)  # each repeat starts at another mode: no mode always runs first or last
            for mode in modes[shift:] + modes[:shift]:
                alone = one_at_a_time(single[mode], n * rounds)
                together = (cli_row(engines[mode], out, texts[: n * rounds], tokens, n, mode, args.device, repeat)
                            if batched else alone)  # fmt: skip
                runs[mode].append({**together, "equal_to_one_at_a_time": together["outputs"] == alone["outputs"]})
                print(f"cli {mode:14s} {n:3d} requests, max_batch_size {together['max_batch_size']:2d}"
                      f"{f', repeat {repeat + 1}' if args.repeats > 1 else ''}: "
                      f"{together['tokens_per_s']:8.1f} tokens/s", flush=True)  # fmt: skip
        for mode in modes:
            alone = one_at_a_time(single[mode], n * rounds)
            for row in (alone, median_row(runs[mode])) if batched else (alone,):
                info["cli"].append({**{k: v for k, v in row.items() if k not in ("outputs", "budgets")}, "level": n})
        save()
    if not args.no_triton:
        served = {m: engines["DFlash chain"] if m.startswith("chain") else engine for m in models}
        triton_rows(served, out, levels, tokens, args.smoke, models, budgets, args.triton_requests,
                    info["triton_server"], save,
                    kept=tuple(form == "kept" for form in args.triton_connection.split(",")))  # fmt: skip
    save()
    print("\n| requests | mode | one at a time (tokens/s) | batched (tokens/s) | batched / one at a time |")
    print("|---|---|---|---|---|")
    for n in levels:
        for mode in modes:
            mine = [r for r in info["cli"] if r["level"] == n and r["cli_mode"] == mode]
            alone = next(r for r in mine if r["max_batch_size"] == 1)
            together = next((r for r in mine if r["max_batch_size"] == n and r is not alone), alone)
            print(
                f"| {n} | {mode} | {alone['tokens_per_s']:.1f} | "
                f"{together['tokens_per_s']:.1f} | {together['tokens_per_s'] / alone['tokens_per_s']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
