"""Sampled DDTree on the GPU device loop is lossless: a statistical test with the trained pair (`trained/`).

    PYTHONPATH=. python3 benchmarks/sampling_lossless_gpu.py OUT_DIR [--draws 20000] [--seconds 170] [--smoke]

The pair in float32 through the rank factory (CUDA graphs, the device loop's sampled steps: temperature, top-k, the
tree walk and the bonus drawn on the device from counter-based noise), DDTree budget 8, one held-out prompt,
temperature 1.0 and top-k 8: each draw is a request with its own seed that emits 3 tokens. The expected
distributions come from an independent definition: transformers' DeepseekV3ForCausalLM on the same checkpoint with
its own temperature and top-k warpers (p(t1, t2) exactly, over the 8 x 8 cells; p(t3) as the mixture over them).
Chi-square tests at level 0.001: speculative draws against the exact joint and third-token law, autoregressive draws
(the same device loop, no drafter) likewise, and the two samples against each other (a 2 x cells contingency
table). Broken variants must be rejected by the same test: greedy acceptance at temperature 1 (the walk follows
argmax choices) and the temperature applied twice (at 0.7). Draws stop at --draws or after --seconds a side.
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


def draw(ranks, prompt, temperature: float, draws: int, seconds: float, autoregressive: bool, seed0: int):
    joint, third, accepted, start = {}, {}, [], time.perf_counter()
    for seed in range(seed0, seed0 + draws):
        params = SamplingParams(temperature=temperature, top_k=TOP_K, seed=seed)
        result = generate_on_device(ranks, SPEC, prompt, 3, 512, autoregressive=autoregressive, params=params)
        t1, t2, t3 = result.tokens[:3]
        joint[(t1, t2)] = joint.get((t1, t2), 0) + 1
        third[t3] = third.get(t3, 0) + 1
        accepted += result.accept_lengths
        if time.perf_counter() - start > seconds:
            break
    return joint, third, (float(np.mean(accepted)) if accepted else 1.0), time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--draws", type=int, default=20000, help="requests a side (at most)")
    parser.add_argument("--seconds", type=float, default=170.0, help="time a side (at most)")
    parser.add_argument("--broken_draws", type=int, default=3000)
    parser.add_argument("--broken_seconds", type=float, default=40.0)
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
        build = BuildConfig(max_input_len=128, max_seq_len=512)

        def ranks(autoregressive: bool):
            options = RankOptions("torch", device, True, autoregressive)
            return local_ranks(CheckpointWeights(ckpt), options, SPEC, build)

        expected = {1.0: exact(model, prompt, 1.0, device), 0.7: exact(model, prompt, 0.7, device)}
        spec_ranks = ranks(False)
        spec = draw(spec_ranks, prompt, 1.0, args.draws, args.seconds, False, 0)
        auto_ranks = ranks(True)
        auto = draw(auto_ranks, prompt, 1.0, args.draws, args.seconds, True, 10**6)
        auto_ranks.close()
        for name, (joint, third, accepted, seconds) in (("speculative", spec), ("autoregressive", auto)):
            rows.append({"sample": name, "draws": sum(joint.values()), "seconds": round(seconds, 1),
                         "mean_accept_length": round(accepted, 3), "p_joint": gof(joint, expected[1.0][0]),
                         "p_third": gof(third, expected[1.0][1])})  # fmt: skip
        result["p_two_sample_joint"] = two_sample(spec[0], auto[0])
        result["p_two_sample_third"] = two_sample(spec[1], auto[1])
        spec_ranks.close()
        real = DeviceLoop._choose
        broken = {  # patched on the class before the ranks are built: the CUDA graphs capture the broken step
            "greedy acceptance (temperature 1)": (lambda self, logits: logits.argmax(dim=-1), 1.0),
            "temperature applied twice (0.7)": (
                lambda self, logits: real(self, logits / self.sampling["temperature"]),
                0.7,
            ),
        }
        for name, (choose, temperature) in broken.items():
            DeviceLoop._choose = choose
            try:
                broken_ranks = ranks(False)
                joint, third, accepted, seconds = draw(broken_ranks, prompt, temperature, args.broken_draws,
                                                       args.broken_seconds, False, 2 * 10**6)  # fmt: skip
                broken_ranks.close()
            finally:
                DeviceLoop._choose = real
            rows.append({"sample": f"broken: {name}", "draws": sum(joint.values()), "seconds": round(seconds, 1),
                         "mean_accept_length": round(accepted, 3), "p_joint": gof(joint, expected[temperature][0]),
                         "p_third": gof(third, expected[temperature][1])})  # fmt: skip
    for row in rows:
        row["verdict"] = "pass" if min(row["p_joint"], row["p_third"]) > LEVEL else "rejected"
        print(json.dumps(row), flush=True)
    healthy = [r for r in rows if not r["sample"].startswith("broken")]
    two = min(result["p_two_sample_joint"], result["p_two_sample_third"])
    rejected = all(r["verdict"] == "rejected" for r in rows if r["sample"].startswith("broken"))
    result["pass"] = all(r["verdict"] == "pass" for r in healthy) and two > LEVEL and rejected
    result["rows"] = rows
    print(json.dumps({k: result[k] for k in ("p_two_sample_joint", "p_two_sample_third", "pass")}))
    (args.out_dir / "sampling_lossless_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
