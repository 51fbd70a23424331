"""GPU runtime measurements in one run: Kimi-scale layer cost, and end-to-end tokens/s through the rank factory.

    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR [--models moe,dense,kimi-rank] [--e2e-only]
    PYTHONPATH=. python3 benchmarks/gpu_runtime.py OUT_DIR --smoke      (tiny shapes on the CPU: checks the script)

1. Layer cost: one dense and one MoE layer of a Kimi K2.x TP-8 rank (`models/presets.py`; hidden 7168, 8 of 64
   heads, MLA 1536/512/64, 384 experts of width 2048/8, top-8 + shared expert), random bf16 weights, S = 4096 and
   32768 cached tokens, T = 1, 8, 16, 33: median of CUDA-graph replays for the whole layer, its attention and its
   MLP, bytes that must move, the floor, and the distinct experts the routing touched. One GPU: no all-reduce.
2. End to end on the presets (random weights): autoregressive vs DFlash chain vs DDTree budgets 8/16/32, with the
   random drafter and with an oracle drafter (probes: every stage runs, then its logits follow a known
   continuation), on the device loop (and the host loop for moe / dense); tokens/s over the decode (after the first
   token), the split per phase and the GPU idle time between graphs. Ranks come from `runner.factory` and requests
   go through `runner.generator.Generator`: the CLI's path. `--temperatures 0,1` adds sampled rows (temperature 1,
   each `--top-p`, seed 7) next to the greedy ones: the device loop's sampled step (target distributions, the lossless
   tree walk, counter-based draws) against its greedy step, same ranks and prompt; sampled oracle rows keep the
   real draws in the step and then follow the known continuation (the cost of a sampled step at full acceptance).
Writes OUT_DIR/gpu_runtime.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import (
    BUILD,
    Setup,
    add_setup_args,
    environment,
    first_difference,
    graph_time_us,
    measure_ceilings,
    preset_ranks,
    tree_mask,
)
from engines.spec import BuildConfig, SpecConfig
from models.kimi import DecoderLayer
from models.layout import rank_target_shapes
from models.moe import MoE
from models.parallel import SingleRank
from models.presets import preset
from models.random_weights import random_state, router_in_fp32
from models.rope import Rotary
from runner.factory import PresetWeights, model_ops
from runner.probes import Probes
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate

MODELS = ("moe", "dense", "kimi-rank")
HOST_LOOP_MODELS = ("moe", "dense")  # models that also get the host-loop rows (the comparison with the device loop)
SPEC_MODES = [("dflash chain", SpecConfig(8, 7, 1))] + [(f"ddtree {b}", SpecConfig(8, b)) for b in (8, 16, 32)]
PHASES = ("draft", "tree", "verify", "accept")


def random_layer(config, layer_idx: int, setup: Setup) -> DecoderLayer:
    """One decoder layer of `config` in the forms the rank factory picks for this device."""
    ops = model_ops(setup.device, SingleRank(), config, setup.dtype)
    prefix = f"model.layers.{layer_idx}."
    shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
    with torch.device("meta"):
        layer = DecoderLayer(config, layer_idx, ops)
    state = router_in_fp32(random_state(shapes, seed=layer_idx, device=setup.device, dtype=setup.dtype))
    layer.load_state_dict(state, strict=True, assign=True)
    from models.layers import prepare_weights

    prepare_weights(layer)
    return layer.eval().requires_grad_(False)


def nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def layer_costs(ceilings: dict, setup: Setup) -> list[dict]:
    config = preset("kimi-k2", setup.smoke).target
    config = config.for_rank(type(config.mapping)(1 if setup.smoke else 8, 0, 1 if setup.smoke else 8))
    device, dtype, smoke = setup.device, setup.dtype, setup.smoke
    rotary = Rotary(config.rope, config.qk_rope_head_dim)
    rotary.rebuild(device)
    rows = []
    for layer_idx, kind in ((0, "dense"), (1, "moe")):
        layer = random_layer(config, layer_idx, setup)
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
                full, attn, mlp = time_layer(layer, (x, cos, sin, mask, cache, cache_length), setup)
                moe_check = None
                if kind == "moe" and type(layer.mlp) is not MoE:  # the grouped-GEMM MoE against the gathered form
                    mlp_in = layer.post_attention_layernorm(x)
                    grouped, gathered = layer.mlp(mlp_in).float(), MoE.forward(layer.mlp, mlp_in).float()
                    moe_check = float((grouped - gathered).norm() / gathered.norm())
                if kind == "moe":
                    distinct = int(layer.mlp.gate(x)[0].unique().numel())
                    expert = 3 * config.hidden_size * (config.moe_intermediate_size // config.mapping.tp_size) * 2
                    mlp_bytes = distinct * expert + nbytes(layer.mlp.shared_experts) + nbytes(layer.mlp.gate)
                else:
                    distinct, mlp_bytes = None, nbytes(layer.mlp)
                cache_bytes = length * config.latent_dim * 2
                total_bytes = attn_bytes + cache_bytes + mlp_bytes
                flops = 2 * tokens * (attn_bytes + mlp_bytes) / 2 + 2 * tokens * config.heads_per_rank * (
                    length + tokens
                ) * (config.latent_dim + config.kv_lora_rank)
                floor = max(total_bytes / ceilings["copy_Bps"], flops / ceilings["bf16_flops"]) * 1e6
                rows.append({"layer": kind, "S": length, "T": tokens, "layer_us": full, "attention_us": attn,
                             "mlp_us": mlp, "bytes": total_bytes, "attention_bytes": attn_bytes + cache_bytes,
                             "mlp_bytes": mlp_bytes, "floor_us": floor, "ratio": full / floor,
                             "distinct_experts": distinct, "grouped_vs_gathered_rel_error": moe_check})  # fmt: skip
                print(f"{kind:5s} S={length:6d} T={tokens:2d}: layer {full:8.1f} us (attention {attn:7.1f}, mlp "
                      f"{mlp:7.1f}), floor {floor:7.1f} us, {total_bytes / 1e6:7.1f} MB, distinct experts {distinct}, "
                      f"grouped vs gathered MoE {moe_check}", flush=True)  # fmt: skip
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def time_layer(layer, args: tuple, setup: Setup) -> tuple[float, float, float]:
    """(whole layer, attention, MLP) in microseconds; args: (x, cos, sin, mask, cache, cache_length)."""
    x, rest = args[0], args[1:]
    normed, mlp_in = layer.input_layernorm(x), layer.post_attention_layernorm(x)
    full = graph_time_us(lambda: layer(*args), setup.device, setup.smoke)
    attn = graph_time_us(lambda: layer.self_attn(normed, *rest), setup.device, setup.smoke)
    return full, attn, graph_time_us(lambda: layer.mlp(mlp_in), setup.device, setup.smoke)


@dataclass
class ModelRun:
    """One model's shared state: its weights (built once, shared by every row's ranks), prompt and the greedy
    autoregressive continuation every speculative row must reproduce."""

    name: str
    weights: PresetWeights
    prompt: list[int]
    new_tokens: int
    continuation: list[int] | None = None
    limits: BuildConfig = BUILD  # prompt and sequence lengths the ranks are built for
    params: SamplingParams = SamplingParams()  # the rows' sampling (greedy unless a temperature is given)
    context_rows: int = 0  # synthetic cached rows before the prompt (`runner/probes.py`)

    @property
    def label(self) -> str:
        return "" if self.params.greedy else f", T={self.params.temperature:g}, top-p {self.params.top_p:g}"


def end_to_end(
    setup: Setup, models, new_tokens: int, save=None, sampled: tuple[SamplingParams, ...] = ()
) -> list[dict]:
    """Median of `setup.repeats` requests per row; the per-phase split from one more request with a graph per phase.
    Speed-ups are against the faster autoregressive loop of the same sampling. sampled: the device-loop rows again
    with each of these sampling parameters."""
    rows = []
    for name in models:
        weights = PresetWeights(name, setup.dtype, seed=3, smoke=setup.smoke)
        target_cfg, drafter_cfg = weights.rank_configs(0)
        shard = target_cfg.vocab_size // target_cfg.mapping.tp_size  # ids this rank's embedding and head hold
        prompt = torch.randint(0, shard - 2, (64,), generator=torch.Generator().manual_seed(0)).tolist()
        run = ModelRun(name, weights, prompt, new_tokens)
        host_ar = request_row(run, setup, "autoregressive", "-", SpecConfig(8, 32), device_loop=False)
        run.continuation = host_ar.pop("tokens_list")
        device_ar = request_row(run, setup, "autoregressive (device loop)", "-", SpecConfig(8, 32), device_loop=True)
        dims = {"hidden": target_cfg.hidden_size, "layers": target_cfg.num_hidden_layers,
                "heads_per_rank": target_cfg.heads_per_rank, "experts": target_cfg.n_routed_experts,
                "expert_width": target_cfg.moe_intermediate_size, "top_k": target_cfg.num_experts_per_tok,
                "dense_layers": target_cfg.first_k_dense_replace, "vocab": target_cfg.vocab_size,
                "tp_share": target_cfg.mapping.tp_size, "drafter_layers": drafter_cfg.num_hidden_layers,
                "params": sum(math.prod(shape) for shape in rank_target_shapes(target_cfg).values())}  # fmt: skip
        model_rows = [{**host_ar, "dims": dims}, device_ar]
        print(f"{name}: autoregressive {host_ar['tokens_per_s']:.1f} tokens/s host loop, "
              f"{device_ar['tokens_per_s']:.1f} device loop ({dims})", flush=True)  # fmt: skip
        for drafter in ("random", "oracle"):
            for mode, spec in SPEC_MODES:
                if name in HOST_LOOP_MODELS:
                    model_rows.append(request_row(run, setup, mode, drafter, spec, device_loop=False))
                model_rows.append(request_row(run, setup, f"{mode} (device loop)", drafter, spec, device_loop=True))
        baseline = max(host_ar["tokens_per_s"], device_ar["tokens_per_s"])
        for row in model_rows:
            row["speedup"] = row["tokens_per_s"] / baseline
        for params in sampled:
            draws = ModelRun(name, weights, prompt, new_tokens, run.continuation, run.limits, params)
            sampled_ar = request_row(draws, setup, "autoregressive (device loop)", "-", SpecConfig(8, 32), True)
            sampled_rows = [sampled_ar] + [
                request_row(draws, setup, f"{mode} (device loop)", drafter, spec, device_loop=True)
                for drafter in ("random", "oracle")
                for mode, spec in SPEC_MODES
            ]
            for row in sampled_rows:
                row["speedup"] = row["tokens_per_s"] / sampled_ar["tokens_per_s"]
            model_rows += sampled_rows
        for row in model_rows:
            row.pop("tokens_list", None)
        rows += model_rows
        if save is not None:  # after each model: a run cut short keeps what it measured
            save(rows)
        del weights, run
        if not setup.smoke:
            torch.cuda.empty_cache()
    return rows


def request_row(run: ModelRun, setup: Setup, mode: str, drafter: str, spec: SpecConfig, device_loop: bool,
                budget: int | str | None = None) -> dict:  # fmt: skip
    """One row: ranks from the factory, a warm-up request, then `setup.repeats` timed requests (the median);
    device-loop speculative rows also get the per-phase split from ranks with a graph per phase. budget: a spec with
    several budgets verifies this one, or "auto" (its costs measured first, as `--ddtree_budget auto` does); the
    row records the budgets the steps took."""
    autoregressive = mode.startswith("autoregressive")
    oracle = torch.tensor(run.continuation) if drafter == "oracle" else None
    params = run.params
    events = not setup.smoke
    generator = preset_ranks(run.weights, setup, spec, device_loop, autoregressive,
                             Probes(oracle=oracle if device_loop else None, record_events=events,
                                    context_rows=run.context_rows),
                             run.limits)  # fmt: skip
    host_oracle = drafter == "oracle" and not device_loop
    if host_oracle:  # the host loop's oracle wraps the ranks (benchmarks/oracle_drafter.py)
        from benchmarks.oracle_drafter import OracleDraftRanks

        ranks = OracleDraftRanks(generator.ranks, run.continuation)
    costs = generator.enable_auto_budget() if budget == "auto" else None
    generator.warm_up((params,))
    rates, idle, step_ms, outputs = [], [], [], []
    for _ in range(setup.repeats):
        if events:
            events_of(generator).clear()
        if host_oracle:
            result = generate(ranks, run.prompt, run.new_tokens, spec, Sampler(params))
        else:
            result = generator.generate(run.prompt, run.new_tokens, params, budget=budget)
        rates.append(result.decode_tokens_per_s)
        outputs.append(result.tokens)
        if events:
            gaps, steps = gpu_gaps(generator, device_loop, len(result.accept_lengths) or len(result.tokens))
            idle.append(gaps)
            step_ms.append(steps)
    # a sampled row's tokens are draws (seeded: the repeats agree); only greedy rows must equal the greedy continuation
    reference = (run.continuation or result.tokens) if params.greedy else None
    row = {"model": run.name, "mode": mode, "drafter": drafter, "temperature": params.temperature,
           "top_p": params.top_p, "tokens_per_s": statistics.median(rates),
           "mean_accept_length": result.mean_accept_length or 1.0, "prefill_ms": result.prefill_seconds * 1e3,
           "gpu_idle_us_per_step": statistics.median(idle) if idle else None,
           "step_ms": statistics.median(step_ms) if step_ms and step_ms[0] is not None else None,
           "tokens": len(result.tokens), "tokens_list": result.tokens,
           "repeats_agree": all(o == outputs[0] for o in outputs),
           "tokens_equal_to_autoregressive": None if reference is None else first_difference(result.tokens, reference),
           "mode_printed": generator.mode(params, budget=budget), "ranks": generator.rank_description}  # fmt: skip
    if len(spec.budgets) > 1 and not autoregressive:
        row["budgets_chosen"] = {str(b): result.budgets.count(b) for b in sorted(set(result.budgets))}
        row["measured_step_ms"] = {str(b): c * 1e3 for b, c in costs.items()} if costs else None
    generator.ranks.close()
    if device_loop and not autoregressive and events and budget != "auto":
        row["phase_ms"] = phase_split(run, setup, spec, oracle, budget)
    print(f"{run.name}{run.label}: {mode:30s} {drafter:6s} {row['tokens_per_s']:8.1f} tokens/s, accept "
          f"{row['mean_accept_length']:.2f}, GPU idle {row['gpu_idle_us_per_step']} us/step, step {row['step_ms']} ms, "
          f"phases {row.get('phase_ms')}, equal to AR for {row['tokens_equal_to_autoregressive']}/{row['tokens']}",
          flush=True)  # fmt: skip
    return row


def batch_row(run: ModelRun, setup: Setup, mode: str, drafter: str, spec: SpecConfig, batch: int,
              budget: str | None = None, env: dict | None = None) -> dict:  # fmt: skip
    """`batch` copies of the request at once, in-flight batched on the device loop (`--max_batch_size`): a
    warm-up batch, then `setup.repeats` timed ones (the median); tokens/s = every request's tokens after its first
    over the batch's decode time (the wall time less the admissions, which all run before the first step; each
    repeat's decode time and its steps' own times, `Batcher.timings`, are recorded too). budget
    "auto": a spec with several budgets, every step's choice made by the batch's policy (`StepBudgetPolicy`, which
    may take an autoregressive step), its costs measured at warm-up as `--ddtree_budget auto` does; the row records
    the policy's choices and step times (`StepBudgetPolicy.summary`: the policy outlives the batches, so these are
    over the warm-up batch and the timed ones). env: environment switches set while the ranks are made (the
    batch's `DDTREE_LAZY_CONTEXT`, `DDTREE_CONTEXT_BLOCKS`, ...); the row records the batch's `lazy_context` and
    `context_rows`."""
    autoregressive = mode.startswith("autoregressive")
    oracle = torch.tensor(run.continuation) if drafter == "oracle" else None
    probes = Probes(oracle=oracle, context_rows=run.context_rows)
    with mock.patch.dict(os.environ, env or {}):  # read as each rank's batch is made, before any step
        generator = preset_ranks(run.weights, setup, spec, True, autoregressive, probes, run.limits,
                                 max_batch_size=batch)  # fmt: skip
    prompts, params = [run.prompt] * batch, [run.params] * batch
    if budget == "auto":
        generator.enable_auto_budget()
        generator.warm_up((run.params,))  # each batched step's graph and cost (`Generator.measure_batch_costs`)
    generator.generate_many(prompts, run.new_tokens, params)  # warm-up (every slot count's graph)
    rates, outputs, decode, stepped = [], [], [], []
    for _ in range(setup.repeats):
        timings: dict = {}
        started = time.perf_counter()
        results = generator.generate_many(prompts, run.new_tokens, params, timings=timings)
        wall = time.perf_counter() - started
        # every request is admitted (prefilled) before the steps, together where they fit one admission: the
        # admissions' own time (each request's prefill time is its admission's, shared by those admitted with it)
        first = sum(generator.last_batcher.admitted_seconds.values())
        decode.append(wall - first)
        stepped.append(sum(sum(t) for t in timings.values()))  # the steps' own times (`Batcher.timings`)
        rates.append(sum(len(r.tokens) - 1 for r in results) / decode[-1])
        outputs.append([r.tokens for r in results])
    reference = run.continuation if run.params.greedy else None
    equal = None if reference is None else min(first_difference(t, reference) for t in outputs[-1])
    rate = statistics.median(rates)
    row = {"model": run.name, "mode": mode, "drafter": drafter, "batch": batch, "tokens_per_s": rate,
           "per_request_tokens_per_s": rate / batch, "decode_seconds": decode, "steps_seconds": stepped,
           "mean_accept_length": statistics.mean(a for r in results for a in r.accept_lengths) if not autoregressive
           else 1.0, "tokens": run.new_tokens, "tokens_equal_to_autoregressive": equal,
           "repeats_agree": all(o == outputs[0] for o in outputs), "mode_printed": generator.mode(run.params),
           "lazy_context": generator.ranks.lead.batch.lazy_context,
           "context_rows": generator.ranks.lead.batch.context_rows,
           "ranks": generator.rank_description}  # fmt: skip
    if budget == "auto":  # {slots: {"steps": {budget: steps}, "ms": {...}}}, budget 0: autoregressive steps
        row["batch_policy"] = generator.last_batcher.batch_policy.summary()
    generator.ranks.close()
    print(f"{run.name}{run.label}: {mode:30s} {drafter:6s} batch {batch:2d}: {row['tokens_per_s']:8.1f} tokens/s "
          f"together, accept {row['mean_accept_length']:.2f}, equal to AR for {equal}/{run.new_tokens}"
          + (f", the policy's steps (budget 0: autoregressive) {row['batch_policy']}" if budget == "auto" else ""),
          flush=True)  # fmt: skip
    return row


def events_of(generator) -> list:
    lead = generator.ranks.lead
    return lead.loop.events if lead.loop is not None else lead.session.events


def gpu_gaps(generator, device_loop: bool, steps: int) -> tuple[float, float | None]:
    """(GPU idle between graphs in us a step, median step graph time in ms or None) of the last request."""
    torch.cuda.synchronize()
    lead = generator.ranks.lead
    if not device_loop:
        return sum(lead.session.host_gaps()) / max(steps, 1) * 1e6, None
    marks = lead.loop.events
    idle = statistics.median(a[-1].elapsed_time(b[0]) for a, b in zip(marks, marks[1:])) * 1e3
    return idle, statistics.median(m[0].elapsed_time(m[-1]) for m in marks)


def phase_split(run: ModelRun, setup: Setup, spec: SpecConfig, oracle, budget: int | None = None) -> dict:
    """Milliseconds per phase (median over the steps of one request) with one graph per phase."""
    probes = Probes(oracle=oracle, split_phases=True, record_events=True, context_rows=run.context_rows)
    generator = preset_ranks(run.weights, setup, spec, True, probes=probes, limits=run.limits)
    generator.warm_up((run.params,))
    events_of(generator).clear()
    generator.generate(run.prompt, run.new_tokens, run.params, budget=budget)
    torch.cuda.synchronize()
    marks = events_of(generator)
    split = {name: statistics.median(m[i].elapsed_time(m[i + 1]) for m in marks) for i, name in enumerate(PHASES)}
    generator.ranks.close()
    return split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--e2e-only", action="store_true", help="skip the layer-cost table")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens a request (default 256; smoke 24)")
    parser.add_argument("--temperatures", default="0", help="comma-separated; each above 0 adds sampled device-loop "
                        "rows (seed 7) next to the greedy ones")  # fmt: skip
    parser.add_argument("--top-p", default="1", help="comma-separated: the sampled rows' top-p values (each with every "
                        "temperature above 0)")  # fmt: skip
    add_setup_args(parser)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        parser.error(f"--models must name models of {MODELS}, got {args.models!r}")
    setup = Setup.from_args(args)
    sampled = tuple(SamplingParams(float(t), top_p=float(p), seed=7) for t in args.temperatures.split(",") if float(t)
                    for p in args.top_p.split(","))  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ceilings = measure_ceilings(setup.smoke)
    print(f"ceilings: copy {ceilings['copy_Bps'] / 1e9:.0f} GB/s, bf16 {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")
    info = {**environment(setup.smoke), "ceilings": ceilings, "command": " ".join(sys.argv)}

    def save(e2e_rows: list[dict]) -> None:
        info.update(seconds=time.time() - started, end_to_end=e2e_rows)
        (args.out_dir / "gpu_runtime.json").write_text(json.dumps(info, indent=1))

    with torch.no_grad():
        costs = [] if args.e2e_only else layer_costs(ceilings, setup)
        info["layer_costs"] = costs
        e2e = end_to_end(setup, models, args.new_tokens or (24 if setup.smoke else 256), save, sampled)
    save(e2e)
    if costs:
        print("\n| layer | S | T | layer (us) | attention (us) | MLP (us) | MB moved | floor (us) | layer/floor "
              "| distinct experts |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for r in costs:
            print(f"| {r['layer']} | {r['S']} | {r['T']} | {r['layer_us']:.1f} | {r['attention_us']:.1f} | "
                  f"{r['mlp_us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {r['ratio']:.2f} | "
                  f"{r['distinct_experts'] if r['distinct_experts'] is not None else '-'} |")  # fmt: skip
    print("\n| model | temperature | mode | drafter | decode tokens/s | speedup | accept length | GPU idle us/step | "
          "step ms |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in e2e:
        split = r.get("phase_ms") or r.get("step_ms")
        gap = r.get("gpu_idle_us_per_step")
        print(f"| {r['model']} | {r['temperature']:g} | {r['mode']} | {r['drafter']} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['mean_accept_length']:.2f} | {gap if gap is None else round(gap, 1)} | "
              f"{split} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
