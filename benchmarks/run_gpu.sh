#!/usr/bin/env bash
# One device call: kernel check + timings, runtime cost tables, and the tiny pipeline on the torch backend
# (GPU vs the same run on the CPU; TP-2 over NCCL vs TP-1 when two GPUs are present). Results under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)' | tee -a "$OUT/env.txt"

if [ "${SKIP_KERNEL:-0}" != 1 ]; then
  python3 benchmarks/tree_attention_gpu.py "$OUT/kernel" --variants > "$OUT/kernel.log" 2>&1; echo "kernel rc=$?"
  tail -45 "$OUT/kernel.log"
fi
if [ "${SKIP_RUNTIME:-0}" != 1 ]; then
  python3 benchmarks/gpu_runtime.py "$OUT/runtime" > "$OUT/runtime.log" 2>&1; echo "runtime rc=$?"
  tail -40 "$OUT/runtime.log"
fi

# The tiny demo pipeline with the torch backend (no TensorRT on this machine: --no_tensorrt engine dirs).
{
  python3 -m builder.demo_checkpoints /tmp/hf --force >/dev/null
  ARGS="--max_input_len 64 --max_seq_len 512 --no_tensorrt --force"
  python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 1 --output_dir /tmp/e1 $ARGS 2>&1 | tail -1
  RUN="-m runner --backend torch --max_output_len 48 --input_text Hello --input_text The_quick_brown_fox"
  mpirun -np 1 python3 $RUN --engine_dir /tmp/e1 --output_json "$OUT/tiny_gpu_tp1.json" 2>&1 | tail -2
  CUDA_VISIBLE_DEVICES= mpirun -np 1 python3 $RUN --engine_dir /tmp/e1 --output_json /tmp/tiny_cpu_tp1.json 2>&1 | tail -1
  if [ "$GPUS" -ge 2 ]; then
    python3 -m builder.cli --model_dir /tmp/hf/kimi-k2-tiny --draft_model_dir /tmp/hf/kimi-k2-tiny-dflash --tp_size 2 --output_dir /tmp/e2 $ARGS 2>&1 | tail -1
    mpirun -np 2 python3 $RUN --engine_dir /tmp/e2 --output_json "$OUT/tiny_gpu_tp2.json" 2>&1 | tail -2
  fi
  python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
gpu = json.loads((out / "tiny_gpu_tp1.json").read_text())["results"]
cpu = json.loads(pathlib.Path("/tmp/tiny_cpu_tp1.json").read_text())["results"]
print("tiny greedy, GPU torch backend == CPU torch backend:", [g["output_ids"] == c["output_ids"] for g, c in zip(gpu, cpu)])
tp2 = out / "tiny_gpu_tp2.json"
if tp2.exists():
    two = json.loads(tp2.read_text())["results"]
    print("tiny greedy, TP-2 (NCCL, 2 GPUs) == TP-1 (1 GPU):", [a["output_ids"] == b["output_ids"] for a, b in zip(two, gpu)])
PY
} > "$OUT/tiny.log" 2>&1
cat "$OUT/tiny.log"
