"""The cost-aware tree budget on a whole Kimi K2 rank's step costs, with acceptance traces of the trained pair.

    PYTHONPATH=. python3 benchmarks/budget_traces.py OUT_DIR [--prompts 64] [--tokens 64] [--temperatures 0 1.0]
        [--costs benchmarks/results/kimi_rank_int4.json] [--batch-costs benchmarks/results/kimi_rank_batch.json]
    PYTHONPATH=. python3 benchmarks/budget_traces.py OUT_DIR --smoke      (3 prompts: checks the script)

1. Traces. The trained pair (`trained/`, float32, the CPU, the rank factory's host loop) generates the held-out
   prompts with DDTree at budget 32; every step records what the policy sees, the tree's best-first path
   log-probabilities, and what the target accepted, the path's node indices. Best-first, the tree of budget b is
   the first b nodes of this one, so the path's nodes numbered b or less are what budget b accepts at that step
   (greedy: exactly, the target's choices at those nodes are the same; sampled: the same law, each node's draw
   being the target's distribution there). The steps follow budget 32's sequence of contexts.
2. Replay. Each budget's step cost is what one H200 measured for a whole Kimi K2 TP-8 rank with INT4 experts
   (`kimi_rank_int4.py`, the random-drafter rows: a step costs the same whatever it accepts), at each context the
   file has. A fixed budget emits, a step, the tokens its prefix of the path holds (accepted drafts + the bonus);
   `auto` is `runner.budget.BudgetPolicy` as the generator runs it (those costs, its calibration learnt online),
   fed the steps in order: it chooses from the step's scores, then records the path its budget took; `auto (device
   loop)` is `runner.device.budget.StepBudgetPolicy`, what a GPU's device loop runs (it chooses before the step's
   launch, learns acceptance from its steps at the largest budget and explores on a share of the time; each step's
   time is its budget's cost). Tokens/s = tokens emitted over the steps' summed costs; autoregressive decoding = one
   token a decode step. The per-step bound: the most tokens a second any per-step choice among the budgets reaches
   knowing each step's acceptance (`per_step_bound`), what a better per-step predictor could at most buy. --traces
   reuses the traces of an earlier run's budget_traces.json.
3. --batch-costs: the same traces in a batch of the whole rank (`kimi_rank_int4.py --batches`, its random-drafter
   rows: a batched step's cost at each fixed budget it has): each request of the batch emits what its trace's steps
   do at that budget, so the batch's tokens/s at budget b is the batch times the mean tokens a step over the batched
   step's cost, against the batch's autoregressive steps.
Writes OUT_DIR/budget_traces.json (the traces and the table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.acceptance import ROOT as TRAINED
from benchmarks.acceptance import convert_pair, load_prompts
from benchmarks.common import environment
from engines.spec import BuildConfig, SpecConfig
from runner.budget import BudgetPolicy
from runner.device.budget import DECODE, StepBudgetPolicy, expected_drafted
from runner.factory import CheckpointWeights, RankOptions, local_ranks
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate

BUDGETS = (8, 16, 32)
RESULTS = Path(__file__).resolve().parent / "results"


class TraceRecorder:
    """A policy that always keeps the largest budget and records each step's scores and accepted path."""

    def __init__(self, budget: int):
        self.budget, self.steps, self.scores = budget, [], None

    def choose(self, scores) -> int:
        self.scores = [round(float(s), 5) for s in scores]
        return self.budget

    def start_sequence(self) -> None:
        """A new request (`runner.budget.BudgetPolicy.start_sequence`): each request's steps are kept on their own."""

    def record(self, accept_length: int, seconds: float | None = None, path: list[int] | None = None) -> None:
        self.steps.append({"scores": self.scores, "path": [int(n) for n in path]})


def record_traces(prompts: int, tokens: int, temperature: float, smoke: bool) -> list[dict]:
    """Every held-out prompt's steps at budget 32 (a list of {scores, path} per prompt)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_pair(Path(tmp) / "ckpt", "float32")
        spec = SpecConfig(8, max(BUDGETS))
        options = RankOptions("torch", "cpu", None, False)
        ranks = local_ranks(CheckpointWeights(ckpt), options, spec, BuildConfig(128, 128 + tokens + 64))
        stop = json.loads((TRAINED / "kimi-k2-py" / "generation_config.json").read_text())["eos_token_id"]
        end_ids = frozenset(stop if isinstance(stop, list) else [stop])
        traces = []
        for i, prompt in enumerate(load_prompts(TRAINED / "kimi-k2-py", prompts)):
            params = SamplingParams(temperature=temperature, seed=1000 + i) if temperature else SamplingParams()
            recorder = TraceRecorder(spec.budget)
            generate(ranks, prompt, tokens, spec, Sampler(params), end_ids, policy=recorder)
            traces.append({"prompt": i, "steps": recorder.steps})
        ranks.close()
    return traces


def budget_path(path: list[int], budget: int) -> list[int]:
    """The accepted path of the budget's tree: the largest tree's path up to its first node past the budget."""
    taken = []
    for node in path:
        if node > budget:
            break
        taken.append(node)
    return taken


def row_costs(rows: list[dict], key, seconds) -> dict:
    """key(row) -> {"autoregressive": s, budget: s, ...}: seconds(row) of each autoregressive row and each
    random-drafter fixed-budget row."""
    costs: dict = {}
    for r in rows:
        if r["mode"].startswith("autoregressive"):
            costs.setdefault(key(r), {})["autoregressive"] = seconds(r)
        elif r["drafter"] == "random" and (fixed := re.fullmatch(r"ddtree (\d+)( \(device loop\))?", r["mode"])):
            costs.setdefault(key(r), {})[int(fixed.group(1))] = seconds(r)
    return costs


def step_costs(costs_file: Path) -> dict[int, dict]:
    """context -> {"autoregressive": s, 8: s, 16: s, 32: s}: step seconds of the random-drafter rows (a budget's own
    engine)."""
    rows = json.loads(costs_file.read_text())["rows"]
    costs = row_costs(rows, lambda r: r["context"], lambda r: r["step_ms"] / 1e3)
    return {c: v for c, v in costs.items() if all(b in v for b in (*BUDGETS, "autoregressive"))}


def path_tokens(traces: list[dict], budgets) -> np.ndarray:
    """The tokens each budget emits at each step of the traces (its prefix of the step's path), [steps, budgets]."""
    steps = [s for t in traces for s in t["steps"]]
    return np.array([[len(budget_path(s["path"], b)) for b in budgets] for s in steps], dtype=np.float64)


def batch_step_costs(costs_file: Path) -> dict[tuple[int, int], dict]:
    """(context, batch) -> {"autoregressive": s, b: s, ...}: a batched step's seconds (the batch's requests over
    their tokens/s together) of the in-flight batched rows (`kimi_rank_int4.py --batches`), autoregressive and the
    random drafter's fixed budgets: a random drafter's step accepts only the bonus token, one a request."""
    rows = [r for r in json.loads(costs_file.read_text())["rows"] if r.get("batch")]
    costs = row_costs(rows, lambda r: (r["context"], r["batch"]), lambda r: r["batch"] / r["tokens_per_s"])
    return {k: v for k, v in costs.items() if "autoregressive" in v and len(v) > 1}


def batch_rates(traces: list[dict], costs: dict, batch: int) -> dict:
    """Tokens/s of a batch of `batch` requests at each fixed budget the costs have: each request's step emits what
    its trace's step does at that budget (greedy: exactly what it would; a step of the batch costs what the batched
    random-drafter row measured), so the batch emits `batch` times the traces' mean a step; and `auto`'s
    (`batch_auto`)."""
    budgets = sorted(k for k in costs if k != "autoregressive")
    accept = dict(zip(budgets, path_tokens(traces, budgets).mean(axis=0).tolist()))
    rates = {"autoregressive": batch / costs["autoregressive"]}
    for b in budgets:
        rates[f"ddtree {b}"] = batch * accept[b] / costs[b]
    rates["auto"], chosen = batch_auto(traces, costs, batch)
    return {"tokens_per_s": {k: round(v, 2) for k, v in rates.items()},
            "over_autoregressive": {k: round(v / rates["autoregressive"], 3) for k, v in rates.items()},
            "mean_accept_length": {str(b): round(a, 3) for b, a in accept.items()},
            "auto_steps": chosen}  # fmt: skip


def step_stats(step: dict, budgets) -> dict:
    """A trace step's statistics as a device-loop step reports them for `budgets` (`DeviceLoop.read_stats`): the
    drafted tokens each budget's prefix of the path accepted, and what the drafter expected there."""
    drafted = expected_drafted(torch.tensor(step["scores"]), torch.tensor(list(budgets))).tolist()
    return {
        "accepted": {b: len(budget_path(step["path"], b)) - 1 for b in budgets},
        "drafted": dict(zip(budgets, drafted)),
    }


def batch_auto(traces: list[dict], costs: dict, batch: int) -> tuple[float, dict[str, int]]:
    """An all-`auto` batch of `batch` busy requests as the device loop's batch runs it (`Batcher`): the batch's
    `StepBudgetPolicy` (the batched costs' budgets and an autoregressive step, seeded with those costs as warm-up's
    `Generator.measure_batch_costs` seeds it) chooses each step; a step at budget b takes each request's next trace
    step and emits its prefix of the path (statistics for b and the budgets below it where the policy asks them,
    else its accepted lengths); an autoregressive step emits one token a request and takes no trace step (that
    request's next step then drafts one token later than the trace did: an approximation). Request j walks traces j,
    j + batch, ... cyclically until the batch has emitted the traces' tokens at the largest budget. Returns (tokens
    a second, {choice: steps}; "0": an autoregressive step)."""
    budgets = tuple(sorted(k for k in costs if k != "autoregressive"))
    seconds_of = {DECODE: costs["autoregressive"], **{b: costs[b] for b in budgets}}
    policy = StepBudgetPolicy(budgets, decode=True, narrow_informs=True, max_tokens=8,
                              step_costs={(batch, b): s for b, s in seconds_of.items()})  # fmt: skip
    walks = [[s for t in traces[j::batch] for s in t["steps"]] for j in range(batch)]
    at = [0] * batch
    goal = sum(len(budget_path(s["path"], budgets[-1])) for t in traces for s in t["steps"])
    emitted, seconds = 0, 0.0
    while emitted < goal:
        chosen = policy.choose(batch, batch)
        report = policy.reports(chosen)
        seconds += seconds_of[chosen]
        if chosen == DECODE:
            emitted += batch
            policy.record(batch, DECODE, seconds_of[DECODE], [])
            continue
        told = [b for b in budgets if b <= chosen]
        stats, accepted = [], []
        for j, walk in enumerate(walks):
            step = walk[at[j] % len(walk)]
            at[j] += 1
            path = budget_path(step["path"], chosen)
            emitted += len(path)
            accepted.append(len(path) - 1)
            if report:
                stats.append(step_stats(step, told))
        timed = report and policy.timed(chosen, batch)  # as `Batcher._collect`: a reported step's time counts only
        policy.record(batch, chosen, None if timed else seconds_of[chosen], stats)  # while its pair has none
        if not report:
            policy.observe(chosen, accepted)
    return emitted / seconds, {str(b): n for (_, b), n in sorted(policy.chosen.items())}


def per_step_bound(tokens: np.ndarray, seconds: np.ndarray) -> tuple[float, np.ndarray]:
    """The most tokens a second any choice of a budget per step reaches, knowing what each budget accepts at every
    step (tokens [steps, budgets]; seconds [budgets]): (that rate, how many steps take each budget). The best rate r
    is where the steps' best choices, each the most tokens less r times its seconds, sum to zero (Dinkelbach's
    iteration from the best fixed budget's rate: it rises to r in a few rounds). An upper bound for every policy,
    fixed or per step, that chooses among these budgets: what a drafter's per-step confidence could at most buy."""
    rate = float((tokens.sum(axis=0) / (len(tokens) * seconds)).max())
    for _ in range(100):
        choice = (tokens - rate * seconds).argmax(axis=1)
        better = float(tokens[np.arange(len(tokens)), choice].sum() / seconds[choice].sum())
        if better <= rate * (1 + 1e-12):
            break
        rate = better
    return rate, np.bincount(choice, minlength=len(seconds))


def replay(traces: list[dict], costs: dict) -> dict:
    """Tokens/s of autoregressive decoding, each fixed budget and `auto` over the traces at these step costs."""
    steps = [s for t in traces for s in t["steps"]]
    tokens = path_tokens(traces, BUDGETS)  # [steps, budgets], and over all steps:
    emitted_at = dict(zip(BUDGETS, tokens.sum(axis=0).tolist()))
    rates = {"autoregressive": 1.0 / costs["autoregressive"]}
    for b in BUDGETS:
        rates[f"ddtree {b}"] = emitted_at[b] / (len(steps) * costs[b])
    policy = BudgetPolicy(BUDGETS, {b: costs[b] for b in BUDGETS})
    emitted, seconds = 0, 0.0
    for s in steps:
        chosen = policy.choose(np.array(s["scores"]))
        path = budget_path(s["path"], chosen)
        policy.record(len(path), None, path)
        emitted += len(path)
        seconds += costs[chosen]
    rates["auto"] = emitted / seconds
    device, emitted, seconds = StepBudgetPolicy(BUDGETS, {b: costs[b] for b in BUDGETS}), 0, 0.0
    for s in steps:
        chosen = device.choose()
        emitted += len(budget_path(s["path"], chosen))
        seconds += costs[chosen]
        stats = []
        if chosen == BUDGETS[-1]:  # what the device loop's statistics say of every budget
            stats = [step_stats(s, BUDGETS)]
        device.record(1, chosen, costs[chosen], stats)
    rates["auto (device loop)"] = emitted / seconds
    rates["per-step bound"], bound_choices = per_step_bound(tokens, np.array([costs[b] for b in BUDGETS]))
    fixed = [rates[f"ddtree {b}"] for b in BUDGETS]
    return {"steps": len(steps), "tokens_per_s": {k: round(v, 2) for k, v in rates.items()},
            "auto_over_best": round(rates["auto"] / max(fixed), 4),
            "auto_over_worst": round(rates["auto"] / min(fixed), 4),
            "budgets_chosen": {b: policy.chosen[b] for b in BUDGETS},
            "device_auto_over_best": round(rates["auto (device loop)"] / max(fixed), 4),
            "device_budgets_chosen": {b: device.chosen[(1, b)] for b in BUDGETS},
            "bound_over_best": round(rates["per-step bound"] / max(fixed), 4),
            "bound_budgets": dict(zip(BUDGETS, bound_choices.tolist())),
            "mean_accept_length": {b: round(emitted_at[b] / len(steps), 3) for b in BUDGETS},
            "drafted_accepted_predicted_per_step": round(policy.predicted / len(steps), 3),
            "drafted_accepted_observed_per_step": round(policy.observed / len(steps), 3)}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--costs", type=Path, default=RESULTS / "kimi_rank_int4.json")
    parser.add_argument("--traces", type=Path, default=None, help="an earlier budget_traces.json: its traces")
    parser.add_argument("--batch-costs", type=Path, default=None,
                        help="a kimi_rank_int4.py --batches result: the budgets' rates in its batches")  # fmt: skip
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.tokens = 3, 16
    started = time.time()
    costs = step_costs(args.costs)
    batched_costs = batch_step_costs(args.batch_costs) if args.batch_costs else {}
    if args.batch_costs and not batched_costs:
        raise SystemExit(f"{args.batch_costs}: no batch with autoregressive and random-drafter DDTree rows")
    if not costs:
        raise SystemExit(f"{args.costs}: no context with autoregressive and random-drafter DDTree {BUDGETS} rows")
    rows, batched, traces = [], [], {}
    earlier = json.loads(args.traces.read_text())["traces"] if args.traces else {}
    for temperature in args.temperatures:
        if str(temperature) in earlier:
            traces[temperature] = earlier[str(temperature)]
        else:
            traces[temperature] = record_traces(args.prompts, args.tokens, temperature, args.smoke)
        for context, cost in sorted(costs.items()):
            row = {"temperature": temperature, "context": context,
                   "step_ms": {str(k): round(v * 1e3, 2) for k, v in cost.items()},
                   **replay(traces[temperature], cost)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        for (context, batch), cost in sorted(batched_costs.items()):
            row = {"temperature": temperature, "context": context, "batch": batch,
                   "step_ms": {str(k): round(v * 1e3, 2) for k, v in cost.items()},
                   **batch_rates(traces[temperature], cost, batch)}  # fmt: skip
            batched.append(row)
            print(json.dumps(row), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {**environment(True), "command": " ".join(sys.argv), "costs_file": str(args.costs),
              "seconds": round(time.time() - started, 1), "rows": rows, "batched": batched,
              "traces": {str(t): v for t, v in traces.items()}}  # fmt: skip
    (args.out_dir / "budget_traces.json").write_text(json.dumps(result) + "\n")
    print(
        "\n| temperature | context | autoregressive | DDTree 8 | DDTree 16 | DDTree 32 | auto | auto / best | "
        "auto / worst | budgets auto chose (8 / 16 / 32) | auto (device loop) | its / best | its budgets | "
        "per-step bound / best | its budgets |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---|"
    )
    for r in rows:
        t, c, d = r["tokens_per_s"], r["budgets_chosen"], r["device_budgets_chosen"]
        print(
            f"| {r['temperature']} | {r['context']} | {t['autoregressive']:.1f} | {t['ddtree 8']:.1f} | "
            f"{t['ddtree 16']:.1f} | {t['ddtree 32']:.1f} | {t['auto']:.1f} | {r['auto_over_best']:.3f} | "
            f"{r['auto_over_worst']:.2f} | {c[8]} / {c[16]} / {c[32]} | {t['auto (device loop)']:.1f} | "
            f"{r['device_auto_over_best']:.3f} | {d[8]} / {d[16]} / {d[32]} | {r['bound_over_best']:.3f} | "
            f"{' / '.join(str(r['bound_budgets'][b]) for b in BUDGETS)} |"
        )
    if batched:
        print("\n| temperature | context | batch | mode | step (ms) | mean accepted a step | tokens/s | "
              "over autoregressive |\n|---|---:|---:|---|---:|---:|---:|---:|")  # fmt: skip
        for r in batched:
            for mode, rate in r["tokens_per_s"].items():
                budget = mode.removeprefix("ddtree ")
                if mode == "auto":  # its steps by choice (0: autoregressive)
                    step, accept = "-", " / ".join(f"{b}: {n}" for b, n in r["auto_steps"].items())
                else:
                    step = f"{r['step_ms']['autoregressive' if mode == 'autoregressive' else budget]:.2f}"
                    accept = r["mean_accept_length"].get(budget, 1.0)
                print(f"| {r['temperature']} | {r['context']} | {r['batch']} | {mode} | {step} | {accept} | "
                      f"{rate:.1f} | {r['over_autoregressive'][mode]:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
