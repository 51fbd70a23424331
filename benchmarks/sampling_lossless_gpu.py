"""Sampled DDTree on the GPU device loop is lossless: a statistical test with the trained pair (`trained/`).

    PYTHONPATH=. python3 benchmarks/sampling_lossless_gpu.py OUT_DIR [--draws 20000] [--seconds 170]
        [--workers 4 --parallel_samples 4] [--smoke]

The pair in float32 through the rank factory (CUDA graphs, the device loop's sampled steps: temperature, top-k, the
tree walk and the bonus drawn on the device from counter-based noise), DDTree budget 8, one held-out prompt,
temperature 1.0 and top-k 8: each draw is a request with its own seed that emits 3 tokens. The expected
distributions come from an independent definition: transformers' DeepseekV3ForCausalLM on the same checkpoint with
its own temperature and top-k warpers (p(t1, t2) exactly, over the 8 x 8 cells; p(t3) as the mixture over them).
Chi-square tests at level 0.001: speculative draws against the exact joint and third-token law, autoregressive draws
(the same device loop, no drafter) likewise, and the two samples against each other (a 2 x cells contingency
table). Broken variants must be rejected by the same test: greedy acceptance at temperature 1 (the walk follows
argmax choices), the temperature applied twice (at 0.7), and the bonus drawn afresh where the walk stopped (its
rejected children not removed). Draws stop at --draws or after --seconds a side.
A draw is bound by the host (one request of three tokens: prefill, two steps, a read-back), so the seeds of each
sample can be split among --workers processes, and --parallel_samples samples drawn at once, all on the one GPU.
Writes OUT_DIR/sampling_lossless_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import chi2_contingency, chisquare

from benchmarks.acceptance import ROOT, convert_pair, load_prompts
from benchmarks.common import environment
from engines.spec import BuildConfig, SpecConfig
from runner.device.loop import DeviceLoop, generate_on_device
from runner.factory import CheckpointWeights, RankOptions, local_ranks
from runner.sampling import SamplingParams

SPEC, LEVEL, TOP_K = SpecConfig(8, 8), 1e-3, 8


def exact(model, prompt: list[int], temperature: float, device) -> tuple[dict, dict]:
    """p(t1, t2) and p(t3) of the target's own sampling, with transformers' warpers."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    def probs(sequences: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(sequences, device=device)).logits[:, -1].double()
        warped = TopKLogitsWarper(TOP_K)(None, TemperatureLogitsWarper(temperature)(None, logits))
        return torch.softmax(warped, dim=-1).cpu()

    p1 = probs([prompt])[0]
    firsts = torch.nonzero(p1).flatten().tolist()
    p2 = probs([prompt + [t] for t in firsts])
    joint, pairs = {}, []
    for i, t1 in enumerate(firsts):
        for t2 in torch.nonzero(p2[i]).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[i, t2])
            pairs.append((t1, t2))
    p3 = probs([prompt + list(pair) for pair in pairs])
    third = sum(joint[pair] * p3[i] for i, pair in enumerate(pairs))
    return joint, {t: float(p) for t, p in enumerate(third) if p > 0}


def gof(observed: dict, expected: dict) -> float:
    runs = sum(observed.values())
    if any(k not in expected for k in observed):
        return 0.0  # a draw outside the support
    big = [k for k, p in expected.items() if p * runs >= 5]
    obs = [observed.get(k, 0) for k in big] + [runs - sum(observed.get(k, 0) for k in big)]
    exp = [expected[k] * runs for k in big] + [runs * (1 - sum(expected[k] for k in big))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)


def two_sample(a: dict, b: dict) -> float:
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 10]
    rest = [sum(a.values()) - sum(a.get(k, 0) for k in keys), sum(b.values()) - sum(b.get(k, 0) for k in keys)]
    table = np.array([[a.get(k, 0) for k in keys] + [rest[0]], [b.get(k, 0) for k in keys] + [rest[1]]])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table).pvalue)


def draw(ranks, prompt, temperature: float, seeds: range, seconds: float, autoregressive: bool):
    joint, third, accepted, start = {}, {}, [], time.perf_counter()
    for seed in seeds:
        params = SamplingParams(temperature=temperature, top_k=TOP_K, seed=seed)
        result = generate_on_device(ranks, SPEC, prompt, 3, 512, autoregressive=autoregressive, params=params)
        t1, t2, t3 = result.tokens[:3]
        joint[(t1, t2)] = joint.get((t1, t2), 0) + 1
        third[t3] = third.get(t3, 0) + 1
        accepted += result.accept_lengths
        if time.perf_counter() - start > seconds:
            break
    return joint, third, accepted, time.perf_counter() - start


def _patch_choose(make):
    """Replaces DeviceLoop._choose by make(the real one); returns the undo."""
    real = DeviceLoop._choose
    DeviceLoop._choose = make(real)
    return lambda: setattr(DeviceLoop, "_choose", real)


def _patch_bonus_redrawn():
    """The bonus drawn afresh where the walk stopped, without removing the children it rejected there: a second,
    independent draw at every node, and the accepted path's end takes that one."""
    import runner.device.loop as device_loop

    real, accept, second = DeviceLoop._choose, device_loop.accept_greedy_device, {}

    def choose_twice(self, logits):
        second["draws"] = real(self, logits)
        return real(self, logits)

    def accept_with_redrawn_bonus(tokens, parents, depths, mask, choices, depth):
        path, length, _ = accept(tokens, parents, depths, mask, choices, depth)
        return path, length, second["draws"].index_select(0, path.index_select(0, length - 1))

    DeviceLoop._choose, device_loop.accept_greedy_device = choose_twice, accept_with_redrawn_bonus

    def undo():
        DeviceLoop._choose, device_loop.accept_greedy_device = real, accept

    return undo


BROKEN = {  # name: (patches the device loop before its graphs are captured and returns the undo, the temperature)
    "greedy acceptance (temperature 1)": (
        lambda: _patch_choose(lambda real: lambda self, logits: logits.argmax(dim=-1)),
        1.0,
    ),
    "temperature applied twice (0.7)": (
        lambda: _patch_choose(lambda real: lambda self, logits: real(self, logits / self.sampling["temperature"])),
        0.7,
    ),
    "bonus redrawn without removing the rejected children (temperature 1)": (_patch_bonus_redrawn, 1.0),
}


def draw_job(job: dict):
    """One share of a sample's seeds, in its own process (`--workers`): builds its ranks, with a broken variant
    patched on the device loop before they are built (the CUDA graphs capture the broken step), and draws."""
    variant = job["variant"]
    undo = BROKEN[variant][0]() if variant else (lambda: None)
    try:
        options = RankOptions("torch", job["device"], True, job["autoregressive"])
        ranks = local_ranks(CheckpointWeights(job["ckpt"]), options, SPEC, BuildConfig(128, 512))
        try:
            return draw(ranks, job["prompt"], job["temperature"], job["seeds"], job["seconds"], job["autoregressive"])
        finally:
            ranks.close()
    finally:
        undo()


def sample_all(jobs: list[dict], workers: int) -> list[tuple]:
    """Every job's draws: in this process for one worker, else in `workers` processes on the same GPU (the draws
    are bound by the host's launches, so several processes keep the GPU busier)."""
    if workers <= 1:
        return [draw_job(job) for job in jobs]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(draw_job, jobs, chunksize=1)


def merged(shares: list[tuple]) -> tuple[dict, dict, float, float]:
    joint, third, accepted = {}, {}, []
    for j, t, a, _ in shares:
        for k, v in j.items():
            joint[k] = joint.get(k, 0) + v
        for k, v in t.items():
            third[k] = third.get(k, 0) + v
        accepted += a
    return joint, third, (float(np.mean(accepted)) if accepted else 1.0), max(s for *_, s in shares)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--draws", type=int, default=20000, help="requests a side (at most)")
    parser.add_argument("--seconds", type=float, default=170.0, help="time a side (at most)")
    parser.add_argument("--broken_draws", type=int, default=3000)
    parser.add_argument("--broken_seconds", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=1, help="processes a sample (its seeds split among them)")
    parser.add_argument(
        "--parallel_samples",
        type=int,
        default=1,
        help="samples drawn at the same time (5: all of them; processes = workers x this)",
    )
    parser.add_argument("--broken_only", action="store_true", help="only the broken variants (each against the exact "
                        "law; no two-sample test)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="the CPU, few draws: checks the script")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(ROOT / "kimi-k2-py", dtype=torch.float32)
    model = model.to(device).eval()
    prompt = load_prompts(ROOT / "kimi-k2-py", 1)[0]
    rows, result = [], {**environment(args.smoke), "spec": "DDTree budget 8", "top_k": TOP_K, "level": LEVEL}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_pair(Path(tmp) / "ckpt", "float32")
        expected = {1.0: exact(model, prompt, 1.0, device), 0.7: exact(model, prompt, 0.7, device)}
        del model
        samples = {  # name: (autoregressive, broken variant, temperature, draws, seconds, first seed)
            "speculative": (False, None, 1.0, args.draws, args.seconds, 0),
            "autoregressive": (True, None, 1.0, args.draws, args.seconds, 10**6),
            **{f"broken: {name}": (False, name, temperature, args.broken_draws, args.broken_seconds, 2 * 10**6)
               for name, (_, temperature) in BROKEN.items()},
        }  # fmt: skip
        if args.broken_only:
            samples = {name: sample for name, sample in samples.items() if name.startswith("broken")}
        per = max(1, args.workers)
        jobs = []
        for name, (autoregressive, variant, temperature, draws, seconds, seed0) in samples.items():
            share = -(-draws // per)
            for w in range(per):
                seeds = range(seed0 + w * share, seed0 + min(draws, (w + 1) * share))
                jobs.append({"sample": name, "ckpt": ckpt, "device": device, "autoregressive": autoregressive,
                             "variant": variant, "temperature": temperature, "prompt": prompt, "seeds": seeds,
                             "seconds": seconds})  # fmt: skip
        started = time.perf_counter()
        shares = sample_all(jobs, args.workers * args.parallel_samples)
        result["wall_seconds"] = round(time.perf_counter() - started, 1)
        drawn = {name: merged([s for job, s in zip(jobs, shares) if job["sample"] == name]) for name in samples}
        for name, (joint, third, accepted, seconds) in drawn.items():
            temperature = samples[name][2]
            rows.append({"sample": name, "draws": sum(joint.values()), "seconds": round(seconds, 1),
                         "mean_accept_length": round(accepted, 3), "p_joint": gof(joint, expected[temperature][0]),
                         "p_third": gof(third, expected[temperature][1])})  # fmt: skip
        if not args.broken_only:
            spec, auto = drawn["speculative"], drawn["autoregressive"]
            result["p_two_sample_joint"] = two_sample(spec[0], auto[0])
            result["p_two_sample_third"] = two_sample(spec[1], auto[1])
    for row in rows:
        row["verdict"] = "pass" if min(row["p_joint"], row["p_third"]) > LEVEL else "rejected"
        print(json.dumps(row), flush=True)
    healthy = [r for r in rows if not r["sample"].startswith("broken")]
    two = min(result.get("p_two_sample_joint", 1.0), result.get("p_two_sample_third", 1.0))
    rejected = all(r["verdict"] == "rejected" for r in rows if r["sample"].startswith("broken"))
    result["pass"] = all(r["verdict"] == "pass" for r in healthy) and two > LEVEL and rejected
    result["rows"] = rows
    print(json.dumps({k: result.get(k) for k in ("p_two_sample_joint", "p_two_sample_third", "pass")}))
    (args.out_dir / "sampling_lossless_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
