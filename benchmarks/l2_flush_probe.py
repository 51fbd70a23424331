"""What the L2 flush between timed calls does to the kernels measured against a byte floor: each form timed with the
L2 left dirty (`write`: triton.testing.do_bench's flush, every benchmark's until now), left clean (`read`) and not
flushed (`none`), in one run (`benchmarks.common.replay_time_us` says what each pass does).

    PYTHONPATH=. python3 benchmarks/l2_flush_probe.py OUT_DIR [--repeats 3] [--smoke]

Forms (one H200 or H100; Kimi K2.x per-rank TP-8 dimensions):
  read 14.7 MB        the load-only kernel of `int4_load_probe.py` (best shape there): one token's 8 experts' gate
                      and up words, read and folded, nothing written
  sum 14.7 MB         torch's sum over one contiguous buffer of the same bytes
  copy 14.7 MB        torch's copy of the same bytes (read + written)
  int4 T=1, T=33      the W4A16 MoE kernel as the rank factory runs it (random routing; the routed experts)
  tree attention      TreeAttention at T = 33, H = 8 over 32768 and 131072 cached rows, and T = 1 over 131072
Each row: the bytes its floor counts, the floor at this run's copy rate, and the median time under each flush.
Writes OUT_DIR/l2_flush_probe.json. --smoke: small shapes on the CPU, the forms run once (checks the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import FLUSHES, environment, graph_time_us, measure_ceilings  # noqa: E402


def load_forms(device, smoke: bool) -> list[tuple[str, int, object]]:
    from benchmarks.int4_load_probe import KIMI, SMOKE, fold

    dims = SMOKE if smoke else KIMI
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (dims["experts"], dims["rows"], dims["words"]), generator=gen,
                          dtype=torch.int32).to(device)  # fmt: skip
    ids = torch.randperm(dims["experts"], generator=gen)[: dims["chosen"]].to(device, torch.int32)
    rows = 8
    out = torch.empty(dims["chosen"] * (dims["rows"] // rows), dtype=torch.int32, device=device)
    moved = dims["chosen"] * dims["rows"] * dims["words"] * 4
    flat = words.view(-1)[: moved // 4]
    dst = torch.empty_like(flat)
    total = torch.empty((), dtype=torch.int64, device=device)
    return [
        (f"read {moved / 1e6:.1f} MB (load-only kernel)", moved, lambda: fold(words, ids, out, rows, 64, 1, 1, 4)),
        (f"sum {moved / 1e6:.1f} MB (torch)", moved, lambda: torch.sum(flat, 0, dtype=torch.int64, out=total)),
        (f"copy {moved / 1e6:.1f} MB (torch)", 2 * moved, lambda: dst.copy_(flat)),
    ]


def int4_forms(device, smoke: bool) -> list[tuple[str, int, object]]:
    from benchmarks.int4_moe_gpu import GROUP, make_weights, prepared, rank_config, routing
    from plugins.int4_moe.kernel import DEFAULT_TUNING, int4_moe_cuda

    config = rank_config(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    tensors, _, _, width = make_weights(config, device, dtype, gen)
    ready, layout = prepared(tensors)
    hidden, experts, k = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    expert_bytes = 3 * hidden * width // 2 + 3 * hidden * width // GROUP * 2
    forms = []
    for tokens in (1, 33):
        ids, weights = routing("random", tokens, experts, k, gen)
        ids, weights = ids.to(device), weights.to(device)
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        moved = int(ids.unique().numel()) * expert_bytes

        def run(x=x, ids=ids, weights=weights):
            return int4_moe_cuda(x, ids, weights, *ready, GROUP, tuning=DEFAULT_TUNING, layout=layout)

        forms.append((f"int4 MoE kernel T={tokens} (routed experts)", moved, run))
    return forms


def attention_forms(smoke: bool) -> list[tuple[str, int, object]]:
    if smoke:
        return []  # the kernel needs a GPU (its CPU check is tests/test_tree_attention_kernel.py)
    from benchmarks.tree_attention_gpu import LATENT, inputs
    from plugins.tree_attention.kernel import tree_attention_cuda

    forms = []
    for tokens, length in ((33, 32768), (33, 131072), (1, 131072)):
        q, cache, length_t, new_kv, mask = inputs(tokens, 8, length, seed=1)
        out = torch.empty(tokens, 8, LATENT, dtype=torch.bfloat16, device="cuda")
        width = cache.shape[1]
        moved = 2 * (length * width + tokens * width + tokens * 8 * width + tokens * 8 * LATENT)

        def run(q=q, cache=cache, length_t=length_t, new_kv=new_kv, mask=mask, out=out):
            tree_attention_cuda(q, cache, length_t, new_kv, mask, 576**-0.5, LATENT, out=out)

        forms.append((f"tree attention T={tokens} H=8 S={length}", moved, run))
    return forms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU, each form once")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    ceilings = measure_ceilings(args.smoke)
    info = {**environment(args.smoke), "command": " ".join(sys.argv), "copy_GBps": ceilings["copy_Bps"] / 1e9,
            "flushes": list(FLUSHES), "rows": []}  # fmt: skip
    forms = load_forms(device, args.smoke) + int4_forms(device, args.smoke) + attention_forms(args.smoke)
    print(f"copy rate {info['copy_GBps']:.0f} GB/s")
    print("| form | bytes (MB) | floor (us) | " + " | ".join(f"{f} flush (us)" for f in FLUSHES) + " |")
    print("|---|---:|---:|" + "---:|" * len(FLUSHES))
    for name, moved, run in forms:
        run()  # compiled before any capture
        floor = moved / ceilings["copy_Bps"] * 1e6
        times = {f: statistics.median(graph_time_us(run, device, args.smoke, flush=f) for _ in range(args.repeats))
                 for f in FLUSHES}  # fmt: skip
        info["rows"].append(
            {"form": name, "bytes": moved, "floor_us": floor, **{f"{f}_us": t for f, t in times.items()}}
        )
        print(f"| {name} | {moved / 1e6:.1f} | {floor:.1f} | " + " | ".join(f"{t:.1f}" for t in times.values()) + " |",
              flush=True)  # fmt: skip
    (args.out_dir / "l2_flush_probe.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
