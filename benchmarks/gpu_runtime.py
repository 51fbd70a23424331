"""GPU runtime measurements in one run (issue: torch backend with CUDA graphs, Kimi-scale cost, speed-up).

    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR            (on a GPU)
    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR --smoke    (tiny shapes on the CPU: checks the script)

1. Kimi-scale cost of one dense and one MoE layer at TP-8 per-rank dims (hidden 7168, 8 of 64 heads, MLA ranks
   1536/512/64, 384 experts of width 2048/8, top-8 + shared expert), random bf16 weights, S = 4096 and 32768
   cached tokens, T = 1, 8, 16, 33: median of CUDA-graph replays for the whole layer, its attention and its MLP,
   bytes that must move, the floor, and the distinct experts the routing touched. One GPU: no all-reduce.
2. End-to-end tokens/s on scaled-up Kimi-architecture models (random weights, dims in the output): autoregressive
   vs DFlash chain vs DDTree budgets 8/16/32, with the random drafter and with an oracle drafter; time split per
   step and the time between graph replays (host gaps). A MoE model and an all-dense variant of it.
Writes OUT_DIR/gpu_runtime.json; prints markdown tables.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
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


def scaled_models(dense: bool, smoke: bool) -> tuple[TargetConfig, DrafterConfig]:
    """Kimi-architecture models scaled to one GPU (or to a CPU for --smoke)."""
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
    from plugins.tree_attention.kernel import tree_attention_cuda
    from plugins.tree_attention.reference import tree_attention

    config = scaled_models(False, True)[0] if smoke else kimi_tp8_rank()
    ops = ModelOps(tree_attention if smoke else tree_attention_cuda, SingleRank(), MoE if smoke else GroupedMoE)
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


def end_to_end(device, dtype, smoke: bool, new_tokens: int, repeats: int = 3) -> list[dict]:
    """Median of `repeats` generations per row (tokens/s and host gaps); the time split is the last run's."""
    from benchmarks.oracle_drafter import OracleDraftRanks
    from plugins.tree_attention.kernel import tree_attention_cuda
    from plugins.tree_attention.reference import tree_attention

    rows = []
    for dense in (False, True):
        target_cfg, drafter_cfg = scaled_models(dense, smoke)
        ops = ModelOps(tree_attention if smoke else tree_attention_cuda, SingleRank(), MoE if smoke else GroupedMoE)
        target, drafter = random_rank_models(target_cfg, drafter_cfg, ops, device, dtype, seed=3)
        model = "dense" if dense else "moe"
        dims = {
            "hidden": target_cfg.hidden_size,
            "layers": target_cfg.num_hidden_layers,
            "heads": target_cfg.num_attention_heads,
            "experts": target_cfg.n_routed_experts,
            "expert_width": target_cfg.moe_intermediate_size,
            "top_k": target_cfg.num_experts_per_tok,
            "dense_layers": target_cfg.first_k_dense_replace,
            "vocab": target_cfg.vocab_size,
            "drafter_layers": drafter_cfg.num_hidden_layers,
            "params": sum(p.numel() for p in target.parameters()),
        }
        prompt = torch.randint(0, target_cfg.vocab_size - 2, (64,), generator=torch.Generator().manual_seed(0)).tolist()
        greedy = Sampler(SamplingParams())
        engine, session = make_engine(target, drafter, target_cfg, drafter_cfg, SpecConfig(8, 32), device, dtype, smoke)
        generate_autoregressive(engine, prompt, 8, greedy)  # warm-up: capture the decode graph
        rates = []
        for _ in range(repeats):
            baseline = generate_autoregressive(engine, prompt, new_tokens, greedy)
            rates.append((len(baseline.tokens) - 1) / (baseline.elapsed - baseline.seconds.get("prefill", 0.0)))
        ar_rate = statistics.median(rates)
        rows.append(
            {
                "model": model,
                "mode": "autoregressive",
                "drafter": "-",
                "tokens_per_s": ar_rate,
                "speedup": 1.0,
                "dims": dims,
            }
        )
        print(f"{model}: autoregressive {ar_rate:.1f} tokens/s ({dims})", flush=True)
        modes = [("dflash chain", SpecConfig(8, 7, 1))] + [(f"ddtree {b}", SpecConfig(8, b)) for b in (8, 16, 32)]
        for drafter_kind in ("random", "oracle"):
            for mode, spec in modes:
                engine, session = make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, smoke)
                runner = OracleDraftRanks(engine, baseline.tokens) if drafter_kind == "oracle" else engine
                generate(runner, prompt, 16, spec, greedy)  # warm-up: capture the graphs
                rates, step_gaps = [], []
                for _ in range(repeats):
                    if not smoke:
                        session.events.clear()
                    result = generate(runner, prompt, new_tokens, spec, greedy)
                    steps = len(result.accept_lengths)
                    rates.append((len(result.tokens) - 1) / (result.elapsed - result.seconds.get("prefill", 0.0)))
                    gaps = session.host_gaps() if not smoke else []
                    if gaps and steps:
                        step_gaps.append(sum(gaps) / steps * 1e6)
                rate = statistics.median(rates)
                per_step_gap = statistics.median(step_gaps) if step_gaps else None
                match = next(
                    (i for i, (a, b) in enumerate(zip(result.tokens, baseline.tokens)) if a != b),
                    min(len(result.tokens), len(baseline.tokens)),
                )
                row = {
                    "model": model,
                    "mode": mode,
                    "drafter": drafter_kind,
                    "tokens_per_s": rate,
                    "speedup": rate / ar_rate,
                    "mean_accept_length": result.mean_accept_length,
                    "steps": steps,
                    "step_ms": {k: v / steps * 1e3 for k, v in result.seconds.items() if k != "prefill"},
                    "host_gap_us_per_step": per_step_gap,
                    "tokens_equal_to_autoregressive": match,
                    "tokens": len(result.tokens),
                }
                rows.append(row)
                print(
                    f"{model}: {mode:12s} {drafter_kind:6s} {rate:8.1f} tokens/s (x{rate / ar_rate:.2f}), accept "
                    f"{result.mean_accept_length:.2f}, per step {row['step_ms']}, host gaps {per_step_gap} us, "
                    f"equal to AR for {match}/{len(result.tokens)} tokens",
                    flush=True,
                )
        rows += device_loop_rows(model, target, drafter, target_cfg, drafter_cfg, prompt, baseline.tokens, ar_rate,
                                 device, dtype, smoke, new_tokens, repeats)  # fmt: skip
        del target, drafter
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def device_loop_rows(model, target, drafter, target_cfg, drafter_cfg, prompt, continuation, ar_rate, device, dtype,
                     smoke, new_tokens, repeats) -> list[dict]:  # fmt: skip
    """The same modes with the whole step on the device (runner/device_loop.py), one CUDA graph a step."""
    from runner.device_loop import generate_on_device

    rows = []
    for drafter_kind in ("random", "oracle"):
        for mode, spec in [("dflash chain", SpecConfig(8, 7, 1))] + [
            (f"ddtree {b}", SpecConfig(8, b)) for b in (8, 32)
        ]:
            engine, _ = make_engine(target, drafter, target_cfg, drafter_cfg, spec, device, dtype, smoke)
            oracle = torch.tensor(continuation, device=device) if drafter_kind == "oracle" else None
            engine.workers[0].enable_device_loop(oracle)
            loop = engine.workers[0].loop
            generate_on_device(engine, spec, prompt, 32, 1024)  # warm-up: capture the step graph
            rates, gaps = [], []
            for _ in range(repeats):
                loop.events = [] if not smoke else None
                result = generate_on_device(engine, spec, prompt, new_tokens, 1024)
                rates.append((len(result.tokens) - 1) / (result.elapsed - result.seconds.get("prefill", 0.0)))
                if loop.events:
                    torch.cuda.synchronize()
                    idle = [loop.events[i][1].elapsed_time(loop.events[i + 1][0]) for i in range(len(loop.events) - 1)]
                    gaps.append(statistics.median(idle) * 1e3)
                    step_ms = statistics.median(s.elapsed_time(e) for s, e in loop.events)
            match = next((i for i, (a, b) in enumerate(zip(result.tokens, continuation)) if a != b),
                         min(len(result.tokens), len(continuation)))  # fmt: skip
            rate = statistics.median(rates)
            row = {"model": model, "mode": f"{mode} (device loop)", "drafter": drafter_kind, "tokens_per_s": rate,
                   "speedup": rate / ar_rate, "mean_accept_length": result.mean_accept_length,
                   "host_gap_us_per_step": statistics.median(gaps) if gaps else None,
                   "step_graph_ms": step_ms if gaps else None, "tokens_equal_to_autoregressive": match,
                   "tokens": len(result.tokens)}  # fmt: skip
            rows.append(row)
            print(
                f"{model}: {mode:12s} device loop {drafter_kind:6s} {rate:8.1f} tokens/s (x{rate / ar_rate:.2f}), "
                f"accept {result.mean_accept_length:.2f}, GPU idle between steps {row['host_gap_us_per_step']} us, "
                f"step graph {row['step_graph_ms']} ms, equal to AR for {match}/{len(result.tokens)}",
                flush=True,
            )
    return rows


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
        e2e = end_to_end(device, dtype, smoke, new_tokens=24 if smoke else 256)
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
    print("\n| model | mode | drafter | tokens/s | speedup | accept length | host gap us/step |")
    print("|---|---|---|---|---|---|---|")
    for r in e2e:
        gap = r.get("host_gap_us_per_step")
        print(
            f"| {r['model']} | {r['mode']} | {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
            f"{r.get('mean_accept_length', 1.0):.2f} | {gap if gap is None else round(gap, 1)} |"
        )
    if costs:
        print(f"median layer/floor {statistics.median(r['ratio'] for r in costs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
