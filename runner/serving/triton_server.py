"""Starts the tritonserver bundled in `nvidia-pytriton` (Triton 2.51, Python backend) on a model repository.

    python -m runner.serving.triton_server --triton_venv .venv-triton --model_repository REPO [--http_port 8000]

The wheel's binaries need three fixes to run from a venv (reference/ecosystem.md, section 6.3): a backend folder
holding the Python backend and the stub matching the venv's Python; LD_LIBRARY_PATH with the interpreter's own
libpython first, then the bundled libraries; and the venv's bin first on PATH so the stub finds numpy.
Loopback addresses only. The server runs in its own process group so `stop_server` ends everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def venv_paths(venv: Path) -> dict:
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no Python in the Triton venv {venv} (make it with `make triton-venv`)")
    script = (
        "import json, sys, sysconfig; print(json.dumps({'purelib': sysconfig.get_paths()['purelib'], "
        "'version': f'{sys.version_info[0]}.{sys.version_info[1]}', 'libdir': sysconfig.get_config_var('LIBDIR')}))"
    )
    return json.loads(subprocess.check_output([str(python), "-c", script], text=True))


def start_server(
    triton_venv: Path, repository: Path, work: Path, http_port: int, grpc_port: int, metrics_port: int, log_path: Path
) -> subprocess.Popen:
    paths = venv_paths(Path(triton_venv))
    site = Path(paths["purelib"])
    server = site / "pytriton" / "tritonserver"
    if not (server / "bin" / "tritonserver").exists():
        raise FileNotFoundError(f"{triton_venv} has no pytriton tritonserver (pip install nvidia-pytriton==0.7.0)")
    backend = Path(work) / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for file in (
        server / "backends/python/libtriton_python.so",
        server / "backends/python/triton_python_backend_utils.py",
        server / f"python_backend_stubs/{paths['version']}/triton_python_backend_stub",
    ):
        shutil.copy2(file, backend / file.name)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(
        filter(None, [paths["libdir"], str(site / "nvidia_pytriton.libs"), os.environ.get("LD_LIBRARY_PATH")])
    )
    env["PATH"] = f"{Path(triton_venv).resolve() / 'bin'}:{env.get('PATH', '')}"
    command = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={Path(work).resolve() / 'backends'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        "--exit-timeout-secs=30",  # longer than a model's finalize (its runner job: 15 s, then killed)
        "--log-verbose=0",
    ]
    log = open(log_path, "w")  # noqa: SIM115 (the server writes to it until it stops)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(process: subprocess.Popen, http_port: int, log_path: Path, timeout: float | None = 300.0) -> None:
    """Returns once the server answers ready; raises when it exits first (a model's load failed) or after `timeout`
    seconds (None: as long as it runs; each model's own wait for its runner, `ready_timeout_s`, bounds its load)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s:\n{_tail(log_path)}")


def stop_server(process: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (Triton unloads the model, which stops the MPI job), then SIGKILL to the whole group if needed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.serving.triton_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--triton_venv", type=Path, default=Path(".venv-triton"))
    parser.add_argument("--model_repository", type=Path, required=True)
    parser.add_argument("--http_port", type=int, default=8000)
    parser.add_argument("--grpc_port", type=int, default=8001)
    parser.add_argument("--metrics_port", type=int, default=8002)
    parser.add_argument("--work_dir", type=Path, default=Path("out/triton"))
    parser.add_argument("--wait_s", type=float, default=None,
                        help="seconds to wait for the models to load (default: while the server runs; each model's "
                        "own wait for its runner's warm-up is the repository's ready_timeout_s)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.wait_s is not None and not args.wait_s > 0:
        parser.error(f"--wait_s: expected seconds > 0 (or leave it out: wait while the server runs), got {args.wait_s}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    log = args.work_dir / "tritonserver.log"
    process = start_server(
        args.triton_venv, args.model_repository, args.work_dir, args.http_port, args.grpc_port, args.metrics_port, log
    )
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        print(f"tritonserver started (pid {process.pid}); its models load while their runners warm up (minutes on a "
              f"GPU with an empty kernel cache); log {log}", flush=True)  # fmt: skip
        wait_ready(process, args.http_port, log, args.wait_s)
        print(
            f"tritonserver ready (pid {process.pid}): http://127.0.0.1:{args.http_port}/v2/models "
            f"grpc 127.0.0.1:{args.grpc_port}; log {log}; Ctrl-C stops it",
            flush=True,
        )
        process.wait()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as err:  # a model's load failed, or --wait_s passed: the log's tail says why
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        stop_server(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
