#!/usr/bin/env bash
# smoke of batched + auto on the GPU, then issue 16's GPU rows
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DDTREE_COMMIT=${DDTREE_COMMIT:-}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  mpirun --version | head -1
} > "$OUT/env.txt" 2>&1
el start
{
  python3 -m builder.demo_checkpoints /tmp/hf --force >/dev/null
  python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 1 \
    --output_dir /tmp/e1 --max_input_len 64 --max_seq_len 512 --no_tensorrt --no_onnx --extra_budgets 8,16 --force 2>&1 | tail -1
  P="--input_text Hello --input_text The_quick_brown_fox --input_text One_two --input_text Once_upon_a"
  RUN="-m runner --engine_dir /tmp/e1 --backend torch --max_output_len 40 $P"
  timeout 120 mpirun -np 1 python3 $RUN --loop device --max_batch_size 4 --ddtree_budget auto --output_json /tmp/g_auto_b4.json 2>&1 | tail -4
  timeout 120 mpirun -np 1 python3 $RUN --loop device --max_batch_size 4 --output_json /tmp/g_32_b4.json 2>&1 | tail -2
  timeout 120 mpirun -np 1 python3 $RUN --ddtree_budget auto --output_json /tmp/g_auto_b1.json 2>&1 | tail -2
  CUDA_VISIBLE_DEVICES= timeout 120 mpirun -np 1 python3 $RUN --autoregressive --output_json /tmp/c_ar.json 2>&1 | tail -1
  python3 - <<'PY'
import json, pathlib
load = lambda n: [r["output_ids"] for r in json.loads(pathlib.Path(f"/tmp/{n}.json").read_text())["results"]]
ref = load("c_ar")
for n in ("g_auto_b4", "g_32_b4", "g_auto_b1"):
    try:
        print(n, "== CPU autoregressive:", load(n) == ref)
    except Exception as e:
        print(n, "missing", e)
PY
} > "$OUT/smoke.log" 2>&1
cat "$OUT/smoke.log" | tail -20; el smoke done
mkdir -p "$OUT/acc"
timeout 170 python3 benchmarks/acceptance.py "$OUT/acc" --device cuda --prompts 48 --modes chain ddtree8 ddtree16 ddtree32 auto \
  > "$OUT/acceptance_auto.log" 2>&1; echo "acceptance rc=$?"; tail -16 "$OUT/acceptance_auto.log"; el acc done
mkdir -p "$OUT/budget"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/kimi_rank_int4.py "$OUT/budget" --contexts 1024 --auto-budget \
  > "$OUT/kimi_rank_budget.log" 2>&1; echo "budget rc=$?"; tail -22 "$OUT/kimi_rank_budget.log"; el budget done
