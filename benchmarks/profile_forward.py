"""Where a forward's GPU time goes: kernels (count, total time, by name) of one target forward at T = 1, 8, 33, one
drafter forward and the device loop's tree build and walk, against the CUDA-graph replay time of the same call (the
difference is launch gaps).

    PYTHONPATH=. python3 benchmarks/profile_forward.py OUT_DIR [--model=kimi-rank|moe|dense] [--smoke]
        [--draft-attention]   (also: the drafter with each form of its attention)

Writes OUT_DIR/profile_forward.json and prints the top kernels.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.gpu_runtime import benchmark_ops, graph_time_us, scaled_models, tree_mask
from models.random_weights import random_rank_models


def kernel_table(fn, device) -> dict:
    """Kernels one call of fn launches: {name: [count, total µs]} (profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type != "cuda" and event.cpu_parent is not None:
            continue
        time_us = event.device_time if device.type == "cuda" else event.cpu_time
        entry = table[event.name[:90]]
        entry[0] += 1
        entry[1] += time_us
    return dict(table)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    smoke = "--smoke" in sys.argv
    model = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--model=")), "kimi-rank")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    target_cfg, drafter_cfg = scaled_models(model, smoke)
    target, drafter = random_rank_models(target_cfg, drafter_cfg, benchmark_ops(smoke), device, dtype, seed=3)
    length, capacity = 256, 1024
    cache = (torch.randn(target_cfg.num_hidden_layers, capacity, target_cfg.latent_dim, device=device) * 0.5).to(dtype)
    cache_length = torch.tensor([length], device=device)
    shard = target_cfg.vocab_size // target_cfg.mapping.tp_size
    results = {"model": model, "layers": target_cfg.num_hidden_layers, "date": time.strftime("%Y-%m-%d"),
               "torch": torch.__version__, "forwards": {}}  # fmt: skip
    calls = {}
    for tokens in (1, 8, 33):
        ids = torch.randint(0, shard - 2, (tokens,), device=device)
        mask = tree_mask(tokens, device)
        positions = length + mask.sum(-1) - 1
        rows = torch.arange(tokens, device=device)
        calls[f"target T={tokens}"] = lambda a=(ids, positions, mask, cache, cache_length, rows): target(*a)
    block = drafter_cfg.block_size
    draft_cache = torch.zeros(drafter_cfg.num_hidden_layers, 2, capacity, drafter_cfg.kv_heads_per_rank,
                              drafter_cfg.head_dim, device=device, dtype=dtype)  # fmt: skip
    taps = torch.randn(block, drafter.fc.weight.shape[1], device=device).to(dtype)
    arange = torch.arange(block, device=device)
    block_ids = torch.randint(0, shard - 2, (block,), device=device)
    args = (taps, length - block + arange, torch.tensor([block], device=device), block_ids, length + arange,
            draft_cache, torch.tensor([length - block], device=device))  # fmt: skip
    calls["drafter (block 8)"] = lambda: drafter(*args)
    # the device loop's tree phase (DDTree budget 32) and the walk, outside the forwards
    from runner.device_tree import accept_greedy_device, build_tree_device, top_logprobs

    draft_logits = torch.randn(block - 1, shard, device=device) * 4
    calls["draft top-k (log_softmax + topk 32)"] = lambda: top_logprobs(draft_logits, 32)
    values, indices = top_logprobs(draft_logits, 32)
    root = torch.zeros(1, dtype=torch.long, device=device)
    calls["tree build (budget 32)"] = lambda: build_tree_device(values, indices, 32, root, 33)
    tree = build_tree_device(values, indices, 32, root, 33)
    choices = torch.randint(0, shard, (33,), device=device)
    calls["greedy walk"] = lambda: accept_greedy_device(tree[0], tree[1], tree[2], tree[3], choices, block - 1)
    with torch.no_grad():
        for name, fn in calls.items():
            table = kernel_table(fn, device)
            replay = graph_time_us(fn, device, smoke)
            count = sum(c for c, _ in table.values())
            busy = sum(t for _, t in table.values())
            results["forwards"][name] = {"graph_us": replay, "kernels": count, "kernel_us": busy,
                                         "top": sorted(table.items(), key=lambda kv: -kv[1][1])[:30]}  # fmt: skip
            print(f"\n{name}: graph replay {replay:.1f} us, {count} kernels, {busy:.1f} us inside kernels "
                  f"({(replay - busy) / max(count, 1):.2f} us a kernel outside)", flush=True)  # fmt: skip
            for kernel, (n, t) in results["forwards"][name]["top"][:22]:
                print(f"  {t:9.1f} us {n:5d}x  {kernel}")
    if "--draft-attention" in sys.argv:
        with torch.no_grad():
            results["draft_attention"] = draft_attention_forms(drafter, args, device, smoke)
    (out / "profile_forward.json").write_text(json.dumps(results, indent=1))
    return 0


def draft_attention_forms(drafter, args, device, smoke: bool) -> dict:
    """The drafter forward (CUDA graph replay) with each form of its attention: the einsum chain (the CPU form),
    the baddbmm / softmax / bmm chain (the GPU form), scaled_dot_product_attention with PyTorch's backend choice and
    with each backend forced; the logits' distance from the einsum chain's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.dflash import DraftAttention

    attend = DraftAttention.attend

    def sdpa(backend):
        def form(self, q, keys, values, key_bias, fused):
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(
                    self.fold_heads(q)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                    attn_mask=key_bias.view(1, 1, 1, -1), scale=self.scale)  # fmt: skip
            return self.unfold_heads(out[0], q.shape[0])

        return form

    forms = {
        "einsum chain": lambda self, *a, fused: attend(self, *a, fused=False),
        "baddbmm + softmax + bmm (the GPU form)": lambda self, *a, fused: attend(self, *a, fused=True),
        "sdpa (PyTorch's choice)": sdpa(None),
        "sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa math": sdpa(SDPBackend.MATH),
    }
    rows, reference = {}, None
    try:
        for name, form in forms.items():
            DraftAttention.attend = form
            try:
                logits = drafter(*args)[0].float()
                reference = logits if reference is None else reference
                rows[name] = {"graph_us": graph_time_us(lambda: drafter(*args), device, smoke),
                              "rel_diff": float((logits - reference).norm() / reference.norm())}  # fmt: skip
            except RuntimeError as err:  # a backend that does not take these inputs
                rows[name] = {"error": str(err)[:200]}
            print(f"drafter with {name}: {rows[name]}", flush=True)
    finally:
        DraftAttention.attend = attend
    return rows


if __name__ == "__main__":
    sys.exit(main())
