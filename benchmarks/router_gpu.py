"""The MoE router on one GPU: the torch form (`models/moe.py`, `Router`) against the fused form (`FusedRouter`, two
Triton launches), at Kimi K2.x's routing (384 experts, top 8, one group) and DeepSeek-V3's (256 experts, the best 4
of 8 groups), hidden 7168, bf16 activations, with bf16-valued weights (a bf16 checkpoint's router: the fused form
keeps them bf16, tensor cores) and float32 ones (float32 FMAs).

    PYTHONPATH=. python3 benchmarks/router_gpu.py OUT_DIR [--smoke] [--no-sweep]

Each case first checks the fused form against the torch form on the same GPU: the chosen experts equal for every
row (a differing row is reported with the gap between the two scores it chose between), the weights within 1e-5.
Times: CUDA-graph replays (median), T = 1, 8, 9, 17, 33, 64 rows and a batch's verify (16 slots of budget 8 or 32:
144 and 528 rows, the logits in token blocks of 64); the byte floor reads the router's weights once at
the copy rate measured in the same run. Writes OUT_DIR/router_gpu.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import Setup, add_setup_args, environment, graph_time_us, measure_ceilings
from models.moe import FusedRouter, Router
from models.presets import preset

CASES = {
    "kimi": dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1),
    "deepseek-v3": dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4),
}


def routers(fields: dict, hidden: int, weight_dtype: torch.dtype, device, seed: int):
    config = replace(preset("kimi-rank", smoke=False).target, hidden_size=hidden, **fields)
    gen = torch.Generator().manual_seed(seed)
    torch_form = Router(config)
    weight = torch.randn(torch_form.weight.shape, generator=gen) * hidden**-0.5
    torch_form.weight.data = weight.to(weight_dtype).float()
    torch_form.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts, generator=gen) * 0.05)
    fused = FusedRouter(config)
    fused.load_state_dict(torch_form.state_dict())
    fused.prepare_weights()
    return torch_form.to(device), fused.to(device)


def check(torch_form, fused, x) -> dict:
    want_ids, want_w = torch_form(x)
    ids, w = fused(x)
    rows = (ids != want_ids).any(-1)
    # a differing row: how far apart the two forms' scores of the experts they disagree on are (a near tie)
    logits = torch.nn.functional.linear(x.float(), torch_form.weight.float())
    choice = torch.sigmoid(logits) + torch_form.e_score_correction_bias
    gaps = []
    for r in rows.nonzero().flatten().tolist():
        mine, theirs = set(ids[r].tolist()), set(want_ids[r].tolist())
        gaps.append(float((choice[r, list(mine - theirs)].min() - choice[r, list(theirs - mine)].max()).abs()))
    same = ~rows
    weight_error = float((w[same] - want_w[same]).abs().max()) if same.any() else 0.0
    return {"rows": x.shape[0], "rows_differing": int(rows.sum()), "score_gaps": gaps, "weight_error": weight_error}


def launch_sweep(setup: Setup, hidden: int) -> list[dict]:
    """route_top_k's launch shapes at Kimi's routing (bf16 weights), T = 1 and 33: experts a logits program and
    its warps, the choice's warps."""
    from models.triton_ops import route_top_k

    torch_form, fused = routers(CASES["kimi"], hidden, torch.bfloat16, setup.device, seed=99)
    rows = []
    for tokens in (1, 33):
        x = torch.randn(tokens, hidden, device=setup.device).to(setup.dtype)
        want = torch_form(x)[0]
        for block_e, warps, select_warps in itertools.product((16, 32, 64), (1, 2, 4), (1, 2, 4)):
            shape = dict(block_e=block_e, warps=warps, select_warps=select_warps)
            args = (x, fused.weight, fused.e_score_correction_bias, 8, 1, 1, True, fused.scaling)
            same = bool(torch.equal(route_top_k(*args, **shape)[0], want))
            us = graph_time_us(lambda a=args, b=shape: route_top_k(*a, **b), setup.device, setup.smoke)
            rows.append({"tokens": tokens, **shape, "us": us, "same_ids": same})
        best = min((r for r in rows if r["tokens"] == tokens), key=lambda r: r["us"])
        print(f"launch sweep T={tokens}: best {best}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    add_setup_args(parser)
    parser.add_argument("--no-sweep", action="store_true", help="leave out the launch-shape sweep at T = 1 and 33")
    args = parser.parse_args(argv)
    setup = Setup.from_args(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    hidden = 256 if setup.smoke else 7168
    ceilings = measure_ceilings(setup.smoke)
    info = {**environment(setup.smoke), "command": " ".join(sys.argv), "hidden": hidden, **ceilings, "rows": []}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, fields in CASES.items():
            for weight_dtype in (torch.bfloat16, torch.float32):
                torch_form, fused = routers(fields, hidden, weight_dtype, setup.device, seed=len(info["rows"]))
                weight_bytes = fused.weight.numel() * fused.weight.element_size()
                for tokens in (1, 8, 9, 17, 33, 64, 144, 528):
                    x = torch.randn(tokens, hidden, generator=gen).to(setup.device, setup.dtype)
                    row = {"routing": name, "weights": str(fused.weight.dtype).removeprefix("torch."),
                           "tokens": tokens, **check(torch_form, fused, x),
                           "floor_us": weight_bytes / ceilings["copy_Bps"] * 1e6,
                           "torch_us": graph_time_us(lambda f=torch_form, a=x: f(a), setup.device, setup.smoke),
                           "fused_us": graph_time_us(lambda f=fused, a=x: f(a), setup.device, setup.smoke)}  # fmt: skip
                    info["rows"].append(row)
                    print(f"{name:12s} {row['weights']:9s} T={tokens:3d}  torch {row['torch_us']:7.1f} us  fused "
                          f"{row['fused_us']:6.1f} us  floor {row['floor_us']:5.1f} us  differing rows "
                          f"{row['rows_differing']} {row['score_gaps']}  weight error {row['weight_error']:.1e}",
                          flush=True)  # fmt: skip
        info["launches"] = launch_sweep(setup, hidden) if not (setup.smoke or args.no_sweep) else []
    (args.out_dir / "router_gpu.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
