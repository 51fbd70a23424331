"""Acceptance of the trained pair (`trained/`): DFlash chain and DDTree budgets against autoregressive decoding.

    PYTHONPATH=. python3 benchmarks/acceptance.py OUT_DIR [--device cpu|cuda] [--prompts 128] [--tokens 64]
        [--temperatures 0 1.0] [--modes chain ddtree4 ddtree8 ddtree16 ddtree32]

The pair is converted at TP 1 (float32 on the CPU, bf16 on a GPU) and run through the rank factory as the CLI runs
it (the device loop on a GPU, one CUDA graph a step; the host loop on the CPU) on the committed held-out prompts
(`trained/heldout_prompts.json`, functions of held-out stdlib files cut after their `def` line). Per mode and
temperature: mean acceptance length (tokens a step emits: the accepted drafted tokens plus the bonus), its
distribution, acceptance per draft position (the share of steps that accepted at least d drafted tokens), decode
tokens/s (median over prompts of each prompt's rate; every mode runs the same prompts) and the speed-up over
autoregressive decoding at the same temperature. Temperature 1.0 draws with a per-prompt seed. The modes run
interleaved (each prompt through every mode in turn), so the machine's drift during the run affects them alike.
A mode named twice (`ddtree16 ddtree16#2`) runs twice, on ranks of its own each time: how far two runs of the same
mode land apart is the run-to-run noise the other comparisons are read against. With `auto` among the modes, each
mode's decode rate over all prompts (decode tokens over decode seconds) is compared with auto's, paired by prompt:
the ratio and its 95 % bootstrap interval (prompts resampled, 2000 draws).
Writes OUT_DIR/acceptance.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
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


class ModeRun:
    """One mode's ranks and what its requests gave (`run_modes` runs the modes interleaved, prompt by prompt)."""

    def __init__(self, ckpt: Path, device: str, mode: str, tokens: int, temperature: float):
        self.mode, self.spec, self.temperature = mode, MODES[mode.split("#")[0]], temperature
        self.autoregressive = self.spec is None
        options = RankOptions("torch", device, None, self.autoregressive)
        build = BuildConfig(max_input_len=128, max_seq_len=128 + tokens + 64)
        ranks = local_ranks(CheckpointWeights(ckpt), options, self.spec or SpecConfig(8, 32), build)
        self.generator = Generator(ranks, self.autoregressive)
        self.requests = (SamplingParams(),) if temperature == 0 else (SamplingParams(temperature=temperature, seed=1),)
        self.costs = dict(self.generator.enable_auto_budget()) if self.spec is MODES["auto"] else None  # at start-up
        self.generator.warm_up(self.requests)
        self.accept, self.rates, self.emitted, self.budgets, self.seconds = [], [], 0, [], 0.0
        self.decoded: list[tuple[int, float]] = []  # per prompt: tokens after the first, and the seconds they took

    def request(self, i: int, prompt: list[int], tokens: int, end_ids) -> None:
        t = self.temperature
        params = SamplingParams(temperature=t, seed=1000 + i) if t else SamplingParams()
        start = time.perf_counter()
        result = self.generator.generate(prompt, tokens, params, end_ids=end_ids)
        self.seconds += time.perf_counter() - start
        self.accept += result.accept_lengths
        self.budgets += result.budgets
        self.emitted += len(result.tokens)
        if result.decode_tokens_per_s:
            self.rates.append(result.decode_tokens_per_s)
        self.decoded.append((len(result.tokens) - 1, result.decode_seconds))

    def row(self, prompts: int) -> dict:
        accept, policy = self.accept, self.generator.policy
        rate = round(statistics.median(self.rates), 1) if self.rates else 0.0
        row = {"mode": self.mode, "temperature": self.temperature, "runs": self.generator.mode(self.requests[0]),
               "prompts": prompts, "tokens": self.emitted, "seconds": round(self.seconds, 2),
               "decode_tokens_per_s_median": rate}  # fmt: skip
        if not self.autoregressive:
            depth = self.spec.draft_depth
            row["steps"] = len(accept)
            row["mean_accept_length"] = round(sum(accept) / len(accept), 3)
            row["accept_length_histogram"] = {n: accept.count(n) for n in range(1, depth + 2)}
            # accept_length counts the bonus: at least d drafted tokens accepted <=> accept_length >= d + 1
            row["accepted_by_position"] = [round(sum(a >= d + 1 for a in accept) / len(accept), 4)
                                           for d in range(1, depth + 1)]  # fmt: skip
        if self.costs is not None:  # the budgets auto chose, step costs at start-up and at the end (moving average)
            row["step_ms"] = {b: round(c * 1e3, 3) for b, c in self.costs.items()}
            row["budgets_chosen"] = {b: self.budgets.count(b) for b in sorted(set(self.budgets))}
            steps = self.generator.step_policy if self.generator.on_device(self.requests[0], budget="auto") else None
            if steps is not None:  # the device loop's `StepBudgetPolicy`: the steps at the largest budget inform
                row["policy"] = "StepBudgetPolicy (device loop: a graph a budget, chosen before each launch)"
                row["step_ms_at_end"] = {b: round(steps.cost(b) * 1e3, 3) for b in steps.budgets}
                largest = steps.budgets[-1]
                informed = max(1, steps.informed[largest])
                row["drafted_accepted_predicted_per_step"] = round(steps.predicted[largest] / informed, 3)
                row["drafted_accepted_observed_per_step"] = round(steps.accepted[largest] / informed, 3)
            else:
                row["policy"] = "BudgetPolicy (host loop: chosen from each step's tree)"
                row["step_ms_at_end"] = {b: round(c * 1e3, 3) for b, c in policy.step_seconds.items()}
                taken = max(1, sum(policy.chosen.values()))
                row["drafted_accepted_predicted_per_step"] = round(policy.predicted / taken, 3)
                row["drafted_accepted_observed_per_step"] = round(policy.observed / taken, 3)
        return row


def run_modes(ckpt: Path, device: str, modes: list[str], prompts, tokens: int, temperature: float,
              end_ids) -> list[dict]:  # fmt: skip
    """Every mode's ranks built first, then each prompt through every mode in turn (the order rotating), so a
    machine whose speed drifts during the run slows every mode alike."""
    runs = [ModeRun(ckpt, device, mode, tokens, temperature) for mode in modes]
    for i, prompt in enumerate(prompts):
        for k in range(len(runs)):
            runs[(i + k) % len(runs)].request(i, prompt, tokens, end_ids)
    rows = [run.row(len(prompts)) for run in runs]
    autos = [run for run in runs if run.costs is not None]
    for run, row in zip(runs, rows):
        if autos and run is not autos[0]:
            row["auto_over_this"] = paired_ratio(autos[0].decoded, run.decoded)
    for run in runs:
        run.generator.ranks.close()
    return rows


def paired_ratio(ours: list[tuple[int, float]], theirs: list[tuple[int, float]], draws: int = 2000) -> dict:
    """Decode rate over all prompts (tokens over seconds) of `ours` over `theirs`, paired by prompt, with its 95 %
    bootstrap interval: the prompts resampled with replacement, the same ones for both."""
    a, b = np.array(ours, dtype=np.float64), np.array(theirs, dtype=np.float64)

    def ratio(index):
        return (a[index, 0].sum() / a[index, 1].sum()) / (b[index, 0].sum() / b[index, 1].sum())

    rng = np.random.default_rng(0)
    samples = [ratio(rng.integers(0, len(a), len(a))) for _ in range(draws)]
    low, high = np.quantile(samples, [0.025, 0.975])
    return {"ratio": round(float(ratio(np.arange(len(a)))), 4), "low": round(float(low), 4),
            "high": round(float(high), 4)}  # fmt: skip


def comparison(rows: list[dict]) -> str:
    """`auto` against every other mode, paired by prompt (`paired_ratio`)."""
    lines = ["| temperature | auto over | ratio | 95 % interval |", "|---|---|---:|---|"]
    for r in rows:
        if "auto_over_this" in r:
            c = r["auto_over_this"]
            lines.append(f"| {r['temperature']} | {r['mode']} | {c['ratio']:.3f} | {c['low']:.3f} – {c['high']:.3f} |")
    return "\n".join(lines)


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


def mode_name(value: str) -> str:
    if value.split("#")[0] not in MODES:
        raise argparse.ArgumentTypeError(f"mode must be one of {list(MODES)} (NAME#k for a repeat), got {value!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a prompt (fewer at [EOS])")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "auto"], type=mode_name,
                        help=f"of {list(MODES)}; NAME#2 runs NAME a second time")  # fmt: skip
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
            for row in run_modes(ckpt, args.device, modes, prompts, args.tokens, temperature, end_ids):
                print(json.dumps(row), flush=True)
                rows.append(row)
    table = markdown(rows)
    if any("auto_over_this" in r for r in rows):
        table += "\n\n" + comparison(rows)
    result = {**environment(False), "dtype": dtype, "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "table": table}  # fmt: skip
    (args.out_dir / "acceptance.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
