#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DDTREE_COMMIT=${DDTREE_COMMIT:-}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LIMIT=${LIMIT:-540}
mkdir -p "$OUT/long" "$OUT/profile_131072"
timeout $(( LIMIT - 150 )) python3 benchmarks/kimi_rank_int4.py "$OUT/long" --synthetic-context --contexts 131072,32768 --repeats 1 \
  > "$OUT/kimi_rank_long.log" 2>&1; echo "long rc=$?"; tail -20 "$OUT/kimi_rank_long.log"; el long done
timeout $(( LIMIT - ($(date +%s) - T0) )) python3 benchmarks/profile_forward.py "$OUT/profile_131072" --cache-length 131072 \
  > "$OUT/profile_131072.log" 2>&1; echo "profile rc=$?"; grep "^target T=\|attention (" "$OUT/profile_131072.log"; el profile done
