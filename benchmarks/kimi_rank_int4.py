"""A whole Kimi K2.x TP-8 rank with its INT4 experts, on one GPU: memory, then end to end at long context.

    PYTHONPATH=. python3 benchmarks/kimi_rank_int4.py OUT_DIR [--contexts 1024,32768] [--new-tokens 128]
        [--long-repeats 1]
    PYTHONPATH=. python3 benchmarks/kimi_rank_int4.py OUT_DIR --smoke      (tiny shapes on the CPU: checks the script)

The "kimi-rank-int4" preset (`models/presets.py`): 61 layers, the dense first layer and 60 MoE layers with the rank's
slice of all 384 experts kept INT4 (W4A16, groups of 32) and run by the W4A16 kernel, per-rank MLA (8 heads), the
vocab-parallel head's shard, and the DFlash drafter's rank share, built in memory through the rank factory with
random weights (no files), ranks built for a 131072-token sequence (the latent cache of every layer). Reported:
the bytes of the weights and of the caches, and peak GPU memory. Then, for each context length (a random prompt of
that many tokens, prefilled for real; with --synthetic-context, random cached rows and then a --prompt-token prompt):
autoregressive decoding vs DFlash chain vs DDTree 8/16/32 (--preset kimi-rank: the same rank with kimi-rank's dense
MLPs, which read a token's expert bytes but not a verify's spread over experts: the attention and the cache as the
INT4 rank's, on a GPU of 80 GB), with the random
drafter and with an oracle drafter (probes: every stage runs, then the logits follow the autoregressive
continuation), on the device loop; decode tokens/s (median of --repeats), mean acceptance, the per-phase split and
the verify-to-decode cost ratio. --auto-budget adds, per drafter, an engine spec with budgets 8, 16 and 32 on the
device loop: `auto` (costs measured on the device loop first, as `--ddtree_budget auto` does; the budgets the steps
took are recorded) and budget 8 on that engine (its own graph: what a narrow step of a several-budget engine costs).
--batches 4,8 adds rows of that many copies of the request in-flight batched (`--max_batch_size`; autoregressive,
DDTree 8 and 32, and `auto`, whose batch policy may take autoregressive steps): tokens/s of the
batch together, speed-up against one autoregressive request (the ranks are then built for the context and the request,
not 131072 tokens: each slot holds caches for the whole sequence). One GPU holds one rank: no all-reduce in these
numbers. Writes OUT_DIR/kimi_rank_int4.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import Setup, add_setup_args, environment
from benchmarks.gpu_runtime import SPEC_MODES, ModelRun, batch_row, request_row
from engines.spec import BuildConfig, SpecConfig
from models.parallel import SingleRank
from runner.factory import PresetWeights, RankOptions, model_ops, rank_device

SEQUENCE = 131072
BATCH_MODES = ("autoregressive", "ddtree 8", "ddtree 32", "auto", "auto eager")  # the --batches rows (default)
# and a row taken only by name: `auto` with a block of pending rows at most (`DDTREE_CONTEXT_BLOCKS=1`)
MORE_BATCH_MODES = ("auto one block",)


def batch_modes(names: str, drafters: str) -> list[tuple]:
    """The --batches rows among BATCH_MODES (`names`, comma-separated, in that order: a run stopped at its time limit
    has the first), each speculative one for every drafter: (mode, drafter, spec, budget, environment switches).
    `auto`: the batch's policy chooses each step among budgets 8/16/32 and an autoregressive step, whose drafter rows
    stay pending (`BatchLoop.lazy_context`, the default) up to `BatchLoop.context_rows`; "auto eager": with each such
    step committing its row; "auto one block": pending up to a block (`DDTREE_CONTEXT_BLOCKS=1`)."""
    several, rows = SpecConfig(8, 32, extra_budgets=(8, 16)), []
    for name in names.split(","):
        if name == "autoregressive":
            rows.append(("autoregressive (device loop)", "-", SpecConfig(8, 32), None, {}))
            continue
        for drafter in drafters.split(","):
            if name.startswith("ddtree"):
                budget = int(name.split()[1])
                rows.append((f"ddtree {budget} (device loop)", drafter, SpecConfig(8, budget), None, {}))
            else:
                env, suffix = {"auto eager": ({"DDTREE_LAZY_CONTEXT": "0"}, ", eager context"),
                               "auto one block": ({"DDTREE_CONTEXT_BLOCKS": "1"}, ", one block of context")}.get(
                                   name, ({}, ""))  # fmt: skip
                rows.append((f"ddtree auto of 8/16/32 (device loop){suffix}", drafter, several, "auto", env))
    return rows


def module_bytes(module) -> int:
    """Bytes of the storages behind the module's parameters and buffers, each once (a fused GEMM's stacked weight and
    the per-projection views of it are one storage)."""
    storages = {}
    for t in list(module.parameters()) + list(module.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--contexts", default=None, help="prompt lengths (default 1024,32768; smoke 40,100)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens a request (default 128; smoke 16)")
    parser.add_argument(
        "--long-repeats",
        type=int,
        default=1,
        help="timed requests a row at contexts over 4096 tokens (each prefills the whole prompt)",
    )
    parser.add_argument("--synthetic-context", action="store_true", help="a context longer than --prompt is that "
                        "many cached rows of random K/V and then a prompt of --prompt tokens, not one long prefill "
                        "(runner/probes.py: the steps cost the same; their tokens continue nothing real)")  # fmt: skip
    parser.add_argument("--prompt", type=int, default=1024, help="the real prompt's tokens with --synthetic-context")
    parser.add_argument("--auto-budget", action="store_true", help="add rows of an engine with budgets 8/16/32 "
                        "(a device-loop graph each): auto, and budget 8 on it")  # fmt: skip
    parser.add_argument(
        "--batches",
        default="",
        help="comma-separated batch sizes: rows of that many copies of the request in-flight batched "
        "(autoregressive, DDTree 8 and 32, and auto of 8/16/32, whose policy may take autoregressive steps; random and "
        "oracle drafters)",
    )
    parser.add_argument("--batch-modes", default=",".join(BATCH_MODES),
                        help="the --batches rows, comma-separated (default: all but 'auto one block'; 'auto eager': "
                             "auto with each autoregressive step committing its drafter row, DDTREE_LAZY_CONTEXT=0; "
                             "'auto one block': a block of them pending at most, DDTREE_CONTEXT_BLOCKS=1)")  # fmt: skip
    parser.add_argument("--drafters", default="random,oracle", help="the drafters of the speculative rows")
    parser.add_argument("--modes", default=",".join(m for m, _ in SPEC_MODES),
                        help="the fixed-budget rows, comma-separated (default: every one of them)")  # fmt: skip
    parser.add_argument("--preset", default="kimi-rank-int4", choices=["kimi-rank-int4", "kimi-rank"],
                        help="the rank: with its INT4 experts (default; 98.8 GB at its peak on one H200), or with "
                             "kimi-rank's bf16 MLPs of a token's expert bytes (for a GPU of 80 GB)")  # fmt: skip
    parser.add_argument("--no-fixed", action="store_true", help="skip the fixed-budget rows (chain, DDTree 8/16/32): "
                        "the autoregressive row, then only what --auto-budget and --batches add")  # fmt: skip
    add_setup_args(parser)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.batch_modes.split(",")) - set(BATCH_MODES + MORE_BATCH_MODES))
    if unknown:
        parser.error(f"--batch-modes: expected names among {list(BATCH_MODES + MORE_BATCH_MODES)}, got {unknown}")
    fixed_modes = args.modes.split(",")
    unknown = sorted(set(fixed_modes) - {m for m, _ in SPEC_MODES})
    if unknown:
        parser.error(f"--modes: expected names among {[m for m, _ in SPEC_MODES]}, got {unknown}")
    setup = Setup.from_args(args)
    contexts = [int(c) for c in (args.contexts or ("40,100" if setup.smoke else "1024,32768")).split(",")]
    new_tokens = args.new_tokens or (16 if setup.smoke else 128)
    sequence = 512 if setup.smoke else SEQUENCE
    prompt_cap = min(args.prompt, max(contexts)) if args.synthetic_context else max(contexts)
    if args.synthetic_context:  # the cache holds the synthetic rows, the prompt, the request and the steps' spare rows
        sequence = max(sequence, max(contexts) + new_tokens + 64)
    if args.batches and not setup.smoke:  # every slot holds caches for the whole sequence: sized for the request, as
        sequence = max(contexts) + new_tokens + 64  # a server sizes max_seq_len for its batch (128k x 8 slots: 74 GB)
    limits = BuildConfig(max_input_len=prompt_cap, max_seq_len=sequence)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    info = {**environment(setup.smoke), "command": " ".join(sys.argv), "preset": args.preset, "sequence": sequence,
            "rows": []}  # fmt: skip

    def save() -> None:
        info["seconds"] = round(time.time() - started, 1)
        (args.out_dir / "kimi_rank_int4.json").write_text(json.dumps(info, indent=1) + "\n")

    weights = PresetWeights(args.preset, setup.dtype, seed=3, smoke=setup.smoke)
    target_cfg, _ = weights.rank_configs(0)
    shard = target_cfg.vocab_size // target_cfg.mapping.tp_size
    with torch.no_grad():
        for context in contexts:
            synthetic = max(0, context - args.prompt) if args.synthetic_context else 0
            length = context - synthetic
            prompt = torch.randint(0, shard - 2, (length,), generator=torch.Generator().manual_seed(0)).tolist()
            run = ModelRun(args.preset, weights, prompt, new_tokens, limits=limits, context_rows=synthetic)
            long_prefill = context - synthetic > 4096  # each timed request prefills it again
            row_setup = replace(setup, repeats=args.long_repeats) if long_prefill else setup
            ar = request_row(run, row_setup, "autoregressive (device loop)", "-", SpecConfig(8, 32), device_loop=True)
            run.continuation = ar.pop("tokens_list")
            if "memory" not in info:  # the first ranks built: weights, caches and the peak so far
                # the modules the ranks were built with (PresetWeights keeps them by rank, device and forms)
                device = rank_device(RankOptions("torch", setup.device.type), 0)  # the factory's own (cuda:0)
                lead = weights.models(0, model_ops(device, SingleRank(), target_cfg, setup.dtype), device)
                cache = sequence * target_cfg.num_hidden_layers * target_cfg.latent_dim * setup.dtype.itemsize
                info["memory"] = {
                    "target_weight_bytes": module_bytes(lead[0]), "drafter_weight_bytes": module_bytes(lead[1]),
                    "latent_cache_bytes": cache if not setup.smoke else None,
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if not setup.smoke else None,
                    "device_total_bytes": torch.cuda.get_device_properties(0).total_memory if not setup.smoke else None,
                }  # fmt: skip
                print("memory", info["memory"], flush=True)
            decode_ms = ar.get("step_ms") or (1e3 / ar["tokens_per_s"] if ar["tokens_per_s"] else None)
            modes = [] if args.no_fixed else [(m, s, None) for m, s in SPEC_MODES if m in fixed_modes]
            if args.auto_budget:
                several = SpecConfig(8, 32, extra_budgets=(8, 16))
                modes += [("ddtree auto of 8/16/32", several, "auto"), ("ddtree 8 of 8/16/32", several, 8)]
            for drafter, mode, spec, budget in [("-", None, None, None)] + [
                (d, m, s, b) for d in args.drafters.split(",") for m, s, b in modes
            ]:
                if mode is None:
                    row = ar
                else:
                    row = request_row(run, row_setup, f"{mode} (device loop)", drafter, spec, True, budget)
                    row.pop("tokens_list", None)
                row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
                verify = (row.get("phase_ms") or {}).get("verify")
                row["verify_over_decode"] = verify / decode_ms if verify and decode_ms else None
                info["rows"].append({**row, "context": context, "synthetic_rows": synthetic})
                if not setup.smoke:
                    info["memory"]["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                save()  # after every row: a run cut short keeps what it measured
            for batch in [int(b) for b in args.batches.split(",") if b]:
                # `auto`: the batch's policy chooses each step, among budgets 8/16/32 and an autoregressive step
                for mode, drafter, spec, budget, env in batch_modes(args.batch_modes, args.drafters):
                    row = batch_row(run, row_setup, mode, drafter, spec, batch, budget, env=env)
                    row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
                    info["rows"].append({**row, "context": context, "synthetic_rows": synthetic})
                    save()
    print("\n| context | mode | drafter | decode tokens/s | speed-up | accept | draft / tree / verify / accept (ms) "
          "| verify / decode |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in info["rows"]:
        phases = r.get("phase_ms")
        split = " / ".join(f"{phases[p]:.2f}" for p in ("draft", "tree", "verify", "accept")) if phases else "-"
        ratio = f"{r['verify_over_decode']:.2f}" if r.get("verify_over_decode") else "-"
        mode = r["mode"] + (f", batch {r['batch']}" if r.get("batch") else "")
        print(f"| {r['context']} | {mode} | {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['mean_accept_length']:.2f} | {split} | {ratio} |")  # fmt: skip
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
