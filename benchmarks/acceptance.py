"""Acceptance of the trained pair (`trained/`): DFlash chain and DDTree budgets against autoregressive decoding.

    PYTHONPATH=. python3 benchmarks/acceptance.py OUT_DIR [--device cpu|cuda] [--prompts 128] [--tokens 64]
        [--temperatures 0 1.0] [--modes chain ddtree4 ddtree8 ddtree16 ddtree32]

The pair is converted at TP 1 (float32 on the CPU, bf16 on a GPU) and run through the rank factory as the CLI runs
it (the device loop on a GPU, one CUDA graph a step; the host loop on the CPU) on the committed held-out prompts
(`trained/heldout_prompts.json`, functions of held-out stdlib files cut after their `def` line). Per mode and
temperature: mean acceptance length (tokens a step emits: the accepted drafted tokens plus the bonus), its
distribution, acceptance per draft position (the share of steps that accepted at least d drafted tokens), decode
tokens/s (median over prompts of each prompt's rate; every mode runs the same prompts) and the speed-up over
autoregressive decoding at the same temperature. Temperature 1.0 draws with a per-prompt seed. Writes
OUT_DIR/acceptance.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment
from engines.spec import BuildConfig, SpecConfig
from runner.factory import CheckpointWeights, RankOptions, local_ranks
from runner.generator import Generator
from runner.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent / "trained"
MODES = {
    "autoregressive": None,
    "chain": SpecConfig(8, 7, 1),
    "ddtree4": SpecConfig(8, 4),
    "ddtree8": SpecConfig(8, 8),
    "ddtree16": SpecConfig(8, 16),
    "ddtree32": SpecConfig(8, 32),
    "auto": SpecConfig(8, 32, extra_budgets=(4, 8, 16)),  # the budget chosen every step (runner/budget.py)
}


def convert_pair(out: Path, dtype: str, target: Path = ROOT / "kimi-k2-py", drafter: Path = ROOT / "kimi-k2-py-dflash"):
    from builder.convert import convert

    convert(target, drafter, out, 1, dtype, force=True)
    return out


def load_prompts(tokenizer_dir: Path, count: int) -> list[list[int]]:
    from runner.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir, 4096)
    prompts = json.loads((ROOT / "heldout_prompts.json").read_text())[:count]
    return [tokenizer.encode(p["text"]) for p in prompts]


def run_mode(ckpt: Path, device: str, mode: str, prompts, tokens: int, temperature: float, end_ids) -> dict:
    spec = MODES[mode]
    autoregressive = spec is None
    options = RankOptions("torch", device, None, autoregressive)
    build = BuildConfig(max_input_len=128, max_seq_len=128 + tokens + 64)
    generator = Generator(local_ranks(CheckpointWeights(ckpt), options, spec or SpecConfig(8, 32), build),
                          autoregressive)  # fmt: skip
    requests = (SamplingParams(),) if temperature == 0 else (SamplingParams(temperature=temperature, seed=1),)
    costs = generator.enable_auto_budget() if mode == "auto" else None
    generator.warm_up(requests)
    accept, rates, emitted, steps, budgets = [], [], 0, 0, []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=1000 + i) if temperature else SamplingParams()
        result = generator.generate(prompt, tokens, params, end_ids=end_ids)
        accept += result.accept_lengths
        budgets += result.budgets
        emitted += len(result.tokens)
        steps += len(result.accept_lengths)
        if result.decode_tokens_per_s:
            rates.append(result.decode_tokens_per_s)
    seconds = time.perf_counter() - start
    description = generator.mode(requests[0])
    policy = generator.policy
    generator.ranks.close()
    row = {"mode": mode, "temperature": temperature, "runs": description, "prompts": len(prompts),
           "tokens": emitted, "seconds": round(seconds, 2),
           "decode_tokens_per_s_median": round(statistics.median(rates), 1) if rates else 0.0}  # fmt: skip
    if not autoregressive:
        depth = spec.draft_depth
        row["steps"] = len(accept)
        row["mean_accept_length"] = round(sum(accept) / len(accept), 3)
        row["accept_length_histogram"] = {n: accept.count(n) for n in range(1, depth + 2)}
        # accept_length counts the bonus: at least d drafted tokens accepted <=> accept_length >= d + 1
        row["accepted_by_position"] = [round(sum(a >= d + 1 for a in accept) / len(accept), 4)
                                       for d in range(1, depth + 1)]  # fmt: skip
    if costs is not None:  # the budgets auto chose, their measured step costs, predicted vs observed acceptance
        row["step_ms"] = {b: round(s * 1e3, 3) for b, s in costs.items()}
        row["budgets_chosen"] = {b: budgets.count(b) for b in sorted(set(budgets))}
        row["drafted_accepted_predicted_per_step"] = round(policy.predicted / max(1, sum(policy.chosen.values())), 3)
        row["drafted_accepted_observed_per_step"] = round(policy.observed / max(1, sum(policy.chosen.values())), 3)
    return row


def markdown(rows: list[dict]) -> str:
    head = "| temperature | mode | mean acceptance length | tokens/s (median) | speed-up | accepted at position 1..7 |"
    lines = [head, "|---|---|---|---|---|---|"]
    base = {r["temperature"]: r["decode_tokens_per_s_median"] for r in rows if r["mode"] == "autoregressive"}
    for r in rows:
        speed = r["decode_tokens_per_s_median"] / base[r["temperature"]] if base.get(r["temperature"]) else 0
        positions = " ".join(f"{p:.2f}" for p in r.get("accepted_by_position", []))
        lines.append(f"| {r['temperature']} | {r['mode']} | {r.get('mean_accept_length', 1.0):.2f} | "
                     f"{r['decode_tokens_per_s_median']:.0f} | {speed:.2f}x | {positions} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a prompt (fewer at [EOS])")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "auto"], choices=list(MODES))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    modes = ["autoregressive"] + [m for m in args.modes if m != "autoregressive"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_pair(Path(tmp) / "ckpt", dtype)
        prompts = load_prompts(ROOT / "kimi-k2-py", args.prompts)
        stop = json.loads((ROOT / "kimi-k2-py" / "generation_config.json").read_text())["eos_token_id"]
        end_ids = frozenset(stop if isinstance(stop, list) else [stop])
        for temperature in args.temperatures:
            for mode in modes:
                row = run_mode(ckpt, args.device, mode, prompts, args.tokens, temperature, end_ids)
                print(json.dumps(row), flush=True)
                rows.append(row)
    table = markdown(rows)
    result = {**environment(args.device == "cpu"), "dtype": dtype, "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "table": table}  # fmt: skip
    (args.out_dir / "acceptance.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
