"""`mpirun -np N python -m runner ...`: DDTree speculative generation from an engine directory.

Flags follow TensorRT-LLM's examples/run.py (--engine_dir, --tokenizer_dir, --input_text, --max_output_len, ...).
Every rank runs this; rank 0 owns the tokenizer, sampling, tree building, acceptance and the output.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engines.spec import DEFAULT_PREFILL_CHUNK

log = logging.getLogger("ddtree.runner")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine_dir", type=Path, required=True)
    parser.add_argument("--tokenizer_dir", type=Path, default=None, help="default: ENGINE_DIR/tokenizer")
    parser.add_argument("--input_text", action="append", default=[], help="a prompt; repeat for several")
    parser.add_argument("--input_file", type=Path, default=None, help="a text file, one prompt per line")
    parser.add_argument("--max_output_len", type=int, default=64)
    sampling = "default: the checkpoint's generation_config.json, else"
    parser.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({sampling} 0)")
    parser.add_argument("--top_k", type=int, default=None, help=f"0 = no cap ({sampling} 0)")
    parser.add_argument("--top_p", type=float, default=None, help=f"({sampling} 1.0)")
    parser.add_argument("--seed", "--random_seed", dest="seed", type=int, default=0)
    parser.add_argument("--end_id", type=int, default=None, help="default: generation_config.json's stop ids")
    parser.add_argument("--chat", action="store_true", help="each prompt is a user turn, in the chat template")
    parser.add_argument("--system", default=None, help="--chat: a system turn before each prompt")
    parser.add_argument("--thinking", choices=["on", "off"], default="on", help="--chat: the template's thinking")
    parser.add_argument("--streaming", action="store_true", help="print text as tokens are accepted")
    parser.add_argument(
        "--backend", choices=["trt", "ort", "torch"], default=None, help="trt where TensorRT and a GPU exist, else ort"
    )
    parser.add_argument("--ddtree_budget", type=_budget, default=None,
                        help="tree nodes per step (must fit the engine), or auto: chosen every step among the "
                        "engine's budgets by expected tokens per measured second (host loop)")  # fmt: skip
    parser.add_argument("--max_topk", type=int, default=None, help="per-depth branching cap")
    parser.add_argument("--autoregressive", action="store_true", help="baseline: no drafter, one token per step")
    parser.add_argument(
        "--loop",
        choices=["auto", "device", "host"],
        default="auto",
        help="device: each step (tree build, target draws, accept and commit included; or an --autoregressive "
        "decode) as one tensor program on the device, one CUDA graph a step, the next queued behind it (torch "
        "backend; bad words take the host loop); host: draft, tree and acceptance on the host (any backend); auto "
        "(default): device on a GPU with the torch backend, else host",
    )
    parser.add_argument(
        "--chunked_prefill_size",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"a prompt's forward in chunks of at most this many tokens, each attending to the earlier ones "
        f"through the cache, so long prompts keep bounded buffers (default {DEFAULT_PREFILL_CHUNK}; 0: the whole "
        "prompt at once)",
    )
    parser.add_argument(
        "--max_batch_size",
        type=int,
        default=1,
        help="requests a step serves at most: in-flight batching on the device loop (torch backend, --loop device "
        "where it is not the default), each request with its own caches, tree and sampling, joining and leaving "
        "between steps; several prompts, or --serve's requests, share steps (default 1: one at a time)",
    )
    parser.add_argument("--output_json", type=Path, default=None, help="write token ids and stats (rank 0)")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="serve JSON requests from stdin, one per line (the Triton model's protocol)",
    )
    parser.add_argument(
        "--serve_parent_pid",
        type=int,
        default=None,
        help="--serve: end the job when this process ends (the Triton model passes the server's pid)",
    )
    parser.add_argument("--log_level", default="warning", choices=["error", "warning", "info", "debug"])
    return parser


def load_prompts(args) -> list[str]:
    """The prompts, or a ValueError (every rank learns of it, so none waits in a collective for rank 0)."""
    prompts = list(args.input_text)
    if args.input_file is not None:
        if not args.input_file.is_file():
            raise ValueError(f"--input_file {args.input_file} does not exist")
        prompts += [line for line in args.input_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one prompt with --input_text or --input_file (a non-empty one)")
    return prompts


@dataclass
class Job:
    """What every rank knows before the ranks are built (rank 0 alone: the tokenizer and the prompts)."""

    engine: object
    spec: object
    params: object  # the sampling settings, generation_config.json's defaults filled in
    defaults_applied: dict
    end_ids: set
    tokenizer: object = None
    prompts: list = field(default_factory=list)


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a tree budget (an integer) or auto; got {text!r}") from None


def prepare(args, comm) -> Job:
    """Every check that needs no collective, on every rank."""
    from engines.engine_dir import load_engine_dir
    from engines.spec import SpecConfig, check_runtime_spec
    from runner.chat import GenerationDefaults
    from runner.factory import default_backend

    if args.chunked_prefill_size < 0:
        raise ValueError(f"--chunked_prefill_size must be >= 0 (0: the whole prompt at once), got "
                         f"{args.chunked_prefill_size}")  # fmt: skip
    engine = load_engine_dir(args.engine_dir)
    engine.check_world_size(comm.Get_size())
    args.backend = args.backend or default_backend()
    engine.check_files(args.backend)
    base = engine.spec
    topk = args.max_topk if args.max_topk is not None else base.max_topk
    if args.ddtree_budget == "auto":  # every budget the engine verifies; steps take up to the largest
        from runner.budget import require_several

        require_several(base.budgets, "--ddtree_budget")
        spec = SpecConfig(base.block_size, max(base.budgets), topk, extra_budgets=base.budgets)
    else:
        budget = args.ddtree_budget if args.ddtree_budget is not None else base.budget  # 0 is an error
        # a server's requests may name any budget the engine verifies, or auto (`ddtree_budget`)
        spec = SpecConfig(base.block_size, budget, topk, extra_budgets=base.budgets if args.serve else ())
    check_runtime_spec(spec, engine.profiles)
    target = engine.config["pretrained_config"]["target"]
    tokenizer_dir = args.tokenizer_dir or engine.tokenizer_dir
    defaults = GenerationDefaults.load(tokenizer_dir, target.get("eos_token_id"))
    params, applied = defaults.sampling(args.temperature, args.top_k, args.top_p, args.seed)  # validates
    end_ids = {args.end_id} if args.end_id is not None else set(defaults.end_ids)
    end_ids.discard(-1)  # --end_id -1: no end token
    if args.loop == "device" and args.backend != "torch":
        raise ValueError(f"--loop device runs on the torch backend; got --backend {args.backend}")
    if args.max_batch_size < 1:
        raise ValueError(f"--max_batch_size must be >= 1, got {args.max_batch_size}")
    if args.max_batch_size > 1 and (args.backend != "torch" or args.loop == "host"):
        raise ValueError(f"--max_batch_size {args.max_batch_size}: batched steps run on the device loop of the torch "
                         f"backend; got --backend {args.backend} --loop {args.loop}")  # fmt: skip
    if args.max_batch_size > 1 and args.streaming:
        raise ValueError("--streaming prints one request at a time; with --max_batch_size > 1 each request's text "
                         "prints when it is done")  # fmt: skip
    job = Job(engine, spec, params, applied, end_ids)
    if comm.Get_rank() != 0:
        return job
    from runner.chat import render_chat
    from runner.speculate import check_request
    from runner.tokenizer import encode_prompt, load_tokenizer

    job.tokenizer = load_tokenizer(tokenizer_dir, target["vocab_size"])
    build = engine.build_config
    if args.serve:
        return job
    for i, text in enumerate(load_prompts(args)):
        try:
            if args.chat:
                turns = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": text}
                ]
                text = render_chat(job.tokenizer.config.get("chat_template"), turns, args.thinking == "on")
            job.prompts.append(encode_prompt(job.tokenizer, text, build.max_input_len))
            check_request(len(job.prompts[-1]), args.max_output_len, build.max_input_len, build.max_seq_len,
                          spec.block_size)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
    return job


def generate_all(args, generator, job: Job) -> tuple[list[dict], dict | None]:
    """Every prompt's result (in-flight batched with --max_batch_size > 1: then also the batch's totals)."""
    from dataclasses import replace

    from runner.tokenizer import TextStream

    results, tokenizer = [], job.tokenizer
    every = [replace(job.params, seed=args.seed + i) for i in range(len(job.prompts))]
    batched = summary = None
    if generator.batch_slots > 1 and all(generator.on_device(p) for p in every):  # in-flight batching
        started = time.perf_counter()
        batched = generator.generate_many(job.prompts, args.max_output_len, every, job.end_ids)
        wall = time.perf_counter() - started
        total = sum(len(r.tokens) for r in batched)
        summary = {"requests": len(batched), "max_batch_size": generator.batch_slots, "tokens": total, "seconds": wall,
                   "admissions": generator.last_batcher.admission_summary()}  # fmt: skip
        if generator.batch_policy is not None and generator.batch_policy.chosen:  # an all-`auto` batch's choices
            summary["policy"] = generator.batch_policy.summary()
        print(f"[batch] {len(batched)} requests, up to {generator.batch_slots} a step: {total} tokens in "
              f"{wall * 1e3:.1f} ms = {total / wall:.1f} tokens/s together", flush=True)  # fmt: skip
    for i, prompt in enumerate(job.prompts):
        params = every[i]
        if args.streaming:
            print(f"--- prompt {i}: {tokenizer.decode(prompt)!r}\n", end="", flush=True)
        stream = TextStream(tokenizer) if args.streaming else None
        if batched is not None:
            result = batched[i]
        elif i == 0 and (profile := os.environ.get("DDTREE_PROFILE_FIRST_REQUEST")):
            result = _profiled(Path(profile), generator.generate, prompt, args.max_output_len, params, job.end_ids,
                               stream)  # fmt: skip
        else:
            result = generator.generate(prompt, args.max_output_len, params, job.end_ids, stream)
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        if not args.streaming:
            print(f"--- prompt {i}: {tokenizer.decode(prompt)!r}\n{text}")
        else:
            stream.finish()
            print()
        print(format_stats(result, generator.mode(params)), flush=True)
        results.append(
            {
                "prompt_ids": prompt,
                "output_ids": result.tokens,
                "text": text,
                "mode": generator.mode(params),
                "accept_lengths": result.accept_lengths,
                "budgets": result.budgets,
                "target_forwards": result.target_forwards,
                "seconds": result.seconds,
                "elapsed": result.elapsed,
                "prefill_seconds": result.prefill_seconds,
                "decode_seconds": result.decode_seconds,
                "decode_tokens_per_s": result.decode_tokens_per_s,
            }
        )
    return results, summary


def _profiled(path: Path, call, *args):
    """call(*args) under cProfile, its statistics written to `path` as text (benchmarks/first_request.py: where the
    first request's host time goes)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    result = profiler.runcall(call, *args)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())
    return result


def format_stats(result, mode: str) -> str:
    tokens, elapsed = len(result.tokens), result.elapsed
    mean = f", mean acceptance length {result.mean_accept_length:.2f}" if result.accept_lengths else ""
    if "budget auto" in mode and result.budgets:
        from runner.device.budget import DECODE

        names = {DECODE: "autoregressive"}  # a batch policy's autoregressive steps
        counts = ", ".join(f"{names.get(b, b)}: {result.budgets.count(b)}" for b in sorted(set(result.budgets)))
        mean += ", budgets chosen " + counts
    phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.seconds.items())
    return (
        f"[stats {mode}] {tokens} tokens: prefill {result.prefill_seconds * 1e3:.1f} ms; decode {tokens - 1} tokens "
        f"in {result.decode_seconds * 1e3:.1f} ms = {result.decode_tokens_per_s:.1f} tokens/s (with the prefill "
        f"{tokens / elapsed:.1f} tokens/s); {result.target_forwards} target forwards "
        f"({result.tokens_per_target_forward:.2f} tokens/forward){mean}; time: {phases}"
    )


def main_on_rank(comm, argv=None) -> int:
    from runner.mpi import MpiRanks, setup_logging, worker_loop

    parser = build_parser()
    args = parser.parse_args(argv)
    rank = comm.Get_rank()
    setup_logging(rank, args.log_level)
    try:
        job = prepare(args, comm)
        problem = None
    except (ValueError, FileNotFoundError) as err:
        job, problem = None, str(err)
    problems = comm.allgather(problem)  # every rank learns whether any rank cannot start
    if any(problems):
        if rank == 0:
            for r, message in enumerate(problems):
                if message and (r == 0 or message != problems[0]):
                    print(f"error{'' if r == 0 else f' on rank {r}'}: {message}", file=sys.stderr)
        return 2
    from runner.factory import RankOptions, build_rank
    from runner.sampling import SamplingParams

    started = time.perf_counter()
    params, engine, spec = job.params, job.engine, job.spec
    loop = {"device": True, "host": False, "auto": None}[args.loop]  # auto: the device loop where it is a graph
    options = RankOptions(args.backend, device_loop=loop, autoregressive=args.autoregressive,
                          chunked_prefill_size=args.chunked_prefill_size,
                          max_batch_size=args.max_batch_size)  # fmt: skip
    worker = build_rank(engine, rank, options, spec, comm=comm)
    if rank != 0:
        worker_loop(worker, comm)
        return 0
    from runner.generator import Generator

    ranks = MpiRanks(worker, comm)
    try:
        generator = Generator(ranks, args.autoregressive)
        if args.ddtree_budget == "auto":
            costs = generator.enable_auto_budget()
            print("budget auto: one step costs " + ", ".join(f"{b}: {s * 1e3:.1f} ms" for b, s in costs.items()))
        built = time.perf_counter() - started
        # --serve: the step graphs a request can take (greedy; sampled with no filter, top-p alone, top-k)
        forms = (SamplingParams(), SamplingParams(1.0), SamplingParams(1.0, top_p=0.95), SamplingParams(1.0, top_k=50))
        requests = forms if args.serve else (params,)
        warm = generator.warm_up(requests, serving=args.serve)
        startup = {"build_seconds": built, "warm_up_seconds": warm, "warm_up_phases": generator.warm_up_phases,
                   "ranks": worker.description}  # fmt: skip
        if args.serve:
            from runner.serving.serve import serve

            serve(generator, job.tokenizer, engine, spec, args.backend, startup, parent_pid=args.serve_parent_pid)
            return 0
        print(f"mode: {generator.mode(params)}; rank 0: {worker.description}")
        if job.defaults_applied:
            chosen = ", ".join(f"{k} {v}" for k, v in job.defaults_applied.items())
            print(f"sampling: {chosen} from the checkpoint's generation_config.json")
        print(f"startup: ranks built in {built:.2f} s, warm-up (a short request: graph capture, kernel compilation) "
              f"{warm:.2f} s", flush=True)  # fmt: skip
        results, batch = generate_all(args, generator, job)
    finally:
        ranks.close()
    if args.output_json:
        args.output_json.write_text(
            json.dumps(
                {
                    "backend": args.backend,
                    "world_size": comm.Get_size(),
                    "spec": spec.to_dict(),
                    "sampling": {
                        "temperature": params.temperature,
                        "top_k": params.top_k,
                        "top_p": params.top_p,
                        "from_generation_config": job.defaults_applied,
                    },  # fmt: skip
                    "end_ids": sorted(job.end_ids),
                    "startup": startup,
                    "results": results,
                    "batch": batch,
                },
                indent=1,
            )
        )
    return 0


def main(argv=None) -> int:
    from runner.mpi import run_on_all_ranks

    return run_on_all_ranks(lambda comm: main_on_rank(comm, argv))
