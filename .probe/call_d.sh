#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DDTREE_COMMIT=${DDTREE_COMMIT:-}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LIMIT=${LIMIT:-585}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
mkdir -p "$OUT/budget" "$OUT/acc" "$OUT/batch"
timeout 330 python3 benchmarks/kimi_rank_int4.py "$OUT/budget" --contexts 1024 --auto-budget --repeats 2 \
  > "$OUT/kimi_rank_budget.log" 2>&1; echo "budget rc=$?"; tail -16 "$OUT/kimi_rank_budget.log"; el budget done
timeout 90 python3 benchmarks/acceptance.py "$OUT/acc" --device cuda --prompts 32 --modes ddtree8 ddtree16 ddtree32 auto \
  > "$OUT/acceptance_auto.log" 2>&1; echo "acceptance rc=$?"; tail -11 "$OUT/acceptance_auto.log"; el acc done
timeout $(( LIMIT - ($(date +%s) - T0) )) python3 benchmarks/kimi_rank_int4.py "$OUT/batch" --contexts 1024 --no-fixed \
  --batches 4,8 --repeats 2 > "$OUT/kimi_rank_batch.log" 2>&1; echo "batch rc=$?"; tail -12 "$OUT/kimi_rank_batch.log"; el batch done
