#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md, from the source tree with the machine's python3 (PYTHONPATH=.). Results under
# $OUT (default out/gpu). STEPS picks what runs (default: all):
#   tiny      the tiny demo through the CLI on the GPU (device loop) == the same run on the CPU; TP-2 == TP-1 (2 GPUs)
#   lossless  benchmarks/gpu_lossless.py: float32 greedy speculative == autoregressive, host and device loops
#   longlossless  the same over $LOSSLESS_ROWS (default 131072) seeded random cached rows (--context-rows: the long
#             cache's kernel paths), device loop, preset $LOSSLESS_PRESET (default moe; kimi-rank: its 61 layers)
#   cli       benchmarks/cli_vs_inprocess.py: the CLI's decode tokens/s next to the in-process rows (TP-1; TP-2 too
#             on two GPUs)
#   e2e       benchmarks/gpu_runtime.py --e2e-only: every mode on the moe, dense and kimi-rank presets
#   layers    benchmarks/gpu_runtime.py's layer-cost table as well
#   kernel    benchmarks/tree_attention_gpu.py
#   keysmajor tree_attention_gpu.py --keys-major-only: the keys-major forms (wgmma with few query rows, by pointers
#             and by tensor descriptors) beside the default at T = 1, 8, 33 over 32k and 128k, each checked first
#   combine   tree_attention_gpu.py --combine-only: the merge of the splits' partial results at decode shapes (columns a
#             program, splits loaded at a time, fewer splits), each form checked against the reference, then timed
#   int4      benchmarks/int4_moe_gpu.py: the W4A16 MoE kernel at Kimi TP-8 rank dimensions against its byte floor,
#             torch._grouped_mm in bf16 and dequantize-then-grouped-GEMM; and the packed tiny model through the CLI
#             on the GPU == the same on the CPU
#   int4load  benchmarks/int4_load_probe.py: which load shape reads one token's 8 experts' INT4 words at the copy rate
#   acceptance benchmarks/acceptance.py: the trained pair, every mode, greedy and temperature 1.0, device loop
#   rank      benchmarks/kimi_rank_int4.py: a whole Kimi K2.x TP-8 rank with INT4 experts (memory, 1k and 32k context)
#   sampling  benchmarks/sampling_lossless_gpu.py: chi-square tests of sampled DDTree on the device loop (16 processes)
#   sampler   benchmarks/sampling_speed.py (the sampler alone) and gpu_runtime.py's kimi-rank rows greedy against
#             temperature 1 with top-p 0.95
#   peer      benchmarks/flashmla_peer.py: FlashMLA built from .peers/flashmla (a copy of ../shared/peers/flashmla in
#             an ignored folder, carried with the call) and timed next to TreeAttention
#   profile   benchmarks/profile_forward.py: the kimi-rank forward's kernels and gaps
#   overlap   profile_forward.py --compare-overlap: the target forward with its side-stream branches (models/streams.py),
#             with the MoE's alone and on one stream, outputs compared; kimi-rank-int4 where the GPU holds it
#             (> 120 GB), else the moe and kimi-rank presets
#   budget    kimi_rank_int4.py --auto-budget $BUDGET_FLAGS at 1k context: an engine with budgets 8/16/32 (a graph each),
#             auto and budget 8 on it, next to the fixed-budget rows
#   batch     in-flight batching: 'concurrency' (benchmarks/concurrency.py --device cuda --no-triton: the trained pair
#             through the CLI, 1 to 16 requests) and 'rankbatch' (kimi_rank_int4.py --batches $BATCHES, default 4,8, at
#             1k context: the whole rank, random and oracle drafters; `auto` too, its batch policy free to take
#             autoregressive steps)
#   smoke     the tiny demo through the CLI on the GPU with several budgets (8/16/32): auto and budget 32, one request
#             and four in-flight batched (auto also with DDTREE_LAZY_CONTEXT=0), each == the CPU's autoregressive tokens
#   triton    benchmarks/concurrency.py --device cuda with the Triton rows: the CLI and a real tritonserver, unpacked
#             from $TRITON_BUNDLE (`python -m runner.serving.triton_bundle pack --python 3.12 B.tar.xz` on a machine
#             with a package index; the archive travels with the tree) into a venv over this machine's python3
#   serving   benchmarks/serving_overhead.py --device cuda: the same requests through the runner's serving pipe and
#             through tritonserver (from $TRITON_BUNDLE, as 'triton'), side by side: what the server's path adds
#   policy    benchmarks/batch_policy.py: CLI jobs of 16 requests in-flight batched, in the order $ORDER (default
#             ar,auto,8 three times: autoregressive, auto and budget 8 interleaved; NAME+eager: each autoregressive
#             step committing its drafter row (the default leaves it pending); NAME+group: admissions shared under a
#             backlog; NAME+profile: a lone admission on the prefill profile, not as a group of one; NAME+serial: no
#             step queued before the last one's tokens are read; NAME+ahead: an `auto` batch's steps queued ahead
#             too), each mode's median; $POLICY_FLAGS added (--requests 64 --slots 16: a steady load)
#   timeline  benchmarks/batch_timeline.py: in-process jobs of 64 requests through 16 slots ($TIMELINE_MODES, default
#             ar,8,8+profile: +profile, a lone admission on the prefill profile; +serial, no step queued ahead) with
#             CUDA events around the batch's
#             calls: GPU time in steps and admissions, idle time between; $TIMELINE_FLAGS added (--profile-steps: the
#             kernels of each job's full-batch steps)
#   autoacc   benchmarks/acceptance.py on the trained pair with auto next to every fixed budget (greedy and
#             temperature 1.0, device loop; budget 16, the best there, twice: the run-to-run noise)
#   flush     benchmarks/l2_flush_probe.py: the floor-bound kernels (INT4 MoE, TreeAttention, a load and a copy) after
#             the L2 was left dirty, clean or unflushed, and a call's time in a sequence over other data (as a forward)
#   token     the INT4 experts' CUDA C kernels (plugins/int4_moe/token_cuda.py: one token, a block of tokens): the GPU
#             tests against the reference and their algorithm, int4_token_probe.py's launch shapes, int4_moe_gpu.py at
#             T = 1, 8, 16, 33 (the Triton forms beside), and on a GPU that holds the whole rank (> 120 GB) the
#             kimi-rank-int4 forwards with each form
#   plugins   benchmarks/plugin_enqueue_gpu.py under mpirun on every GPU: the TensorRT plugins' enqueue bodies without
#             TensorRT (TreeAttention, the collectives, Int4MoE in both word layouts, timed on rank 0)
#   long      long context without long prefills: kimi_rank_int4.py --synthetic-context at 32k and 128k (random cached
#             rows, then a 1024-token prompt), and the forward's profile over 32k and 128k cached rows (attention's share):
#             the INT4 rank where the GPU holds it (> 120 GB), else kimi-rank; LONG_MODES the fixed-budget rows (default: all;
#             'ddtree 32': the autoregressive and DDTree 32 rows)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
OUT=${OUT:-out/gpu}
POLICY_FLAGS=${POLICY_FLAGS:-}
TIMELINE_FLAGS=${TIMELINE_FLAGS:-}
export DDTREE_COMMIT=${DDTREE_COMMIT:-}  # recorded in the result files: DDTREE_COMMIT=$(git rev-parse --short HEAD)
STEPS=${STEPS:-tiny lossless cli e2e}
# DEADLINE (seconds from the start, optional): every step after it is skipped, and a step's Python run is stopped
# at it (its result file keeps the rows measured so far)
T0=$(date +%s)
left() { if [ -n "${DEADLINE:-}" ]; then echo $(( DEADLINE - ($(date +%s) - T0) )); else echo 100000; fi; }
limit() {  # limit [SECONDS] COMMAND...: run it until the deadline (or SECONDS, the sooner)
  local s; s=$(left)
  if [[ "$1" =~ ^[0-9]+$ ]]; then [ "$1" -lt "$s" ] && s=$1; shift; fi
  [ "$s" -gt 10 ] || { echo "skipped: deadline"; return 124; }
  timeout "$s" "$@"
}
mkdir -p "$OUT"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  mpirun --version | head -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
has() { [[ " $STEPS " == *" $1 "* ]] && [ "$(left)" -gt 10 ]; }

if has smoke; then
  {
    python3 -m builder.demo_checkpoints /tmp/hf --force >/dev/null
    python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 1 \
      --output_dir /tmp/es --max_input_len 64 --max_seq_len 512 --no_tensorrt --no_onnx --extra_budgets 8,16 --force \
      2>&1 | tail -1
    P="--input_text Hello --input_text The_quick_brown_fox --input_text One_two --input_text Once_upon_a"
    RUN="-m runner --engine_dir /tmp/es --backend torch --max_output_len 40 $P"
    limit 150 mpirun -np 1 python3 $RUN --max_batch_size 4 --ddtree_budget auto --output_json /tmp/s_auto_b4.json 2>&1 | tail -3
    limit 150 mpirun -np 1 python3 $RUN --max_batch_size 4 --output_json /tmp/s_32_b4.json 2>&1 | tail -2
    limit 150 mpirun -np 1 python3 $RUN --ddtree_budget auto --output_json /tmp/s_auto_b1.json 2>&1 | tail -2
    # the batch's autoregressive steps committing their rows at once (`BatchLoop.lazy_context` off), its graphs
    limit 150 env DDTREE_LAZY_CONTEXT=0 mpirun -np 1 python3 $RUN --max_batch_size 4 --ddtree_budget auto \
      --output_json /tmp/s_auto_b4_eager.json 2>&1 | tail -2
    limit 150 env CUDA_VISIBLE_DEVICES= mpirun -np 1 python3 $RUN --autoregressive --output_json /tmp/s_cpu_ar.json 2>&1 | tail -1
    python3 - <<'PY'
import json, pathlib
load = lambda n: [r["output_ids"] for r in json.loads(pathlib.Path(f"/tmp/{n}.json").read_text())["results"]]
ref = load("s_cpu_ar")
for name in ("s_auto_b4", "s_32_b4", "s_auto_b1", "s_auto_b4_eager"):
    try:
        print(f"smoke {name} (GPU device loop) == CPU autoregressive:", load(name) == ref)
    except Exception as error:  # a run that failed wrote nothing
        print(f"smoke {name}: no result ({error})")
PY
  } > "$OUT/smoke.log" 2>&1
  cat "$OUT/smoke.log"
fi
if has policy; then
  mkdir -p "$OUT/policy"
  limit python3 benchmarks/batch_policy.py "$OUT/policy" --order "${ORDER:-ar,auto,8,ar,auto,8,ar,auto,8}" $POLICY_FLAGS \
    > "$OUT/batch_policy.log" 2>&1
  echo "policy rc=$?"; tail -30 "$OUT/batch_policy.log"
fi
if has timeline; then
  mkdir -p "$OUT/timeline"
  limit python3 benchmarks/batch_timeline.py "$OUT/timeline" --modes "${TIMELINE_MODES:-ar,8,8+profile}" $TIMELINE_FLAGS \
    > "$OUT/batch_timeline.log" 2>&1
  echo "timeline rc=$?"; tail -8 "$OUT/batch_timeline.log"; rm -rf "$OUT/timeline/engine" "$OUT/timeline/hf"
fi
if has autoacc; then
  mkdir -p "$OUT/autoacc"
  limit python3 benchmarks/acceptance.py "$OUT/autoacc" --device cuda --prompts "${AUTOACC_PROMPTS:-48}" \
    --modes ${AUTOACC_MODES:-autoregressive chain ddtree4 ddtree8 ddtree16 ddtree16#2 ddtree32 auto} \
    > "$OUT/acceptance_auto.log" 2>&1
  echo "autoacc rc=$?"; tail -40 "$OUT/acceptance_auto.log"
fi
if has tiny; then
  {
    python3 -m builder.demo_checkpoints /tmp/hf --force >/dev/null
    ARGS="--max_input_len 64 --max_seq_len 512 --no_tensorrt --force"
    python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 1 --output_dir /tmp/e1 $ARGS 2>&1 | tail -1
    RUN="-m runner --backend torch --max_output_len 48 --input_text Hello --input_text The_quick_brown_fox"
    mpirun -np 1 python3 $RUN --engine_dir /tmp/e1 --output_json /tmp/tiny_gpu_tp1.json 2>&1 | grep -v "^---" | head -8
    CUDA_VISIBLE_DEVICES= mpirun -np 1 python3 $RUN --engine_dir /tmp/e1 --output_json /tmp/tiny_cpu_tp1.json 2>&1 | grep "^mode"
    mpirun -np 1 python3 $RUN --engine_dir /tmp/e1 --loop host --output_json /tmp/tiny_gpu_host.json 2>&1 | grep "^mode"
    if [ "$GPUS" -ge 2 ]; then
      python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 2 --output_dir /tmp/e2 $ARGS 2>&1 | tail -1
      mpirun -np 2 python3 $RUN --engine_dir /tmp/e2 --output_json /tmp/tiny_gpu_tp2.json 2>&1 | grep "^mode"
    fi
    python3 - <<'PY'
import json, pathlib
load = lambda name: [r["output_ids"] for r in json.loads(pathlib.Path(f"/tmp/{name}.json").read_text())["results"]]
gpu = load("tiny_gpu_tp1")
print("tiny greedy, GPU device loop == CPU host loop:", gpu == load("tiny_cpu_tp1"))
print("tiny greedy, GPU host loop == GPU device loop:", load("tiny_gpu_host") == gpu)
if pathlib.Path("/tmp/tiny_gpu_tp2.json").exists():
    print("tiny greedy, TP-2 (NCCL, 2 GPUs) == TP-1 (1 GPU):", load("tiny_gpu_tp2") == gpu)
PY
  } > "$OUT/tiny.log" 2>&1
  cat "$OUT/tiny.log"
fi
if has int4load; then
  limit python3 benchmarks/int4_load_probe.py "$OUT" > "$OUT/int4_load_probe.log" 2>&1; echo "int4load rc=$?"
  grep "^best\|shapes, correct" "$OUT/int4_load_probe.log"
fi
if has acceptance; then
  python3 benchmarks/acceptance.py "$OUT" --device cuda > "$OUT/acceptance.log" 2>&1; echo "acceptance rc=$?"
  tail -16 "$OUT/acceptance.log"
fi
if has rank; then
  python3 benchmarks/kimi_rank_int4.py "$OUT" > "$OUT/kimi_rank_int4.log" 2>&1; echo "rank rc=$?"
  tail -22 "$OUT/kimi_rank_int4.log"
fi
if has sampling; then
  python3 benchmarks/sampling_lossless_gpu.py "$OUT" --workers 4 --parallel_samples 4 --seconds "${SAMPLING_SECONDS:-300}" \
    > "$OUT/sampling_lossless_gpu.log" 2>&1; echo "sampling rc=$?"
  tail -6 "$OUT/sampling_lossless_gpu.log"
fi
if has lossless; then
  python3 benchmarks/gpu_lossless.py "$OUT" > "$OUT/gpu_lossless.log" 2>&1; echo "lossless rc=$?"
  tail -9 "$OUT/gpu_lossless.log"
fi
if has longlossless; then
  for S in ${LOSSLESS_ROWS:-131072}; do
    limit python3 benchmarks/gpu_lossless.py "$OUT/lossless_$S" --preset "${LOSSLESS_PRESET:-moe}" --context-rows "$S" \
      > "$OUT/gpu_lossless_$S.log" 2>&1; echo "longlossless $S rc=$?"; tail -5 "$OUT/gpu_lossless_$S.log"
  done
fi
if has cli; then
  TP=1; [ "$GPUS" -ge 2 ] && TP=1,2
  python3 benchmarks/cli_vs_inprocess.py "$OUT" --tp $TP > "$OUT/cli_vs_inprocess.log" 2>&1; echo "cli rc=$?"
  tail -6 "$OUT/cli_vs_inprocess.log"
fi
if has e2e || has layers; then
  FLAGS=$(has layers || echo --e2e-only)
  python3 benchmarks/gpu_runtime.py "$OUT" $FLAGS > "$OUT/gpu_runtime.log" 2>&1; echo "runtime rc=$?"
  tail -50 "$OUT/gpu_runtime.log"
fi
if has sampler; then
  python3 benchmarks/sampling_speed.py "$OUT" > "$OUT/sampling_speed.log" 2>&1; echo "sampler rc=$?"
  tail -8 "$OUT/sampling_speed.log"
  python3 benchmarks/gpu_runtime.py "$OUT" --e2e-only --models kimi-rank --temperatures 0,1 --top-p 0.95 \
    > "$OUT/gpu_runtime_sampled.log" 2>&1; echo "sampled rows rc=$?"
  tail -21 "$OUT/gpu_runtime_sampled.log"
fi
if has peer; then
  python3 .peers/flashmla/build_dense.py > "$OUT/flashmla_build.log" 2>&1; echo "flashmla build rc=$?"  # it builds in its folder
  PYTHONPATH=.peers/flashmla:. python3 benchmarks/flashmla_peer.py "$OUT" > "$OUT/flashmla_peer.log" 2>&1
  echo "peer rc=$?"; tail -11 "$OUT/flashmla_peer.log"
fi
if has profile; then
  python3 benchmarks/profile_forward.py "$OUT" > "$OUT/profile_forward.log" 2>&1; echo "profile rc=$?"
  grep -A14 "^target T=1:" "$OUT/profile_forward.log"
fi
if has overlap; then
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  MODELS="moe kimi-rank"; [ "$MEM" -gt 120000 ] && MODELS="kimi-rank-int4 moe"
  for M in $MODELS; do
    mkdir -p "$OUT/overlap_$M"
    limit 300 python3 benchmarks/profile_forward.py "$OUT/overlap_$M" --model "$M" --cache-length 1024 --compare-overlap \
      > "$OUT/overlap_$M.log" 2>&1; echo "overlap $M rc=$?"
    grep -E "^target|moe only|one stream \(|moe and mla" "$OUT/overlap_$M.log"
  done
fi
if has flush; then
  limit python3 benchmarks/l2_flush_probe.py "$OUT" > "$OUT/l2_flush_probe.log" 2>&1; echo "flush rc=$?"
  tail -12 "$OUT/l2_flush_probe.log"
fi
if has budget; then
  mkdir -p "$OUT/budget"
  limit python3 benchmarks/kimi_rank_int4.py "$OUT/budget" --contexts 1024 --auto-budget --repeats "${REPEATS:-3}" ${BUDGET_FLAGS:-} \
    > "$OUT/kimi_rank_budget.log" 2>&1
  echo "budget rc=$?"; tail -14 "$OUT/kimi_rank_budget.log"
fi
if has concurrency || has batch; then
  mkdir -p "$OUT/batch"
  limit python3 benchmarks/concurrency.py "$OUT/batch" --device cuda --no-triton ${CONC_FLAGS:-} > "$OUT/concurrency.log" 2>&1
  echo "concurrency rc=$?"; tail -24 "$OUT/concurrency.log"
fi
if has triton; then
  rm -rf /tmp/ddtree-triton-venv && mkdir -p "$OUT/triton"
  if python3 -m runner.serving.triton_bundle unpack "${TRITON_BUNDLE:?TRITON_BUNDLE: the packed tritonserver}" \
      /tmp/ddtree-triton-venv; then
    DDTREE_TRITON_VENV=/tmp/ddtree-triton-venv limit python3 benchmarks/concurrency.py "$OUT/triton" --device cuda \
      ${CONC_FLAGS:-} > "$OUT/concurrency_triton.log" 2>&1
    echo "triton rc=$?"; tail -30 "$OUT/concurrency_triton.log"
  fi
fi
if has serving; then
  rm -rf /tmp/ddtree-triton-venv && mkdir -p "$OUT/serving"
  if python3 -m runner.serving.triton_bundle unpack "${TRITON_BUNDLE:?TRITON_BUNDLE: the packed tritonserver}" \
      /tmp/ddtree-triton-venv; then
    DDTREE_TRITON_VENV=/tmp/ddtree-triton-venv limit python3 benchmarks/serving_overhead.py "$OUT/serving" \
      --device cuda ${SERVING_FLAGS:-} > "$OUT/serving_overhead.log" 2>&1
    echo "serving rc=$?"; tail -8 "$OUT/serving_overhead.log"
  fi
fi
if has rankbatch || has batch; then
  mkdir -p "$OUT/batch"
  limit python3 benchmarks/kimi_rank_int4.py "$OUT/batch" --contexts 1024 --no-fixed --batches "${BATCHES:-4,8}" \
    --repeats "${REPEATS:-3}" > "$OUT/kimi_rank_batch.log" 2>&1
  echo "rankbatch rc=$?"; tail -14 "$OUT/kimi_rank_batch.log"
fi
if has long; then
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  MODEL=kimi-rank; [ "$MEM" -gt 120000 ] && MODEL=kimi-rank-int4  # the INT4 rank where the GPU holds it
  limit python3 benchmarks/kimi_rank_int4.py "$OUT" --preset $MODEL --synthetic-context --contexts 32768,131072 \
    --repeats "${REPEATS:-3}" --modes "${LONG_MODES:-dflash chain,ddtree 8,ddtree 16,ddtree 32}" \
    > "$OUT/kimi_rank_long.log" 2>&1; echo "long rc=$?"; tail -20 "$OUT/kimi_rank_long.log"
  for S in 131072 32768; do  # the longest first: a deadline cuts the shorter
    mkdir -p "$OUT/profile_$S"
    limit python3 benchmarks/profile_forward.py "$OUT/profile_$S" --model $MODEL --cache-length $S --targets 1,33 \
      > "$OUT/profile_$S.log" 2>&1
    echo "profile $S rc=$?"; grep "^target T=\|attention (" "$OUT/profile_$S.log"
  done
fi
if has token; then
  {
    python3 -m pytest -q -p no:cacheprovider tests/test_int4_moe.py -k "cuda_token or cuda_block" --tb=short 2>&1 | tail -40
    python3 benchmarks/int4_token_probe.py "$OUT"
    python3 benchmarks/int4_moe_gpu.py "$OUT" --tokens 1,8,16,33 --repeats 5
  } > "$OUT/token.log" 2>&1; echo "token rc=$?"
  grep -E "passed|failed|error|Error" "$OUT/token.log" | head -5
  grep '"routing"' "$OUT/token.log" | python3 -c 'import json,sys; [print({k: round(v, 1) if isinstance(v, float) else v for k, v in json.loads(l).items() if k.endswith("_us") or k in ("routing", "tokens", "kernel_relative_error")}) for l in sys.stdin]'
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$MEM" -gt 120000 ]; then
    mkdir -p "$OUT/token_rank"
    limit 400 python3 benchmarks/profile_forward.py "$OUT/token_rank" --model kimi-rank-int4 --cache-length 1024 \
      --compare-int4-kernels > "$OUT/token_rank.log" 2>&1; echo "token rank rc=$?"
    grep -E "^target T=|INT4 (token|block)_kernel" "$OUT/token_rank.log"
  fi
fi
if has plugins; then
  limit 300 mpirun -np "$GPUS" python3 benchmarks/plugin_enqueue_gpu.py --out "$OUT" > "$OUT/plugin_enqueue.log" 2>&1
  echo "plugins rc=$?"; tail -4 "$OUT/plugin_enqueue.log" | cut -c1-2000
fi
if has kernel; then
  python3 benchmarks/tree_attention_gpu.py "$OUT" > "$OUT/kernel.log" 2>&1; echo "kernel rc=$?"
  tail -30 "$OUT/kernel.log"
fi
if has keysmajor; then
  limit 480 python3 benchmarks/tree_attention_gpu.py "$OUT/keysmajor" --keys-major-only > "$OUT/keysmajor.log" 2>&1
  echo "keysmajor rc=$?"; grep -E "ceilings|variant" "$OUT/keysmajor.log" | cut -c1-220
fi
if has combine; then
  limit 300 python3 benchmarks/tree_attention_gpu.py "$OUT/combine" --combine-only > "$OUT/combine.log" 2>&1
  echo "combine rc=$?"; grep -E "ceilings|variant" "$OUT/combine.log" | cut -c1-200
fi
if has int4; then
  {
    python3 -m builder.demo_checkpoints /tmp/hf --int4 --force >/dev/null
    python3 -m builder.demo_checkpoints /tmp/hf --force >/dev/null
    ARGS="--max_input_len 64 --max_seq_len 512 --no_tensorrt --force"
    python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny-int4 --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 1 --output_dir /tmp/e4 $ARGS 2>&1 | tail -1
    RUN="-m runner --backend torch --max_output_len 48 --input_text Hello --input_text The_quick_brown_fox --engine_dir /tmp/e4"
    mpirun -np 1 python3 $RUN --output_json /tmp/int4_gpu.json 2>&1 | grep -E "^(mode|startup|torch)"
    CUDA_VISIBLE_DEVICES= mpirun -np 1 python3 $RUN --output_json /tmp/int4_cpu.json 2>&1 | grep "^mode"
    python3 - <<'PY'
import json, pathlib
load = lambda name: [r["output_ids"] for r in json.loads(pathlib.Path(f"/tmp/{name}.json").read_text())["results"]]
print("packed INT4 tiny greedy, GPU (W4A16 kernel, device loop) == CPU (reference):", load("int4_gpu") == load("int4_cpu"))
PY
    python3 benchmarks/int4_moe_gpu.py "$OUT" --profile
  } > "$OUT/int4.log" 2>&1; echo "int4 rc=$?"
  tail -12 "$OUT/int4.log"
fi
