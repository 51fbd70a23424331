"""Where a forward's GPU time goes: kernels (count, total time, by name) of one target forward at T = 1, 8, 33, one
drafter forward and the device loop's tree build and walk, each captured in a CUDA graph and profiled over replays,
with the GPU's idle time between consecutive kernels (by the pair of kernels it falls between) and the replay time.

    PYTHONPATH=. python3 benchmarks/profile_forward.py OUT_DIR [--model kimi-rank|kimi-rank-int4|moe|dense] [--smoke]
        [--targets 1,8,33]    (the target forwards' token counts, in that order)
        [--draft-attention]   (also: the drafter with each form of its attention)
        [--steps]             (also: the device loop's step graphs and one request each, GPU only)
        [--draft-capacities]  (also: the drafter against its cache's capacity, same length)
        [--compare-overlap]   (also: each target forward on one stream, with the MoE's shared expert on a side
                               stream, and with MLA's latent row there too (`models/streams.py`); outputs compared)
        [--compare-int4-kernels]  (also: each target forward with each form of the INT4 experts' kernel it takes,
                               CUDA C and Triton: `Tuning.token_kernel` at T = 1, `Tuning.block_kernel` at T = 8, 33;
                               outputs compared)

The modules are rank 0's, built by the rank factory (the forms the CLI runs). Writes OUT_DIR/profile_forward.json
and prints the top kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import Setup, add_setup_args, environment, graph_time_us, preset_ranks, tree_mask
from engines.spec import SpecConfig
from runner.factory import PresetWeights
from runner.probes import Probes


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


def replay_profile(fn, device, repeats: int = 4) -> dict:
    """fn captured in a CUDA graph and replayed `repeats` times under the profiler (the kernels as the runtime
    launches them, not eagerly): per replay, the kernels by name and the GPU idle time between consecutive kernels,
    by the pair of kernels it falls between."""
    from runner.sessions.cuda_graphs import capture_graph

    graph, _ = capture_graph(fn, device, warmups=2)
    return {**graph_replay_profile(graph.replay, repeats), "back_to_back_us": back_to_back_us(graph.replay)}


def back_to_back_us(replay, count: int = 30) -> float:
    """Mean time of one of `count` replays queued back to back (as the device loop runs its steps), against
    do_bench's one replay at a time after an L2 flush."""
    replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / count


def graph_replay_profile(replay, repeats: int = 4) -> dict:
    """`replay` (a graph replay, or a device-loop step) `repeats` times under the profiler; see `replay_profile`."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            replay()
            torch.cuda.synchronize()  # a wide gap between replays, dropped below
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0),
        key=lambda e: e.time_range.start,
    )
    table, pairs = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for event in kernels:
        entry = table[event.name[:90]]
        entry[0] += 1
        entry[1] += event.time_range.end - event.time_range.start
    gaps = sorted(
        ((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40]) for a, b in zip(kernels, kernels[1:])),
        reverse=True,
    )[repeats - 1 :]  # the repeats - 1 largest are the synchronizations between replays
    for gap, a, b in gaps:
        entry = pairs[f"{a} -> {b}"]
        entry[0] += 1
        entry[1] += gap
    scale = 1.0 / repeats
    per_replay = lambda t: {k: [v[0] * scale, v[1] * scale] for k, v in t.items()}  # noqa: E731
    return {
        "kernels": len(kernels) * scale,
        "kernel_us": sum(v[1] for v in table.values()) * scale,
        "idle_us": sum(max(g, 0.0) for g, _, _ in gaps) * scale,
        "overlap_us": -sum(min(g, 0.0) for g, _, _ in gaps) * scale,
        "top": sorted(per_replay(table).items(), key=lambda kv: -kv[1][1])[:30],
        "top_gaps": sorted(per_replay(pairs).items(), key=lambda kv: -kv[1][1])[:20],
    }


def print_replay_profile(name: str, graph_us: float | None, prof: dict) -> None:
    head = f"{graph_us:.1f} us a replay (do_bench), " if graph_us is not None else ""
    if "back_to_back_us" in prof:
        head += f"{prof['back_to_back_us']:.1f} us a replay back to back, "
    print(f"\n{name}: {head}{prof['kernels']:.0f} kernels, {prof['kernel_us']:.1f} us inside kernels, GPU idle between "
          f"kernels {prof['idle_us']:.1f} us, kernels overlapping {prof['overlap_us']:.1f} us (profiled replays)",
          flush=True)  # fmt: skip
    for kernel, (n, t) in prof["top"][:22]:
        print(f"  {t:9.1f} us {n:6.0f}x  {kernel}")
    print("  idle between:")
    for pair, (n, t) in prof["top_gaps"][:10]:
        print(f"  {t:9.1f} us {n:6.0f}x  {pair}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="kimi-rank", choices=["kimi-rank", "kimi-rank-int4", "moe", "dense"])
    parser.add_argument("--draft-attention", action="store_true", help="the drafter with each form of its attention")
    parser.add_argument("--steps", action="store_true", help="the device loop's step graphs (GPU only)")
    parser.add_argument("--draft-capacities", action="store_true", help="the drafter against its cache's capacity")
    parser.add_argument("--compare-overlap", action="store_true", help="each target forward also on one stream, and "
                        "with only the MoE's branch on the side stream (GPU)")  # fmt: skip
    parser.add_argument("--compare-int4-kernels", action="store_true", help="each target forward with each form "
                        "of the INT4 experts' kernel it takes (kimi-rank-int4, GPU)")  # fmt: skip
    parser.add_argument("--targets", default="1,8,33", help="the target forwards' token counts, in order")
    parser.add_argument("--cache-length", type=int, default=256, help="cached rows the target forwards attend to "
                        "(random latent rows; the capacity holds them): long context's share of attention")  # fmt: skip
    add_setup_args(parser)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup.from_args(args)
    device, dtype, smoke = setup.device, setup.dtype, setup.smoke
    weights = PresetWeights(args.model, dtype, seed=3, smoke=smoke)
    target_cfg, drafter_cfg = weights.rank_configs(0)
    generator = preset_ranks(weights, setup, SpecConfig(8, 32), device_loop=False)
    target, drafter = (generator.ranks.lead.session.modules[role] for role in ("target", "draft"))
    length = args.cache_length
    capacity = max(1024, length + 64)
    cache = torch.randn(target_cfg.num_hidden_layers, capacity, target_cfg.latent_dim, device=device, dtype=dtype)
    cache_length = torch.tensor([length], device=device)
    shard = target_cfg.vocab_size // target_cfg.mapping.tp_size
    results = {"model": args.model, "layers": target_cfg.num_hidden_layers, **environment(smoke), "forwards": {},
               "ranks": generator.rank_description}  # fmt: skip
    calls = {}
    for tokens in [int(t) for t in args.targets.split(",")]:
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
    draft_args = (taps, length - block + arange, torch.tensor([block], device=device), block_ids, length + arange,
                  draft_cache, torch.tensor([length - block], device=device))  # fmt: skip
    calls["drafter (block 8)"] = lambda: drafter(*draft_args)
    # the device loop's tree phase (DDTree budget 32) and the walk, outside the forwards
    from runner.device.tree import accept_greedy_device, tree_forms

    top_logprobs, build_tree_device = tree_forms(device)

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
            replay = graph_time_us(fn, device, smoke)
            if smoke:  # CPU: eager operator times
                table = kernel_table(fn, device)
                prof = {"kernels": sum(c for c, _ in table.values()), "kernel_us": sum(t for _, t in table.values()),
                        "idle_us": 0.0, "overlap_us": 0.0, "top_gaps": [],
                        "top": sorted(table.items(), key=lambda kv: -kv[1][1])[:30]}  # fmt: skip
            else:
                prof = replay_profile(fn, device)
            # attention's share: the TreeAttention kernels (split and combine) among the forward's kernels (GPU; the
            # CPU runs attention as torch operators)
            kernels = prof["top"] if not smoke else []
            attention = sum(t for kernel, (_, t) in kernels if "tree_attention" in kernel or "combine_splits" in kernel)
            results["forwards"][name] = {"graph_us": replay, **prof, "cache_length": length, "attention_us": attention}
            print_replay_profile(name, replay, prof)
            if name.startswith("target") and not smoke:
                print(f"  attention (TreeAttention kernels) {attention:.1f} us of {prof['kernel_us']:.1f} us in "
                      f"kernels at {length} cached rows", flush=True)  # fmt: skip
            if name.startswith("target") and args.compare_int4_kernels:
                field = "token_kernel" if name == "target T=1" else "block_kernel"
                results["forwards"][name][field] = int4_kernel_forms(fn, field, device, smoke)
            if name.startswith("target") and args.compare_overlap:
                results["forwards"][name]["side_stream"] = side_stream_forms(target, fn, device, smoke)

        if args.steps and not smoke:
            results["steps"] = device_loop_steps(weights, setup, shard)
    if args.draft_capacities:
        results["draft_capacities"] = {}
        with torch.no_grad():
            for cap in (1024, 8192, 32768, 131072):
                cache_cap = torch.zeros(*draft_cache.shape[:2], cap, *draft_cache.shape[3:], device=device, dtype=dtype)
                call = (*draft_args[:5], cache_cap, draft_args[6])
                results["draft_capacities"][cap] = graph_time_us(lambda c=call: drafter(*c), device, smoke)
                print(f"drafter, draft cache capacity {cap:6d} (length {length - block}): "
                      f"{results['draft_capacities'][cap]:.1f} us", flush=True)  # fmt: skip
    if args.draft_attention:
        with torch.no_grad():
            results["draft_attention"] = draft_attention_forms(drafter, draft_args, device, smoke)
    generator.ranks.close()
    (args.out_dir / "profile_forward.json").write_text(json.dumps(results, indent=1))
    return 0


def int4_kernel_forms(fn, field: str, device, smoke: bool) -> dict:
    """The forward `fn` with each form ("cuda", "triton") of the INT4 experts' kernel `Tuning.<field>` names
    (`token_kernel`: one token; `block_kernel`: more), read at each call, so each form is captured in its own graph:
    replay time, back-to-back time, kernels, and the output's largest difference from the default form's (the forms
    sum in different orders)."""
    from dataclasses import replace

    from plugins.int4_moe import kernel

    default = kernel.DEFAULT_TUNING
    reference = fn()[0].float().clone()
    rows = {}
    try:
        for form in ("cuda", "triton"):
            kernel.DEFAULT_TUNING = replace(default, **{field: form})
            out = fn()[0].float()
            rows[form] = {
                "graph_us": graph_time_us(fn, device, smoke),
                "max_abs_diff": float((out - reference).abs().max()),
                "relative_diff": float((out - reference).norm() / reference.norm().clamp_min(1e-30)),
            }
            if not smoke:
                prof = replay_profile(fn, device)
                rows[form].update({k: prof[k] for k in ("kernels", "kernel_us", "idle_us", "back_to_back_us")})
            print(f"  INT4 {field} {form}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[form].items()), flush=True)
    finally:
        kernel.DEFAULT_TUNING = default
    return rows


def side_stream_forms(target, fn, device, smoke: bool) -> dict:
    """The forward `fn` with its independent branches (`models/streams.py`) on one stream, with the MoE's shared
    expert alone on the side stream ("moe only"), and with MLA's latent row there too ("moe and mla"): each form's
    replay time and profile, and whether its output equals the factory's form bit for bit. On the CPU (smoke) the
    branches run in order whatever the setting: the forms' outputs and one eager call each."""
    from models.mla import InPlaceAbsorbedMLA
    from models.moe import MoE, PackedMoE

    modules = [m for m in target.modules() if isinstance(m, (MoE, PackedMoE, InPlaceAbsorbedMLA))]
    moes = [m for m in modules if not isinstance(m, InPlaceAbsorbedMLA)]
    factory = {id(m): m.overlap for m in modules}
    reference = fn()[0].clone()
    rows = {}
    try:
        for form, beside in (("one stream", []), ("moe only", moes), ("moe and mla", modules)):
            chosen = {id(m) for m in beside}
            for module in modules:
                module.overlap = id(module) in chosen
            same = bool(torch.equal(fn()[0], reference))
            replay = graph_time_us(fn, device, smoke)
            rows[form] = {"graph_us": replay, "equal_output": same, "beside": len(beside)}
            line = f"  {form} ({len(beside)} of {len(modules)} branches beside): {replay:.1f} us a replay (do_bench)"
            if not smoke:
                prof = replay_profile(fn, device)
                rows[form].update({k: prof[k] for k in ("kernels", "kernel_us", "idle_us", "overlap_us")})
                rows[form]["back_to_back_us"] = prof["back_to_back_us"]
                line += (f", {prof['back_to_back_us']:.1f} back to back, {prof['kernel_us']:.1f} in kernels, idle "
                         f"{prof['idle_us']:.1f}")  # fmt: skip
            print(f"{line}; output equal to the factory's form: {same}", flush=True)
    finally:
        for module in modules:
            module.overlap = factory[id(module)]
    return rows


def device_loop_steps(weights, setup, shard: int) -> dict:
    """The device loop's step graphs as the e2e benchmark runs them (prompt 64, capacity 1024): the autoregressive
    decode step and the DDTree-32 step with the oracle drafter, each profiled over replays; and one request each,
    its time after the prefill against its steps' graph time (what the request spends outside the steps)."""
    import statistics

    spec = SpecConfig(8, 32)
    prompt = torch.randint(0, shard - 2, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    rows, continuation = {}, None
    for name, autoregressive in (("autoregressive step", True), ("ddtree 32 oracle step", False)):
        probes = Probes(oracle=None if autoregressive else torch.tensor(continuation), record_events=True)
        generator = preset_ranks(weights, setup, spec, True, autoregressive, probes)
        generator.warm_up()
        loop = generator.ranks.lead.loop
        loop.events.clear()
        result = generator.generate(prompt, 256)
        continuation = result.tokens if autoregressive else continuation
        torch.cuda.synchronize()
        steps = [m[0].elapsed_time(m[-1]) for m in loop.events]
        after_prefill = result.decode_seconds
        request = {"tokens_per_s": result.decode_tokens_per_s, "steps": len(steps),
                   "step_ms": statistics.median(steps), "after_prefill_ms": after_prefill * 1e3,
                   "steps_sum_ms": sum(steps), "outside_steps_ms": after_prefill * 1e3 - sum(steps),
                   "first_launch_ms": (result.seconds.get("device_load", 0.0)) * 1e3}  # fmt: skip
        loop.events = None
        step = loop.graphs[False][0]  # the greedy step's graph
        prof = graph_replay_profile(step.replay)
        prof["back_to_back_us"] = back_to_back_us(step.replay, 20)  # 8 rows a step at most: fits
        rows[name] = {"request": request, **prof}
        print(f"\n{name}: request {request}", flush=True)
        print_replay_profile(name, None, prof)
        generator.ranks.close()
    return rows


def draft_attention_forms(drafter, args, device, smoke: bool) -> dict:
    """The drafter forward (CUDA graph replay) with each form of its attention: the Triton kernel (the GPU form:
    only the valid cached rows read), and over the concatenated [cache | new rows] under a key bias the einsum chain
    (the CPU form), a baddbmm / softmax / bmm chain (the previous GPU form) and scaled_dot_product_attention with
    PyTorch's backend choice and with each backend forced; the logits' distance from the einsum chain's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.dflash import DraftAttention

    form_class = type(drafter.layers[0].self_attn)  # the factory's form on this device
    kernel_form = form_class.attend_rows

    def concatenated(attention):
        def form(self, q, cache, k_new, v_new, key_bias, lengths):
            keys, values = torch.cat((cache[0], k_new)), torch.cat((cache[1], v_new))
            bias = DraftAttention.key_bias(cache.shape[1], k_new.shape[0] - q.shape[0], q.shape[0], *lengths, q.dtype)
            return attention(self, q, keys, values, bias)

        return form

    def baddbmm(self, q, keys, values, bias):
        folded = self.fold_heads(q)
        bias = bias.expand(self.kv_heads, folded.shape[1], -1)
        scores = torch.baddbmm(bias, folded, keys.permute(1, 2, 0), alpha=self.scale)
        return self.unfold_heads(torch.bmm(torch.softmax(scores, dim=-1), values.transpose(0, 1)), q.shape[0])

    def sdpa(backend):
        def attention(self, q, keys, values, bias):
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(
                    self.fold_heads(q)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                    attn_mask=bias.view(1, 1, 1, -1), scale=self.scale)  # fmt: skip
            return self.unfold_heads(out[0], q.shape[0])

        return attention

    forms = {
        "einsum chain": concatenated(DraftAttention.attend),
        f"{form_class.__name__} (the factory's form)": kernel_form,
        "baddbmm + softmax + bmm (the previous GPU form)": concatenated(baddbmm),
        "sdpa (PyTorch's choice)": concatenated(sdpa(None)),
        "sdpa efficient": concatenated(sdpa(SDPBackend.EFFICIENT_ATTENTION)),
        "sdpa cudnn": concatenated(sdpa(SDPBackend.CUDNN_ATTENTION)),
        "sdpa math": concatenated(sdpa(SDPBackend.MATH)),
    }
    rows, reference = {}, None
    try:
        for name, form in forms.items():
            form_class.attend_rows = form
            try:
                logits = drafter(*args)[0].float()
                reference = logits if reference is None else reference
                rows[name] = {"graph_us": graph_time_us(lambda: drafter(*args), device, smoke),
                              "rel_diff": float((logits - reference).norm() / reference.norm())}  # fmt: skip
            except RuntimeError as err:  # a backend that does not take these inputs
                rows[name] = {"error": str(err)[:200]}
            print(f"drafter with {name}: {rows[name]}", flush=True)
    finally:
        form_class.attend_rows = kernel_form
    return rows


if __name__ == "__main__":
    sys.exit(main())
