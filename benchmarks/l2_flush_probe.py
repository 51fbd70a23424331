"""What the L2 flush between timed calls does to the kernels measured against a byte floor: each form timed with the
L2 left dirty (`write`: triton.testing.do_bench's flush, every benchmark's until now), left clean (`read`) and not
flushed (`none`), in one run (`benchmarks.common.replay_time_us` says what each pass does).

    PYTHONPATH=. python3 benchmarks/l2_flush_probe.py OUT_DIR [--repeats 3] [--smoke]

Forms (one H200 or H100; Kimi K2.x per-rank TP-8 dimensions):
  read 14.7 MB        the load-only kernel of `int4_load_probe.py` (best shape there): one token's 8 experts' gate
                      and up words, read and folded, nothing written
  copy 14.7 MB        torch's copy of the same bytes (read + written)
  int4 T=1, T=33      the W4A16 MoE kernel as the rank factory runs it (random routing; the routed experts)
  tree attention      TreeAttention at T = 33, H = 8 over 32768 and 131072 cached rows, and T = 1 over 131072
Each row: the bytes its floor counts, the floor at this run's copy rate, the median time of one call under each
flush, and a call's time in a sequence of 8 calls over other data each, back to back in one graph (as a forward's
layers run: launches overlapped, nothing of the last call in the L2).
Writes OUT_DIR/l2_flush_probe.json. --smoke: small shapes on the CPU, the forms run once (checks the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import FLUSHES, environment, graph_time_us, measure_ceilings  # noqa: E402

VARIANTS = 8  # forms over other data each, for the sequence column (8 x 14.7 MB already exceeds an H200's L2)


def load_forms(device, smoke: bool, variants: int) -> list[tuple[str, int, list]]:
    from benchmarks.int4_load_probe import KIMI, SMOKE, fold

    dims = SMOKE if smoke else KIMI
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (dims["experts"], dims["rows"], dims["words"]), generator=gen,
                          dtype=torch.int32).to(device)  # fmt: skip
    order = torch.randperm(dims["experts"], generator=gen).to(device, torch.int32)
    chosen = [order[v * dims["chosen"] : (v + 1) * dims["chosen"]] for v in range(variants)]  # other experts each
    rows = 8
    out = torch.empty(dims["chosen"] * (dims["rows"] // rows), dtype=torch.int32, device=device)
    moved = dims["chosen"] * dims["rows"] * dims["words"] * 4
    flat = words.view(-1)
    dst = torch.empty(moved // 4, dtype=torch.int32, device=device)
    n = moved // 4
    return [
        (f"read {moved / 1e6:.1f} MB (load-only kernel)", moved,
         [lambda ids=ids: fold(words, ids, out, rows, 64, 1, 1, 4) for ids in chosen]),
        (f"copy {moved / 1e6:.1f} MB (torch)", 2 * moved,
         [lambda v=v: dst.copy_(flat[v * n : (v + 1) * n]) for v in range(variants)]),
    ]  # fmt: skip


def int4_forms(device, smoke: bool, variants: int) -> list[tuple[str, int, list]]:
    from benchmarks.int4_moe_gpu import GROUP, make_weights, packed_expert_bytes, rank_config, routing
    from plugins.int4_moe.kernel import DEFAULT_TUNING, Int4MoEKernel, int4_moe_cuda

    config = rank_config(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    tensors, _, _, width = make_weights(config, device, dtype, gen)
    ready, layout = Int4MoEKernel.prepared(tensors, GROUP)
    hidden, experts, k = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    expert_bytes = packed_expert_bytes(hidden, width)
    forms = []
    triton_token = replace(DEFAULT_TUNING, token_kernel="triton")
    for tokens, tuning, name in ((1, DEFAULT_TUNING, "CUDA C"), (1, triton_token, "Triton"),
                                 (33, DEFAULT_TUNING, "tensor cores")):  # fmt: skip
        runs, distinct = [], []
        for _ in range(variants):  # random routing each: other experts (T = 1: 8 of 384)
            ids, weights = routing("random", tokens, experts, k, gen)
            ids, weights = ids.to(device), weights.to(device)
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            distinct.append(int(ids.unique().numel()))

            def run(x=x, ids=ids, weights=weights, tuning=tuning):
                return int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=tuning, layout=layout)

            runs.append(run)
        forms.append((f"int4 MoE kernel T={tokens}, {name} (routed experts)", distinct[0] * expert_bytes, runs))
    return forms


def attention_forms(smoke: bool, variants: int) -> list[tuple[str, int, list]]:
    if smoke:
        return []  # the kernel needs a GPU (its CPU check is tests/test_tree_attention_kernel.py)
    from benchmarks.tree_attention_gpu import LATENT, bytes_moved, inputs
    from plugins.tree_attention.kernel import tree_attention_cuda

    forms = []
    for tokens, length in ((33, 32768), (33, 131072), (1, 131072)):
        runs = []
        for v in range(variants):  # a cache each (as each layer has its own)
            q, cache, length_t, new_kv, mask = inputs(tokens, 8, length, seed=1 + v)
            out = torch.empty(tokens, 8, LATENT, dtype=torch.bfloat16, device="cuda")

            def run(q=q, cache=cache, length_t=length_t, new_kv=new_kv, mask=mask, out=out):
                tree_attention_cuda(q, cache, length_t, new_kv, mask, 576**-0.5, LATENT, out=out)

            runs.append(run)
        forms.append((f"tree attention T={tokens} H=8 S={length}", bytes_moved(tokens, 8, length), runs))
    return forms


def sequence_time_us(runs: list, device, smoke: bool) -> float:
    """A call's time inside a sequence: every variant in turn, back to back in one CUDA graph (each over other data,
    as a forward's layers read their own weights and caches), the L2 left clean before it; the graph's time over
    the calls (launches overlap, the L2 holds nothing a call needs)."""
    return graph_time_us(lambda: [run() for run in runs], device, smoke, flush="read") / len(runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU, each form once")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    variants = 2 if args.smoke else VARIANTS
    ceilings = measure_ceilings(args.smoke)
    info = {**environment(args.smoke), "command": " ".join(sys.argv), "copy_GBps": ceilings["copy_Bps"] / 1e9,
            "flushes": list(FLUSHES), "variants": variants, "rows": []}  # fmt: skip
    forms = (load_forms(device, args.smoke, variants) + int4_forms(device, args.smoke, variants)
             + attention_forms(args.smoke, variants))  # fmt: skip
    print(f"copy rate {info['copy_GBps']:.0f} GB/s")
    columns = [f"{f} flush (us)" for f in FLUSHES] + [f"in a sequence of {variants} (us)"]
    print("| form | bytes (MB) | floor (us) | " + " | ".join(columns) + " |")
    print("|---|---:|---:|" + "---:|" * len(columns))
    for name, moved, runs in forms:
        for run in runs:
            run()  # compiled before any capture
        floor = moved / ceilings["copy_Bps"] * 1e6
        times = {f"{f}_us": statistics.median(graph_time_us(runs[0], device, args.smoke, flush=f)
                                              for _ in range(args.repeats)) for f in FLUSHES}  # fmt: skip
        times["sequence_us"] = statistics.median(
            sequence_time_us(runs, device, args.smoke) for _ in range(args.repeats)
        )
        info["rows"].append({"form": name, "bytes": moved, "floor_us": floor, **times})
        print(f"| {name} | {moved / 1e6:.1f} | {floor:.1f} | " + " | ".join(f"{t:.1f}" for t in times.values()) + " |",
              flush=True)  # fmt: skip
    (args.out_dir / "l2_flush_probe.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
