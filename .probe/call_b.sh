#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DDTREE_COMMIT=${DDTREE_COMMIT:-}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
mkdir -p "$OUT/batch"
timeout 250 python3 benchmarks/kimi_rank_int4.py "$OUT/batch" --contexts 1024 --no-fixed --batches 4,8 --repeats 2 \
  > "$OUT/kimi_rank_batch.log" 2>&1; echo "batch rc=$?"; tail -14 "$OUT/kimi_rank_batch.log"; el batch done
mkdir -p "$OUT/conc"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/concurrency.py "$OUT/conc" --device cuda --no-triton \
  > "$OUT/concurrency.log" 2>&1; echo "concurrency rc=$?"; tail -26 "$OUT/concurrency.log"; el conc done
rm -rf "$OUT/conc/engine" "$OUT/conc/hf"
