#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export DDTREE_COMMIT=${DDTREE_COMMIT:-}
mkdir -p "$OUT/conc"
timeout ${LIMIT:-270} python3 benchmarks/concurrency.py "$OUT/conc" --device cuda --no-triton > "$OUT/concurrency.log" 2>&1
echo "concurrency rc=$?"; tail -26 "$OUT/concurrency.log"
rm -rf "$OUT/conc/engine" "$OUT/conc/hf" "$OUT"/conc/cli-*.json "$OUT/conc/repo"
