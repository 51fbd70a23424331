"""`auto`'s host policy on a machine whose speed drifts: the trained pair's acceptance traces, replayed with noisy
step times.

    PYTHONPATH=. python3 benchmarks/budget_drift.py OUT_DIR [--seeds 24]
        [--traces benchmarks/results/budget_traces.json] [--costs benchmarks/results/budget_auto_cpu_paired.json]

The traces (`budget_traces.py`: every step of DDTree 32 on 64 held-out prompts, the tree's best-first path
log-probabilities and the accepted path; budget b accepts the path's nodes numbered b or less) are fed in order to
`runner.budget.BudgetPolicy` with budgets 4 / 8 / 16 / 32, as the host loop runs it: it chooses from each step's
scores and records the path its budget took and the step's time. A step's true cost at budget b is the CPU's
(`--costs`: the fixed-budget rows of an `acceptance.py` run, seconds over steps at each temperature); the time the
policy sees is that cost times the machine's speed times noise: the speed a random walk in log space (a step of
`drift`, bounded to 0.67x-1.5x), the noise log-normal (`noise`); the policy's start-up costs are the true ones
with a log-normal error (`start-up`), as a short start-up measurement on such a machine gives. Score: tokens emitted
over the summed true costs, over the best fixed budget's (the machine's speed is common to every choice, so it is
left out of the score). Each setting runs `--seeds` seeds; the table gives the median, the 10th percentile and the
worst. Writes OUT_DIR/budget_drift.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.budget_traces import budget_path  # noqa: E402
from benchmarks.common import environment  # noqa: E402
from runner.budget import BudgetPolicy  # noqa: E402

BUDGETS = (4, 8, 16, 32)
RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ((0.05, 0.10, 0.0), (0.15, 0.10, 0.02), (0.15, 0.25, 0.05))  # start-up error, step noise, drift


def true_costs(costs_file: Path) -> dict[str, dict[int, float]]:
    """temperature -> seconds a step at each budget: the fixed rows' seconds over their steps."""
    rows = json.loads(costs_file.read_text())["rows"]
    costs: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["mode"] in {f"ddtree{b}" for b in BUDGETS}:
            costs.setdefault(str(r["temperature"]), {})[int(r["mode"][6:])] = r["seconds"] / r["steps"]
    return {t: c for t, c in costs.items() if set(c) == set(BUDGETS)}


def replay(steps: list[dict], cost: dict[int, float], setting: tuple, seed: int) -> dict:
    startup_error, noise, drift = setting
    rng = np.random.default_rng(seed)
    fixed = {b: sum(len(budget_path(s["path"], b)) for s in steps) / (len(steps) * cost[b]) for b in BUDGETS}
    policy = BudgetPolicy(BUDGETS, {b: cost[b] * math.exp(rng.normal(0, startup_error)) for b in BUDGETS})
    log_speed, emitted, seconds = 0.0, 0, 0.0
    for s in steps:
        log_speed = float(np.clip(log_speed + rng.normal(0, drift), -0.4, 0.4))
        budget = policy.choose(np.array(s["scores"]))
        path = budget_path(s["path"], budget)
        policy.record(len(path), cost[budget] * math.exp(log_speed + rng.normal(0, noise)), path)
        emitted += len(path)
        seconds += cost[budget]
    best = max(fixed, key=fixed.get)
    return {"auto_over_best": emitted / seconds / fixed[best], "best": best,
            "chosen": {b: policy.chosen[b] for b in BUDGETS}}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--traces", type=Path, default=RESULTS / "budget_traces.json")
    parser.add_argument("--costs", type=Path, default=RESULTS / "budget_auto_cpu_paired.json")
    args = parser.parse_args(argv)
    traces = json.loads(args.traces.read_text())["traces"]
    costs = true_costs(args.costs)
    costs_ms = {t: {b: round(c * 1e3, 2) for b, c in v.items()} for t, v in costs.items()}
    command = " ".join(["benchmarks/budget_drift.py", *sys.argv[1:]])
    report = {**environment(False), "command": command, "costs_ms": costs_ms, "rows": []}
    print("| temperature | start-up error | step noise | drift a step | auto / best: median | 10th percentile | worst "
          "| the best fixed budget |\n|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for temperature, cost in sorted(costs.items()):
        steps = [s for t in traces[temperature] for s in t["steps"]]
        for setting in SETTINGS:
            runs = [replay(steps, cost, setting, seed) for seed in range(args.seeds)]
            ratios = sorted(r["auto_over_best"] for r in runs)
            row = {"temperature": float(temperature), "startup_error": setting[0], "noise": setting[1],
                   "drift": setting[2], "median": round(statistics.median(ratios), 4),
                   "p10": round(ratios[len(ratios) // 10], 4), "worst": round(ratios[0], 4), "best": runs[0]["best"],
                   "chosen_median": {b: statistics.median(r["chosen"][b] for r in runs) for b in BUDGETS}}  # fmt: skip
            report["rows"].append(row)
            print(f"| {temperature} | {setting[0]} | {setting[1]} | {setting[2]} | {row['median']:.4f} | "
                  f"{row['p10']:.4f} | {row['worst']:.4f} | {row['best']} |", flush=True)  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "budget_drift.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
