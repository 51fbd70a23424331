"""GPU runtime measurements in one run (issue: torch backend with CUDA graphs, Kimi-scale cost, speed-up).

    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR            (on a GPU)
    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR --smoke    (tiny shapes on the CPU: checks the script)
    options: --e2e-only (skip table 1), --models=moe,dense,kimi-rank (table 2's models)

1. Kimi-scale cost of one dense and one MoE layer at TP-8 per-rank dims (hidden 7168, 8 of 64 heads, MLA ranks
   1536/512/64, 384 experts of width 2048/8, top-8 + shared expert), random bf16 weights, S = 4096 and 32768
   cached tokens, T = 1, 8, 16, 33: median of CUDA-graph replays for the whole layer, its attention and its MLP,
   bytes that must move, the floor, and the distinct experts the routing touched. One GPU: no all-reduce.
2. End-to-end tokens/s on scaled-up Kimi-architecture models (random weights, dims in the output): autoregressive
   vs DFlash chain vs DDTree budgets 8/16/32, with the random drafter and with an oracle drafter; time split per
   step and the GPU idle time between graph replays. A MoE model, an all-dense variant, and one TP-8 rank of Kimi.
Writes OUT_DIR/gpu_runtime.json; prints markdown tables.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from engines.io import role_io
from engines.spec import BuildConfig, SpecConfig, derive_profiles
from models.config import DrafterConfig, RopeConfig, TargetConfig
from models.kimi import DecoderLayer, ModelOps
from models.layout import rank_target_shapes
from models.mapping import Mapping
from models.mla import AbsorbedMLA
from models.moe import GroupedMoE, MoE
from models.parallel import SingleRank
from models.random_weights import random_rank_models, random_state, router_in_fp32
from models.rope import Rotary
from runner.ranks import LocalRanks
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate, generate_autoregressive
from runner.worker import RankWorker

KIMI_ROPE = RopeConfig("yarn", 50000.0, 64.0, 4096, 32.0, 1.0, 1.0, 1.0)


def kimi_tp8_rank() -> TargetConfig:
    return TargetConfig(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=384,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        rope=KIMI_ROPE,
        max_position_embeddings=262144,
        mapping=Mapping(8, 0, 8),
    )


def kimi_tp8_drafter(target: TargetConfig) -> DrafterConfig:
    """Kimi-K2.5-DFlash (6 layers, hidden 7168, 64 / 8 heads of 128, MLP 18432, block 8) as one of 8 ranks sees it."""
    return DrafterConfig(
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=6,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=target.vocab_size,
        block_size=8,
        mask_token_id=target.vocab_size - 2,  # [UNK] 163838
        target_layer_ids=(1, 12, 24, 35, 47, 58),
        rope=KIMI_ROPE,
        mapping=target.mapping,
    )


MODELS = ("moe", "dense", "kimi-rank")


def scaled_models(model: str, smoke: bool) -> tuple[TargetConfig, DrafterConfig]:
    """Kimi-architecture models for one GPU (or, --smoke, for a CPU).

    moe / dense: scaled down to fit one GPU whole. kimi-rank: what one rank of Kimi K2 at TP-8 computes for a token
    (61 layers at per-rank dims, vocab-parallel head of 163840 / 8 rows, the K2.5 DFlash drafter's rank share), with
    every MLP dense at the per-rank width 18432 / 8 = 2304: at one token that reads the bytes of the shared expert plus
    8 routed experts of width 2048 / 8 (section 2 measures what the MoE adds at 33 tokens); one GPU, so the
    all-reduces are left out (`SingleRank`)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if model == "kimi-rank":
        target = kimi_tp8_rank()
        if smoke:
            target = replace(target, hidden_size=64, intermediate_size=256, num_hidden_layers=4, vocab_size=1024,
                             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             num_attention_heads=16, mapping=Mapping(2, 0, 2))  # fmt: skip
        target = replace(target, first_k_dense_replace=target.num_hidden_layers)
        drafter = kimi_tp8_drafter(target)
        if smoke:
            drafter = replace(drafter, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              target_layer_ids=(1, 2))  # fmt: skip
        return target, drafter
    dense = model == "dense"
    if smoke:
        hidden, layers, heads, experts, width, vocab, q_lora, kv_lora, rope = 64, 4, 4, 8, 32, 512, 32, 32, 16
    else:
        hidden, layers, heads, experts, width, vocab, q_lora, kv_lora, rope = 2048, 8, 16, 64, 768, 32768, 1536, 512, 64
    target = TargetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=2 * rope,
        qk_rope_head_dim=rope,
        v_head_dim=2 * rope,
        n_routed_experts=experts,
        num_experts_per_tok=min(8, experts),
        n_shared_experts=1,
        first_k_dense_replace=layers if dense else 1,
        routed_scaling_factor=2.827,
        rope=KIMI_ROPE,
        max_position_embeddings=262144,
    )
    drafter = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=2 * rope,
        vocab_size=vocab,
        block_size=8,
        mask_token_id=vocab - 2,
        target_layer_ids=(1, layers // 2, layers - 2),
        rope=KIMI_ROPE,
    )
    return target, drafter


def benchmark_ops(smoke: bool) -> ModelOps:
    """One GPU's ops (the Triton TreeAttention kernel, grouped-GEMM MoE, no collectives); --smoke: CPU references."""
    from plugins.tree_attention.kernel import tree_attention_cuda
    from plugins.tree_attention.reference import tree_attention

    return ModelOps(tree_attention if smoke else tree_attention_cuda, SingleRank(), MoE if smoke else GroupedMoE)


def tree_mask(tokens: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    mask = torch.eye(tokens, dtype=torch.bool)
    for node in range(1, tokens):
        mask[node] |= mask[int(torch.randint(0, node, (1,), generator=gen))]
    return mask.to(device)


def graph_time_us(fn, device, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3


def random_layer(config: TargetConfig, layer_idx: int, ops: ModelOps, device, dtype) -> DecoderLayer:
    prefix = f"model.layers.{layer_idx}."
    shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
    with torch.device("meta"):
        layer = DecoderLayer(config, layer_idx, AbsorbedMLA, ops)
    state = router_in_fp32(random_state(shapes, seed=layer_idx, device=device, dtype=dtype))
    layer.load_state_dict(state, strict=True, assign=True)
    layer.self_attn.prepare_weights()
    return layer.eval().requires_grad_(False)


def time_layer(layer, x, cos, sin, mask, cache, cache_length, device, smoke) -> tuple[float, float, float]:
    """(whole layer, attention, MLP) in microseconds."""
    normed, mlp_in = layer.input_layernorm(x), layer.post_attention_layernorm(x)
    full = graph_time_us(lambda: layer(x, cos, sin, mask, cache, cache_length), device, smoke)
    attn = graph_time_us(lambda: layer.self_attn(normed, cos, sin, mask, cache, cache_length), device, smoke)
    mlp = graph_time_us(lambda: layer.mlp(mlp_in), device, smoke)
    return full, attn, mlp


def nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def layer_costs(ceilings: dict, device, dtype, smoke: bool) -> list[dict]:
    config = scaled_models("moe", True)[0] if smoke else kimi_tp8_rank()
    ops = benchmark_ops(smoke)
    rotary = Rotary(config.rope, config.qk_rope_head_dim)
    rotary.rebuild(device)
    rows = []
    for layer_idx, kind in ((0, "dense"), (1, "moe")):
        layer = random_layer(config, layer_idx, ops, device, dtype)
        attn_bytes = nbytes(layer.self_attn) + 2 * nbytes(layer.input_layernorm)
        for length in (256, 512) if smoke else (4096, 32768):
            cache = torch.randn(length + 64, config.latent_dim, device=device).to(dtype)
            cache_length = torch.tensor([length], device=device)
            for tokens in (1, 8, 16, 33):
                gen = torch.Generator(device=device).manual_seed(tokens)
                x = torch.randn(tokens, config.hidden_size, generator=gen, device=device).to(dtype)
                depths = tree_mask(tokens, "cpu").sum(-1) - 1
                cos, sin = rotary(torch.as_tensor(length + depths, device=device), dtype)
                mask = tree_mask(tokens, device)
                full, attn, mlp = time_layer(layer, x, cos, sin, mask, cache, cache_length, device, smoke)
                moe_check = None
                if kind == "moe" and not smoke:  # the grouped-GEMM MoE against the gathered (exported) form
                    mlp_in = layer.post_attention_layernorm(x)
                    grouped, gathered = layer.mlp(mlp_in).float(), MoE.forward(layer.mlp, mlp_in).float()
                    moe_check = float((grouped - gathered).norm() / gathered.norm())
                if kind == "moe":
                    ids = layer.mlp.gate(x)[0]
                    distinct = int(ids.unique().numel())
                    expert = 3 * config.hidden_size * (config.moe_intermediate_size // config.mapping.tp_size) * 2
                    mlp_bytes = distinct * expert + nbytes(layer.mlp.shared_experts) + nbytes(layer.mlp.gate)
                else:
                    distinct, mlp_bytes = None, nbytes(layer.mlp)
                cache_bytes = length * config.latent_dim * 2
                total_bytes = attn_bytes + cache_bytes + mlp_bytes
                heads = config.heads_per_rank
                flops = 2 * tokens * (attn_bytes + mlp_bytes) / 2 + 2 * tokens * heads * (length + tokens) * (
                    config.latent_dim + config.kv_lora_rank
                )
                floor = max(total_bytes / ceilings["copy_Bps"], flops / ceilings["bf16_flops"]) * 1e6
                rows.append(
                    {
                        "layer": kind,
                        "S": length,
                        "T": tokens,
                        "layer_us": full,
                        "attention_us": attn,
                        "mlp_us": mlp,
                        "bytes": total_bytes,
                        "attention_bytes": attn_bytes + cache_bytes,
                        "mlp_bytes": mlp_bytes,
                        "floor_us": floor,
                        "ratio": full / floor,
                        "distinct_experts": distinct,
                        "grouped_vs_gathered_rel_error": moe_check,
                    }
                )
                print(
                    f"{kind:5s} S={length:6d} T={tokens:2d}: layer {full:8.1f} us (attention {attn:7.1f}, mlp "
                    f"{mlp:7.1f}), floor {floor:7.1f} us, {total_bytes / 1e6:7.1f} MB, distinct experts {distinct}"
                    f", grouped vs gathered MoE {moe_check}",
                    flush=True,
                )
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, smoke):
    from runner.cuda_graphs import CudaGraphSession
    from runner.session import TorchSession

    build = BuildConfig(max_input_len=128, max_seq_len=1024, dtype=str(dtype).removeprefix("torch."))
    profiles = derive_profiles(spec, build)
    io = {role: role_io(role, target_cfg, drafter_cfg) for role in ("target", "draft")}
    if smoke:
        session = TorchSession(target, drafter, profiles, io)
    else:
        session = CudaGraphSession(target, drafter, profiles, io, device, record_gaps=True)
    worker = RankWorker(session, spec, target_cfg, drafter_cfg, build.max_seq_len, dtype, device)
    return LocalRanks([worker]), session


HOST_LOOP_MODELS = ("moe", "dense")  # models that also get the host-loop rows (the comparison with the device loop)
SPEC_MODES = [("dflash chain", SpecConfig(8, 7, 1))] + [(f"ddtree {b}", SpecConfig(8, b)) for b in (8, 16, 32)]


def tokens_per_s(result) -> float:
    return (len(result.tokens) - 1) / (result.elapsed - result.seconds.get("prefill", 0.0))


def first_difference(tokens, reference) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def end_to_end(device, dtype, smoke: bool, new_tokens: int, models, repeats: int = 3) -> list[dict]:
    """Median of `repeats` generations per row (tokens/s and GPU idle); per-step splits from one more run.

    Speed-ups are against the faster autoregressive loop (the device loop's, one graph a token, queued ahead)."""
    rows = []
    for model in models:
        target_cfg, drafter_cfg = scaled_models(model, smoke)
        ops = benchmark_ops(smoke)
        target, drafter = random_rank_models(target_cfg, drafter_cfg, ops, device, dtype, seed=3)
        dims = {
            "hidden": target_cfg.hidden_size,
            "layers": target_cfg.num_hidden_layers,
            "heads_per_rank": target_cfg.heads_per_rank,
            "experts": target_cfg.n_routed_experts,
            "expert_width": target_cfg.moe_intermediate_size,
            "top_k": target_cfg.num_experts_per_tok,
            "dense_layers": target_cfg.first_k_dense_replace,
            "vocab": target_cfg.vocab_size,
            "tp_share": target_cfg.mapping.tp_size,
            "drafter_layers": drafter_cfg.num_hidden_layers,
            "params": sum(p.numel() for p in target.parameters()),
            "drafter_params": sum(
                p.numel() for n, p in drafter.named_parameters() if "lm_head" not in n and "embed" not in n
            ),  # fmt: skip
        }
        shard = target_cfg.vocab_size // target_cfg.mapping.tp_size  # ids this rank's embedding and head hold
        prompt = torch.randint(0, shard - 2, (64,), generator=torch.Generator().manual_seed(0)).tolist()
        greedy = Sampler(SamplingParams())
        engine, session = make_engine(target, drafter, target_cfg, drafter_cfg, SpecConfig(8, 32), device, dtype, smoke)
        generate_autoregressive(engine, prompt, 8, greedy)  # warm-up: capture the decode graph
        rates = []
        for _ in range(repeats):
            baseline = generate_autoregressive(engine, prompt, new_tokens, greedy)
            rates.append(tokens_per_s(baseline))
        host_ar = statistics.median(rates)
        ar_row = loop_row(model, "autoregressive (device loop)", "-", None, target, drafter, target_cfg, drafter_cfg,
                          prompt, baseline.tokens, device, dtype, smoke, new_tokens, repeats)  # fmt: skip
        ar_rate = max(host_ar, ar_row["tokens_per_s"])
        rows.append({"model": model, "mode": "autoregressive", "drafter": "-", "tokens_per_s": host_ar, "dims": dims})
        rows.append(ar_row)
        print(f"{model}: autoregressive {host_ar:.1f} tokens/s host loop, {ar_row['tokens_per_s']:.1f} device loop"
              f" ({dims})", flush=True)  # fmt: skip
        if model in HOST_LOOP_MODELS:
            rows += host_loop_rows(model, target, drafter, target_cfg, drafter_cfg, prompt, baseline.tokens, device,
                                   dtype, smoke, new_tokens, repeats)  # fmt: skip
        for drafter_kind in ("random", "oracle"):
            for mode, spec in SPEC_MODES:
                rows.append(loop_row(model, f"{mode} (device loop)", drafter_kind, spec, target, drafter, target_cfg,
                                     drafter_cfg, prompt, baseline.tokens, device, dtype, smoke, new_tokens,
                                     repeats))  # fmt: skip
        for row in rows:
            if row["model"] == model:
                row["speedup"] = row["tokens_per_s"] / ar_rate
                row["speedup_vs_host_autoregressive"] = row["tokens_per_s"] / host_ar
        del target, drafter, engine, session
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def host_loop_rows(model, target, drafter, target_cfg, drafter_cfg, prompt, continuation, device, dtype, smoke,
                   new_tokens, repeats) -> list[dict]:  # fmt: skip
    """`speculate.speculative_step`: a draft graph, a verify graph and Python (tree, walk) in between."""
    from benchmarks.oracle_drafter import OracleDraftRanks

    rows, greedy = [], Sampler(SamplingParams())
    for drafter_kind in ("random", "oracle"):
        for mode, spec in SPEC_MODES:
            engine, session = make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, smoke)
            runner = OracleDraftRanks(engine, continuation) if drafter_kind == "oracle" else engine
            generate(runner, prompt, 16, spec, greedy)  # warm-up: capture the graphs
            rates, step_gaps = [], []
            for _ in range(repeats):
                if not smoke:
                    session.events.clear()
                result = generate(runner, prompt, new_tokens, spec, greedy)
                steps = len(result.accept_lengths)
                rates.append(tokens_per_s(result))
                gaps = session.host_gaps() if not smoke else []
                if gaps and steps:
                    step_gaps.append(sum(gaps) / steps * 1e6)
            row = {
                "model": model,
                "mode": mode,
                "drafter": drafter_kind,
                "tokens_per_s": statistics.median(rates),
                "mean_accept_length": result.mean_accept_length,
                "steps": steps,
                "step_ms": {k: v / steps * 1e3 for k, v in result.seconds.items() if k != "prefill"},
                "host_gap_us_per_step": statistics.median(step_gaps) if step_gaps else None,
                "tokens_equal_to_autoregressive": first_difference(result.tokens, continuation),
                "tokens": len(result.tokens),
            }
            rows.append(row)
            print(f"{model}: {mode:12s} host loop {drafter_kind:6s} {row['tokens_per_s']:8.1f} tokens/s, accept "
                  f"{result.mean_accept_length:.2f}, per step {row['step_ms']}, GPU idle {row['host_gap_us_per_step']}"
                  f" us/step, equal to AR for {row['tokens_equal_to_autoregressive']}/{len(result.tokens)}",
                  flush=True)  # fmt: skip
    return rows


PHASES = ("draft", "tree", "verify", "accept")


def loop_row(model, mode, drafter_kind, spec, target, drafter, target_cfg, drafter_cfg, prompt, continuation, device,
             dtype, smoke, new_tokens, repeats) -> dict:  # fmt: skip
    """`runner/device_loop.py`: one CUDA graph a step (spec None: an autoregressive decode step), the next queued
    behind it. tokens/s and GPU idle between steps from `repeats` runs; the split into phases from one more run with
    one graph per phase (events between them)."""
    from runner.device_loop import generate_on_device

    autoregressive = spec is None
    spec = spec or SpecConfig(8, 32)
    engine, _ = make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, smoke)
    worker = engine.workers[0]
    oracle = torch.tensor(continuation, device=device) if drafter_kind == "oracle" else None
    runner = engine  # every step runs on the device (the prompt's context is committed to the draft cache first)
    row = {"model": model, "mode": mode, "drafter": drafter_kind}
    for split in (False,) if autoregressive else (False, True):
        worker.enable_device_loop(oracle, autoregressive, split_phases=split)
        generate_on_device(runner, spec, prompt, 32, 1024, autoregressive=autoregressive)  # warm-up: capture
        rates, idle, step_ms = [], [], []
        for _ in range(1 if split else repeats):
            worker.loop.events = [] if not smoke else None
            result = generate_on_device(runner, spec, prompt, new_tokens, 1024, autoregressive=autoregressive)
            rates.append(tokens_per_s(result))
            if worker.loop.events:
                torch.cuda.synchronize()
                marks = worker.loop.events
                idle.append(statistics.median(a[-1].elapsed_time(b[0]) for a, b in zip(marks, marks[1:])) * 1e3)
                step_ms.append(statistics.median(m[0].elapsed_time(m[-1]) for m in marks))
                if split:
                    row["phase_ms"] = {name: statistics.median(m[i].elapsed_time(m[i + 1]) for m in marks)
                                       for i, name in enumerate(PHASES)}  # fmt: skip
        if split:
            row["split_tokens_per_s"], row["split_step_ms"] = rates[0], step_ms[0] if step_ms else None
            continue
        row.update(tokens_per_s=statistics.median(rates), mean_accept_length=result.mean_accept_length,
                   gpu_idle_us_per_step=statistics.median(idle) if idle else None,
                   step_graph_ms=statistics.median(step_ms) if step_ms else None,
                   prefill_ms=result.seconds.get("prefill", 0.0) * 1e3,  # the drafter's prefill too (speculative)
                   tokens_equal_to_autoregressive=first_difference(result.tokens, continuation),
                   tokens=len(result.tokens))  # fmt: skip
    engine.close()
    print(f"{model}: {mode:30s} {drafter_kind:6s} {row['tokens_per_s']:8.1f} tokens/s, accept "
          f"{row['mean_accept_length']:.2f}, GPU idle {row['gpu_idle_us_per_step']} us/step, step graph "
          f"{row['step_graph_ms']} ms, phases {row.get('phase_ms')}, equal to AR for "
          f"{row['tokens_equal_to_autoregressive']}/{row['tokens']}", flush=True)  # fmt: skip
    return row


def measure_ceilings(smoke: bool) -> dict:
    if smoke:
        return {"copy_Bps": 1e10, "bf16_flops": 1e11}
    import triton.testing

    n = 1 << 30
    src, dst = torch.randn(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_Bps": 2 * n * 2 / copy_ms * 1e3, "bf16_flops": 2 * 8192**3 / mm_ms * 1e3}


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    smoke = "--smoke" in sys.argv
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    started = time.time()
    ceilings = measure_ceilings(smoke)
    print(f"ceilings: copy {ceilings['copy_Bps'] / 1e9:.0f} GB/s, bf16 {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")
    with torch.no_grad():
        costs = [] if "--e2e-only" in sys.argv else layer_costs(ceilings, device, dtype, smoke)
        models = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--models=")), MODELS)
        e2e = end_to_end(device, dtype, smoke, 24 if smoke else 256, models)
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "seconds": time.time() - started,
        "gpu": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
        "ceilings": ceilings,
        "layer_costs": costs,
        "end_to_end": e2e,
    }
    (out_dir / "gpu_runtime.json").write_text(json.dumps(info, indent=1))
    print(
        "\n| layer | S | T | layer (us) | attention (us) | MLP (us) | MB moved | floor (us) | layer/floor "
        "| distinct experts |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in costs:
        print(
            f"| {r['layer']} | {r['S']} | {r['T']} | {r['layer_us']:.1f} | {r['attention_us']:.1f} | "
            f"{r['mlp_us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {r['ratio']:.2f} | "
            f"{r['distinct_experts'] if r['distinct_experts'] is not None else '-'} |"
        )
    print("\n| model | mode | drafter | tokens/s | speedup | accept length | GPU idle us/step | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in e2e:
        gap = r.get("host_gap_us_per_step", r.get("gpu_idle_us_per_step"))
        split = r.get("phase_ms") or r.get("step_ms") or r.get("step_graph_ms")
        print(
            f"| {r['model']} | {r['mode']} | {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
            f"{r.get('mean_accept_length', 1.0):.2f} | {gap if gap is None else round(gap, 1)} | {split} |"
        )
    if costs:
        print(f"median layer/floor {statistics.median(r['ratio'] for r in costs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
