"""Lossless on the GPU: greedy speculative output == greedy autoregressive output, token for token, in float32.

    PYTHONPATH=. python3 benchmarks/gpu_lossless.py OUT_DIR

The scaled-up MoE model of gpu_runtime.py in float32 (gathered MoE; the TreeAttention kernel in exact fp32), with
CUDA graphs per profile: autoregressive vs DFlash chain vs DDTree budgets 8 and 32 (random drafter), 128 tokens
from 3 prompts, on the host loop and on the device loop (one graph a step, queued ahead). In bf16 the two orders of
computation round differently and MoE routing turns that into different experts, so greedy paths part after a few
tokens; float32 shows the pipeline itself is exact.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_runtime import make_engine, scaled_models
from engines.spec import SpecConfig
from models.kimi import ModelOps
from models.moe import MoE
from models.parallel import SingleRank
from models.random_weights import random_rank_models
from plugins.tree_attention.kernel import tree_attention_cuda
from runner.device_loop import generate_on_device
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate, generate_autoregressive


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.float32
    target_cfg, drafter_cfg = scaled_models("moe", smoke=False)
    ops = ModelOps(tree_attention_cuda, SingleRank(), MoE)
    with torch.no_grad():
        target, drafter = random_rank_models(target_cfg, drafter_cfg, ops, device, dtype, seed=3)
        greedy = Sampler(SamplingParams())
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, target_cfg.vocab_size - 2, (n,), generator=gen).tolist() for n in (64, 17, 100)]
        rows = []
        engine, _ = make_engine(target, drafter, target_cfg, drafter_cfg, SpecConfig(8, 32), device, dtype, False)
        references = [generate_autoregressive(engine, p, 128, greedy).tokens for p in prompts]
        for name, spec in (("dflash chain", SpecConfig(8, 7, 1)), ("ddtree 8", SpecConfig(8, 8)),
                           ("ddtree 32", SpecConfig(8, 32))):  # fmt: skip
            engine, _ = make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, False)
            equal = [generate(engine, p, 128, spec, greedy).tokens == r for p, r in zip(prompts, references)]
            rows.append({"mode": name, "equal_to_autoregressive": equal})
            print(f"{name}: greedy speculative == autoregressive for 128 tokens: {equal}", flush=True)
            engine.workers[0].enable_device_loop()
            equal = [generate_on_device(engine, spec, p, 128, 1024).tokens == r for p, r in zip(prompts, references)]
            rows.append({"mode": f"{name} (device loop)", "equal_to_autoregressive": equal})
            print(f"{name} (device loop): greedy speculative == autoregressive for 128 tokens: {equal}", flush=True)
        engine.workers[0].enable_device_loop(autoregressive=True)
        equal = [generate_on_device(engine, spec, p, 128, 1024, autoregressive=True).tokens == r
                 for p, r in zip(prompts, references)]  # fmt: skip
        rows.append({"mode": "autoregressive (device loop)", "equal_to_autoregressive": equal})
        print(f"autoregressive (device loop) == autoregressive (host loop) for 128 tokens: {equal}", flush=True)
        engine.close()  # frees the device loop's graphs and pinned slots before exit
    ok = all(all(r["equal_to_autoregressive"]) for r in rows)
    (out / "gpu_lossless.json").write_text(
        json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "dtype": "float32", "gpu": torch.cuda.get_device_name(), "rows": rows},
            indent=1,
        )
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
