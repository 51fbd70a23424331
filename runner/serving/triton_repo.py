"""Writes a Triton model repository that serves an engine directory.

    python -m runner.serving.triton_repo --engine_dir ENGINE_DIR --output_dir REPO [--model_name ddtree] [--backend ort]

REPO/<model_name>/config.pbtxt + REPO/<model_name>/1/model.py (the Python-backend model in `triton_model.py`).
The model starts `mpirun -np <tp_size>` with this environment's Python and MPI launcher, so tritonserver itself may
run from another environment (nvidia-pytriton pins numpy < 2). The job runs on the server's node only: with MPICH the
launcher is `mpiexec.gforker` (it forks the ranks and talks to them over pipes: hydra's `mpirun` listens on every
interface), and the model keeps MPI's transports to shared memory and loopback (`triton_model.LOCAL_ONLY`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from engines.engine_dir import load_engine_dir

# Seconds the model waits for the runner's warm-up (its CUDA graphs; on a GPU with an empty kernel cache also every
# kernel's compilation, minutes) before its load fails; a runner that exits first fails it at once.
READY_TIMEOUT_S = 1800.0

CONFIG = """name: "{name}"
backend: "python"
# Triton sends each request on its own (max_batch_size 0); the runner batches: up to the "max_batch_size" parameter
# below step together on the torch backend's device loop (in-flight batching), the rest wait in its queue (the
# engines' profiles are one sequence: max_batch_size={engine_batch} at build time).
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] optional: true }},
  {{ name: "messages" data_type: TYPE_STRING dims: [ 1 ] optional: true }},
  {{ name: "thinking" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "ddtree_budget" data_type: TYPE_STRING dims: [ 1 ] optional: true }},
  {{ name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true }},
  {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "pad_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }},
  {{ name: "bad_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "accept_length" data_type: TYPE_INT32 dims: [ -1 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "engine_dir" value: {{ string_value: "{engine_dir}" }} }}
parameters {{ key: "tp_size" value: {{ string_value: "{tp_size}" }} }}
parameters {{ key: "backend" value: {{ string_value: "{backend}" }} }}
parameters {{ key: "max_input_len" value: {{ string_value: "{max_input_len}" }} }}
parameters {{ key: "max_seq_len" value: {{ string_value: "{max_seq_len}" }} }}
parameters {{ key: "python" value: {{ string_value: "{python}" }} }}
parameters {{ key: "mpirun" value: {{ string_value: "{mpirun}" }} }}
parameters {{ key: "runner_log" value: {{ string_value: "{runner_log}" }} }}
parameters {{ key: "max_queue" value: {{ string_value: "{max_queue}" }} }}
parameters {{ key: "max_batch_size" value: {{ string_value: "{max_batch_size}" }} }}
parameters {{ key: "autoregressive" value: {{ string_value: "{autoregressive}" }} }}
parameters {{ key: "ready_timeout_s" value: {{ string_value: "{ready_timeout_s}" }} }}
"""


def write_repository(engine_dir: Path, output_dir: Path, model_name: str = "ddtree", backend: str = "ort",
                     force: bool = False, max_queue: int = 64, max_batch_size: int = 1,
                     autoregressive: bool = False, ready_timeout_s: float = READY_TIMEOUT_S) -> Path:  # fmt: skip
    """max_queue: requests queued or running at once; one more gets a "busy" error at once. max_batch_size: requests
    the runner steps together (in-flight batching on the torch backend's device loop; 1: one at a time).
    autoregressive: the runner decodes without the drafter (the baseline, as the CLI's --autoregressive).
    ready_timeout_s: how long the model waits for the runner's warm-up before its load fails."""
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if not ready_timeout_s > 0:
        raise ValueError(f"ready_timeout_s must be > 0 seconds, got {ready_timeout_s}")
    if max_batch_size < 1 or (max_batch_size > 1 and backend != "torch"):
        raise ValueError(f"max_batch_size must be >= 1, and 1 unless the backend is torch (batched steps run on its "
                         f"device loop); got {max_batch_size} with backend {backend}")  # fmt: skip
    from engines.output_dir import staged_output_dir

    engine = load_engine_dir(engine_dir)
    engine.check_files(backend)
    python = Path(sys.executable)
    mpirun = python.parent / "mpiexec.gforker"  # MPICH's local launcher: no listening socket
    if not mpirun.exists():
        mpirun = python.parent / "mpirun"
    if not mpirun.exists():
        mpirun = Path(shutil.which("mpirun") or "mpirun")
    with staged_output_dir(output_dir, force) as staging:
        _write_model(staging / model_name, engine, model_name, backend, python, mpirun, output_dir, max_queue,
                     max_batch_size, autoregressive, ready_timeout_s)  # fmt: skip
    return output_dir / model_name


def _write_model(model_dir: Path, engine, model_name: str, backend: str, python: Path, mpirun: Path,
                 output_dir: Path, max_queue: int, max_batch_size: int, autoregressive: bool,
                 ready_timeout_s: float) -> None:  # fmt: skip
    (model_dir / "1").mkdir(parents=True)
    build = engine.build_config
    (model_dir / "config.pbtxt").write_text(
        CONFIG.format(
            name=model_name,
            engine_dir=engine.path.resolve(),
            tp_size=engine.tp_size,
            backend=backend,
            engine_batch=build.max_batch_size,
            max_input_len=build.max_input_len,
            max_seq_len=build.max_seq_len,
            python=python,
            mpirun=mpirun,
            runner_log=(output_dir / f"{model_name}-runner.log").resolve(),
            max_queue=max_queue,
            max_batch_size=max_batch_size,
            autoregressive=str(autoregressive).lower(),
            ready_timeout_s=ready_timeout_s,
        )
    )
    shutil.copy2(Path(__file__).with_name("triton_model.py"), model_dir / "1" / "model.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.serving.triton_repo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine_dir", type=Path, required=True)
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--model_name", default="ddtree")
    parser.add_argument("--backend", choices=["trt", "ort", "torch"], default="ort")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--max_queue", type=int, default=64, help="requests queued or running at once (then: busy)")
    parser.add_argument("--max_batch_size", type=int, default=1, help="requests stepped together (in-flight batching; "
                        "torch backend)")  # fmt: skip
    parser.add_argument("--autoregressive", action="store_true", help="the baseline: no drafter, a token a step")
    parser.add_argument("--ready_timeout_s", type=float, default=READY_TIMEOUT_S,
                        help="seconds the model waits for the runner's warm-up (minutes on a GPU with an empty kernel "
                        "cache)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        path = write_repository(args.engine_dir, args.output_dir, args.model_name, args.backend, args.force,
                                args.max_queue, args.max_batch_size, args.autoregressive,
                                args.ready_timeout_s)  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
