"""What users launch against the same engine in process, in one run: the CLI's decode tokens/s next to the rank
factory's in-process rows for the same engine directory, prompts and modes.

    PYTHONPATH=. python3 benchmarks/cli_vs_inprocess.py OUT_DIR [--tp 1,2] [--preset moe] [--new-tokens 256]
    PYTHONPATH=. python3 benchmarks/cli_vs_inprocess.py OUT_DIR --smoke        (tiny shapes on the CPU)

1. A Kimi-architecture HF checkpoint at the preset's dimensions (`builder.demo_checkpoints --preset`; "moe": hidden
   2048, 8 layers, 16 heads, MLA 1536/512/64, 64 experts of width 768, top-8, vocab 32768, bf16), converted and
   built for each TP size with `build-engine --no_onnx` (the torch backend's engine directory: the checkpoint).
2. The CLI: `mpirun -np N python -m runner --engine_dir E --backend torch --output_json ...`, the same prompt
   `--repeats` times, for autoregressive and DDTree 32 (the device loop: the CLI's default on a GPU) and DDTree 32 on
   `--loop host`; the CLI's own decode tokens/s (after the first token), median over the requests.
3. In process (TP-1 only: in-process ranks on a GPU run one rank): the same engine directory through
   `runner.factory.local_ranks` and `runner.generator.Generator`, the same prompt ids and modes.
Target: the CLI within 10% of the in-process row (autoregressive and DDTree 32). Writes OUT_DIR/cli_vs_inprocess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment

PROMPT = (
    "Speculative decoding drafts a block of tokens with a small model and verifies the whole block with one forward "
    "of the large model, so every accepted token costs a fraction of a forward. A tree of drafts verifies several "
    "continuations at once and keeps the longest path the target agrees with."
)
MODES = (  # name, CLI flags, in-process (loop, autoregressive)
    ("autoregressive", ["--autoregressive"], (None, True)),
    ("ddtree 32", [], (None, False)),
    ("ddtree 32, host loop", ["--loop", "host"], (False, False)),
)


def build_engines(work: Path, preset: str, tp_sizes: list[int], smoke: bool) -> dict[int, Path]:
    from builder.demo_checkpoints import write_preset

    device = "cpu" if smoke else "cuda"
    dtype = "float32" if smoke else "bfloat16"
    started = time.perf_counter()
    target, drafter = write_preset(work / "hf", preset, dtype, force=True, device=device, smoke=smoke)
    print(f"HF checkpoint: {time.perf_counter() - started:.1f} s", flush=True)
    engines = {}
    for tp in tp_sizes:
        engines[tp] = work / f"engine-tp{tp}"
        command = [sys.executable, "-m", "builder.cli", "--model_dir", str(target), "--draft_model_dir", str(drafter),
                   "--tp_size", str(tp), "--output_dir", str(engines[tp]), "--max_input_len", "128",
                   "--max_seq_len", "1024", "--ddtree_budget", "32", "--no_onnx", "--force"]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=_env())
        if done.returncode:
            raise RuntimeError(f"build-engine failed:\n{done.stderr[-3000:]}")
        print(f"engine tp{tp}: {time.perf_counter() - started:.1f} s", flush=True)
    return engines


def run_cli(engine: Path, tp: int, flags: list[str], repeats: int, new_tokens: int, out: Path) -> dict:
    launcher = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")
    command = [
        launcher,
        "-np",
        str(tp),
        sys.executable,
        "-m",
        "runner",
        "--engine_dir",
        str(engine),
        "--backend",
        "torch",
        "--max_output_len",
        str(new_tokens),
        "--end_id",
        "-1",
        "--output_json",
        str(out),
        *flags,
    ]
    command += ["--input_text", PROMPT] * repeats  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"the CLI failed ({' '.join(command)}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    results = report["results"]
    mode_line = next((line for line in done.stdout.splitlines() if line.startswith("mode:")), "")
    return {
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in results),
        "decode_tokens_per_s_all": [r["decode_tokens_per_s"] for r in results],
        "prefill_ms": statistics.median(r["prefill_seconds"] * 1e3 for r in results),
        "mean_accept_length": statistics.median(
            sum(r["accept_lengths"]) / len(r["accept_lengths"]) if r["accept_lengths"] else 1.0 for r in results
        ),
        "startup": report["startup"],
        "mode_printed": mode_line,
        "process_wall_s": wall,
        "output_ids": results[0]["output_ids"],
    }


def run_in_process(engine: Path, loop, autoregressive: bool, repeats: int, new_tokens: int, device: str) -> dict:
    from engines.engine_dir import load_engine_dir
    from runner.factory import RankOptions, local_ranks
    from runner.generator import Generator
    from runner.tokenizer import load_tokenizer

    engine_dir = load_engine_dir(engine)
    vocab = engine_dir.config["pretrained_config"]["target"]["vocab_size"]
    prompt = load_tokenizer(engine_dir.tokenizer_dir, vocab).encode(PROMPT)
    options = RankOptions("torch", device, device_loop=loop, autoregressive=autoregressive)
    generator = Generator(local_ranks(engine_dir, options), autoregressive)
    warm = generator.warm_up()
    results = [generator.generate(prompt, new_tokens) for _ in range(repeats)]
    generator.ranks.close()
    return {
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in results),
        "decode_tokens_per_s_all": [r.decode_tokens_per_s for r in results],
        "prefill_ms": statistics.median(r.prefill_seconds * 1e3 for r in results),
        "mean_accept_length": results[0].mean_accept_length or 1.0,
        "warm_up_s": warm,
        "repeats_agree": all(r.tokens == results[0].tokens for r in results),
        "mode": generator.mode(),
        "output_ids": results[0].tokens,
    }


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), OMP_NUM_THREADS="1",
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tp", default="1", help="comma-separated TP sizes (mpirun -np); 2 needs two GPUs")
    parser.add_argument("--preset", default="moe", choices=["moe", "dense"])
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens a request (default 256; smoke 24)")
    parser.add_argument("--repeats", type=int, default=3, help="requests a mode; the median is reported")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    parser.add_argument("--work_dir", type=Path, default=None, help="where checkpoints and engines go (default: tmp)")
    args = parser.parse_args(argv)
    tp_sizes = [int(t) for t in args.tp.split(",")]
    new_tokens = args.new_tokens or (24 if args.smoke else 256)
    device = "cpu" if args.smoke else "cuda"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ddtree-cli-bench-"))
    engines = build_engines(work, args.preset, tp_sizes, args.smoke)
    rows = []
    for name, flags, (loop, autoregressive) in MODES:
        row = {"mode": name}
        if 1 in tp_sizes:
            with torch.no_grad():
                row["in_process"] = run_in_process(engines[1], loop, autoregressive, args.repeats, new_tokens, device)
        for tp in tp_sizes:
            row[f"cli_tp{tp}"] = run_cli(engines[tp], tp, flags, args.repeats, new_tokens, args.out_dir / "cli.json")
        if "in_process" in row:
            inproc = row["in_process"]["decode_tokens_per_s"]
            row["cli_over_in_process"] = row["cli_tp1"]["decode_tokens_per_s"] / inproc if 1 in tp_sizes else None
            row["same_tokens"] = {f"cli_tp{tp}": row[f"cli_tp{tp}"]["output_ids"] == row["in_process"]["output_ids"]
                                  for tp in tp_sizes}  # fmt: skip
        for key in [k for k in row if k.startswith(("cli_", "in_process"))]:
            if isinstance(row[key], dict):
                row[key].pop("output_ids", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {**environment(args.smoke), "preset": args.preset, "tp_sizes": tp_sizes, "new_tokens": new_tokens,
                  "repeats": args.repeats, "rows": rows, "command": " ".join(sys.argv)}  # fmt: skip
        (args.out_dir / "cli_vs_inprocess.json").write_text(json.dumps(result, indent=1))  # after each mode
    (args.out_dir / "cli.json").unlink(missing_ok=True)
    header = "| mode | in process (TP-1) | " + " | ".join(f"CLI TP-{tp}" for tp in tp_sizes) + " | CLI / in process |"
    print("\n" + header + "\n" + "|---" * (3 + len(tp_sizes)) + "|")
    for row in rows:
        inproc = row.get("in_process", {}).get("decode_tokens_per_s")
        cells = [f"{row[f'cli_tp{tp}']['decode_tokens_per_s']:.1f}" for tp in tp_sizes]
        ratio = row.get("cli_over_in_process")
        print(f"| {row['mode']} | {inproc:.1f} | " + " | ".join(cells) + f" | {ratio:.3f} |" if inproc else
              f"| {row['mode']} | - | " + " | ".join(cells) + " | - |")  # fmt: skip
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
