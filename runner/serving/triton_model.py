"""Triton Inference Server Python-backend model (decoupled, streaming) that owns the `mpirun -np N` runner job.

Copied as `<repository>/<model>/1/model.py` by `python -m runner.serving.triton_repo`. Runs inside Triton's Python stub,
so it uses only the standard library and numpy; the engines run in the MPI job (the project's own environment),
which speaks JSON lines over its stdin/stdout (`runner/serving/serve.py`).

Tensor names follow TensorRT-LLM's Triton backend: text_input, max_tokens, temperature, top_k, top_p, seed,
end_id, pad_id, stream, exclude_input_in_output, stop_words, bad_words -> text_output, plus accept_length; a chat
comes as `messages` (a JSON list of {role, content}, rendered with the checkpoint's chat template; `thinking`: the
template's switch) instead of text_input. `ddtree_budget` (a string: "auto" or one of the engine's tree budgets)
chooses this request's budget.
Requests are queued, at most `max_queue` (a parameter of config.pbtxt) at once; one more gets a "busy" error at
once. The runner serves them one at a time, or with `max_batch_size` > 1 (torch backend) up to that many together:
each joins the batch at the next step after its prefill and leaves when done (in-flight batching). A request whose
client goes away (Triton marks it cancelled) is cancelled in the runner too, queued or running, so it does not hold
up the requests behind it. A malformed request gets its own error response; if the runner dies, every request that
has streamed output gets an error, the runner is started again, and the others (queued, or not streamed) go to it
once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

READY_TIMEOUT_S = 1800.0  # for a repository without the `ready_timeout_s` parameter (triton_repo's default)
# The runner job is local to the server's node: MPI may use shared memory and loopback only, so no rank listens on an
# external interface (UCX for MPICH's ch4:ucx and Open MPI's pml/ucx; Open MPI's own TCP paths on loopback).
LOCAL_ONLY = {"UCX_TLS": "self,sm", "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo"}
CANCEL_POLL_S = 0.25  # how often queued and running requests are checked for a client that went away


class RunnerJob:
    """The mpirun job: a pipe to rank 0's stdin, a thread reading its stdout."""

    def __init__(self, command: list[str], env: dict, log_path: str, on_event, on_exit):
        self.log = open(log_path, "a")  # noqa: SIM115 (kept open for the job's lifetime)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        self.ready = threading.Event()
        self.info: dict = {}
        self.on_event, self.on_exit = on_event, on_exit
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "ready":
                self.info = event
                self.ready.set()
            else:
                self.on_event(event)
        code = self.process.wait()
        self.ready.set()
        self.on_exit(self, code)

    def send(self, request: dict) -> None:
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()

    def stop(self, timeout: float = 15.0) -> None:
        try:
            self.process.stdin.close()  # end of input: every rank stops
            self.process.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got {value.size}")
    value = value[0]
    return value.decode() if isinstance(value, bytes) else value.item()


def _words(request, name) -> list[str]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [w.decode() if isinstance(w, bytes) else str(w) for w in tensor.as_numpy().reshape(-1) if w]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: model_transaction_policy { decoupled: true }")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.command = [
            params["mpirun"],
            "-np",
            params["tp_size"],
            params["python"],
            "-m",
            "runner",
            "--serve",
            "--engine_dir",
            params["engine_dir"],
            "--backend",
            params["backend"],
            "--serve_parent_pid",
            str(os.getppid()),  # the server: a job whose server has crashed ends at once
        ]
        batch = params.get("max_batch_size", "1")
        if batch != "1":  # in-flight batching: the runner steps up to this many requests together (device loop)
            self.command += ["--max_batch_size", batch, "--loop", "device"]
        if params.get("autoregressive") == "true":  # the baseline: no drafter
            self.command.append("--autoregressive")
        self.env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONHOME", "PYTHONPATH")}
        self.env.update(
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PATH=os.path.dirname(params["python"]) + ":/usr/local/bin:/usr/bin:/bin",
            **LOCAL_ONLY,
        )
        self.log_path = params.get("runner_log", "/tmp/ddtree-runner.log")
        self.max_queue = int(params.get("max_queue", "64"))
        self.ready_timeout_s = float(params.get("ready_timeout_s", READY_TIMEOUT_S))
        self.pending: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.shutting_down = False
        self.job = None
        self._start_job()
        threading.Thread(target=self._watch_cancellations, daemon=True).start()

    def _watch_cancellations(self):
        while not self.shutting_down:
            time.sleep(CANCEL_POLL_S)
            # asked under the lock, so only of requests still pending: every final response is sent after its
            # request left `pending` under this lock, and is_cancelled on a sender whose final response has gone
            # reads a freed response factory (tritonserver 2.51 crashed with SIGSEGV there, under load)
            with self.lock:
                cancelled = [request_id for request_id, entry in self.pending.items() if entry["sender"].is_cancelled()]
            for request_id in cancelled:
                self._cancel(request_id)

    def _cancel(self, request_id: str):
        with self.lock:
            entry = self.pending.pop(request_id, None)
        if entry is None:
            return
        try:
            self.job.send({"cancel": request_id})
        except (OSError, AttributeError):
            pass  # the runner is gone: nothing runs the request any more
        self._respond(entry, error="cancelled: the client went away")

    def _start_job(self):
        job = RunnerJob(self.command, self.env, self.log_path, self._on_event, self._on_exit)
        if not job.ready.wait(self.ready_timeout_s):
            job.stop()
            raise pb_utils.TritonModelException(
                f"the runner was not ready within ready_timeout_s = {self.ready_timeout_s:g} s (its warm-up; with an "
                f"empty kernel cache a GPU's takes minutes: write the repository with a larger --ready_timeout_s); "
                f"see {self.log_path}"
            )
        if not job.info:
            code = job.process.wait()
            job.stop()
            raise pb_utils.TritonModelException(f"the runner exited with code {code} before it was ready; see "
                                                f"{self.log_path}")  # fmt: skip
        self.job = job
        pb_utils.Logger.log_info(f"ddtree runner ready: {job.info}")

    def _respond(self, entry, text=None, accept=None, error=None, final=False):
        sender = entry["sender"]
        if error is not None:
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(error)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
            return
        if text is None:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        outputs = [
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("accept_length", np.array(accept or [], dtype=np.int32)),
        ]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)

    def _on_event(self, event):
        with self.lock:
            entry = self.pending.get(event.get("id"))
            if entry is None:
                return
            entry["started"] = True  # output has gone to the client: a runner crash from now on fails it
            if event["event"] != "tokens":
                del self.pending[event["id"]]
        if event["event"] == "error":
            self._respond(entry, error=event["error"])
        elif event["event"] == "cancelled":
            self._respond(entry, error="cancelled")
        elif event["event"] == "tokens" and entry["stream"] and (event["text"] or event["accept_length"]):
            self._respond(entry, text=event["text"], accept=[event["accept_length"]])
        elif event["event"] == "done":
            if entry["stream"]:
                self._respond(entry, final=True)
            else:
                prefix = "" if entry["exclude_input"] else event["prompt_text"]
                self._respond(entry, text=prefix + event["text"], accept=event["accept_lengths"], final=True)

    def _on_exit(self, job, code):
        """Requests that have streamed output fail; the rest (no output yet, not sent before) go to the new runner."""
        restart = not self.shutting_down and job is self.job
        with self.lock:
            orphans, self.pending = self.pending, {}
        queued = {i: e for i, e in orphans.items() if restart and not e["started"] and not e["resent"]}
        for request_id, entry in orphans.items():
            if request_id not in queued:
                self._respond(entry, error=f"the ddtree runner exited (code {code}) during this request")
        if not restart:
            return
        pb_utils.Logger.log_warn(f"ddtree runner exited with code {code}; restarting it")
        time.sleep(1.0)
        try:
            self._start_job()
        except pb_utils.TritonModelException as err:
            pb_utils.Logger.log_error(str(err))
            for entry in queued.values():
                self._respond(entry, error=f"the ddtree runner exited (code {code}) and did not restart")
            return
        for request_id, entry in queued.items():
            entry["resent"] = True
            with self.lock:
                self.pending[request_id] = entry
            self.job.send(entry["payload"])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                max_tokens = _scalar(request, "max_tokens")
                if max_tokens is None:
                    raise ValueError("max_tokens is required")
                payload = {
                    "id": uuid.uuid4().hex,
                    "max_tokens": int(max_tokens),
                    "seed": int(_scalar(request, "seed", 0)),
                    "stop_words": _words(request, "stop_words"),
                    "bad_words": _words(request, "bad_words"),
                }
                # what the client left out stays out: the runner applies generation_config.json's defaults
                for name, kind in (("text_input", str), ("temperature", float), ("top_k", int), ("top_p", float),
                                   ("end_id", int), ("thinking", bool), ("ddtree_budget", str)):  # fmt: skip
                    value = _scalar(request, name)
                    if value is not None:
                        payload[name] = kind(value)
                messages = _scalar(request, "messages")
                if messages is not None:
                    payload["messages"] = json.loads(messages)  # a JSON list of {role, content}
                stream = bool(_scalar(request, "stream", False))
                payload["stream"] = stream  # not streamed: the runner sends the done event alone (no text a step)
                exclude = bool(_scalar(request, "exclude_input_in_output", False))
            except (ValueError, TypeError) as err:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad request: {err}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            entry = {"sender": sender, "stream": stream, "exclude_input": exclude, "payload": payload,
                     "started": False, "resent": False}  # fmt: skip
            with self.lock:
                busy = len(self.pending) >= self.max_queue
                if not busy:
                    self.pending[payload["id"]] = entry
            if busy:  # a bounded queue: a client learns at once instead of waiting behind every queued request
                self._respond(entry, error=f"busy: {self.max_queue} requests are queued or running "
                                           f"(max_queue={self.max_queue}); retry later")  # fmt: skip
                continue
            try:
                self.job.send(payload)
            except (OSError, AttributeError) as err:
                with self.lock:
                    self.pending.pop(payload["id"], None)
                self._respond(entry, error=f"the ddtree runner is not available: {err}")
        return None

    def finalize(self):
        self.shutting_down = True
        if self.job is not None:
            self.job.stop()
