"""Serving mode of the MPI runner: `mpirun -np N python -m runner --serve --engine_dir ...`.

Rank 0 reads one JSON request per line on stdin and writes JSON events, one per line, on stdout; the Triton
model (`runner/serving/triton_model.py`) owns the job and speaks this protocol. Requests are served one at a time, in
arrival order (queued, not batched: the engines run batch 1). A bad request gets an error event and the loop goes
on; end of stdin stops every rank. `{"cancel": "r1"}` cancels a request, queued or running (the Triton model sends it
when its client goes away): a running one stops at its next step and gets a "cancelled" event. A reader thread takes
the input while a request runs, so a cancellation is seen at once.

    request  {"id": "r1", "text_input": "...", "max_tokens": 32, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
              "seed": 0, "end_id": 481, "stop_words": ["..."], "bad_words": ["..."]}
             or "messages": [{"role": "user", "content": "..."}] (+ "thinking": false) instead of text_input;
             sampling settings left out take generation_config.json's (the done event says which); "stream": false
             sends no tokens events (nothing is detokenized a step), only the done event
    events   {"event": "ready", "tp_size": 2, "backend": "ort", ...}
             {"id": "r1", "event": "tokens", "text": "new text", "output_ids": [...], "accept_length": 3}
             {"id": "r1", "event": "done", "text": "all new text", "output_ids": [...], "accept_lengths": [...], ...}
             {"id": "r1", "event": "error", "error": "prompt of 300 tokens is longer than ..."}
             {"id": "r1", "event": "cancelled", "output_ids": [...]}
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

from runner.sampling import SamplingParams
from runner.speculate import check_request
from runner.tokenizer import Detokenizer, encode_prompt

REQUEST_FIELDS = {
    "id",
    "text_input",
    "messages",
    "thinking",
    "max_tokens",
    "ddtree_budget",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "end_id",
    "pad_id",
    "stop_words",
    "bad_words",
    "stream",
}


class Request:
    """One request, validated: `text_input`, or `messages` in the checkpoint's chat template (`thinking`: the
    template's switch); temperature / top_k / top_p not given come from generation_config.json (`defaults`, a
    `runner.chat.GenerationDefaults`), as do the stop ids when `end_id` is not given."""

    def __init__(self, raw: dict, tokenizer, engine, spec, defaults):
        from runner.chat import render_chat

        unknown = sorted(set(raw) - REQUEST_FIELDS)
        if unknown:
            raise ValueError(f"unknown request fields {unknown}")
        if ("text_input" in raw) == ("messages" in raw):
            raise ValueError("a request needs exactly one of text_input and messages")
        if "messages" in raw:
            text = render_chat(tokenizer.config.get("chat_template"), raw["messages"], raw.get("thinking"))
        elif not isinstance(raw["text_input"], str):
            raise ValueError(f"text_input must be a string, got {type(raw['text_input']).__name__}")
        else:
            text = raw["text_input"]
        max_tokens = raw.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {max_tokens!r}")
        self.id = str(raw.get("id", ""))
        build = engine.build_config
        self.prompt = encode_prompt(tokenizer, text, build.max_input_len)
        check_request(len(self.prompt), max_tokens, build.max_input_len, build.max_seq_len, spec.block_size)
        self.max_tokens = max_tokens
        number = lambda name, kind: None if raw.get(name) is None else kind(raw[name])  # noqa: E731
        self.params, self.defaults_applied = defaults.sampling(
            number("temperature", float), number("top_k", int), number("top_p", float), int(raw.get("seed", 0))
        )
        end_id = raw.get("end_id")
        if end_id is None:
            self.end_ids = set(defaults.end_ids)
        else:
            self.end_ids = {int(end_id)} if int(end_id) >= 0 else set()
        self.stop_sequences = tuple(tuple(tokenizer.encode(w)) for w in raw.get("stop_words") or () if w)
        banned = []
        for word in raw.get("bad_words") or ():
            ids = tokenizer.encode(word) if word else []
            if len(ids) > 1:
                raise ValueError(f"bad_words entries must be single tokens; {word!r} is {len(ids)} tokens")
            banned += ids
        self.banned = tuple(banned)
        self.budget = request_budget(raw.get("ddtree_budget"), engine, spec)
        stream = raw.get("stream", True)
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
        self.stream = stream  # false: no tokens events (nothing detokenized a step), the done event alone


def request_budget(value, engine, spec) -> int | str | None:
    """A request's `ddtree_budget`: None (the job's), "auto" (chosen every step among the engine's budgets), or a
    tree budget the engine verifies (an integer, or its digits as a string: Triton sends a string)."""
    if value is None:
        return None
    if value == "auto":
        from runner.budget import require_several

        require_several(spec.budgets, "ddtree_budget")
        return "auto"
    try:
        budget = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        budget = None
    if budget is None or budget < 1 or str(value).strip() != str(budget):
        raise ValueError(f"ddtree_budget must be a tree budget (an integer >= 1) or auto, got {value!r}")
    from engines.spec import verify_profile_name

    verify_profile_name(spec.with_budget(budget), engine.profiles)  # a budget the engine lacks: a clear error
    return budget


PARENT_POLL_S = 0.5


def _end_with(pid: int) -> None:
    """Ends every rank once `pid` has exited: a crashed server's stub holds the job's pipes open for seconds, and the
    job went on with its request, orphaned. MPI's abort takes the other ranks down with rank 0."""
    while _alive(pid):
        time.sleep(PARENT_POLL_S)
    sys.stderr.write(f"the serving process {pid} has ended; ending the runner job\n")
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(3)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie (an ended process its parent has not reaped yet)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


class Events:
    """The job's output, one JSON line an event. Called with an event it writes and flushes it, unless `hold` is on:
    then the events wait for `release`, which writes them in one write and one flush (a batched step's events: one
    a request; 16 tokens events into a pipe took 69 us one by one and 47 us together on a 2-core CPU)."""

    def __init__(self, out):
        self.out = out
        self.held: list[str] | None = None

    def __call__(self, event: dict) -> None:
        line = json.dumps(event) + "\n"
        if self.held is not None:
            self.held.append(line)
            return
        self.out.write(line)
        self.out.flush()

    def hold(self) -> None:
        if self.held is None:
            self.held = []

    def release(self) -> None:
        held, self.held = self.held, None
        if held:
            self.out.write("".join(held))
            self.out.flush()


class RequestCancelled(Exception):
    """Raised from a request's token callback when its client cancelled it: the generation stops there."""


class Inbox:
    """The input lines, read by a thread: requests in arrival order, cancellations applied as soon as they arrive."""

    def __init__(self, inp):
        self.requests: queue.Queue = queue.Queue()
        self.cancelled: set[str] = set()
        threading.Thread(target=self._read, args=(inp,), daemon=True).start()

    def _read(self, inp) -> None:
        for line in inp:
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                raw = None
            if isinstance(raw, dict) and set(raw) == {"cancel"}:
                self.cancelled.add(str(raw["cancel"]))
            else:
                self.requests.put(line)
        self.requests.put(None)  # end of input

    def __iter__(self):
        return iter(self.requests.get, None)


def serve(generator, tokenizer, engine, spec, backend: str, startup: dict | None = None, inp=None, out=None,
          parent_pid: int | None = None) -> None:  # fmt: skip
    """generator: rank 0's `runner.generator.Generator` (it picks the device loop for greedy requests on GPUs).
    parent_pid: the process this job serves (the Triton server); when it is gone, the job ends at once."""
    inp, out = inp or sys.stdin, out or sys.stdout
    if parent_pid is not None:
        threading.Thread(target=_end_with, args=(parent_pid,), daemon=True).start()
    send = Events(out)

    from runner.chat import GenerationDefaults

    target = engine.config["pretrained_config"]["target"]
    defaults = GenerationDefaults.load(engine.tokenizer_dir, target.get("eos_token_id"))
    send(
        {
            "event": "ready",
            "tp_size": engine.tp_size,
            "backend": backend,
            "spec": spec.to_dict(),
            "max_input_len": engine.build_config.max_input_len,
            "max_seq_len": engine.build_config.max_seq_len,
            "mode": generator.mode(),
            "sampled_mode": generator.mode(SamplingParams(1.0)),
            "startup": startup or {},
        }
    )
    inbox = Inbox(inp)
    parse = lambda line: _parse(line, tokenizer, engine, spec, defaults, generator)  # noqa: E731
    if generator.batch_slots > 1:
        return _serve_batched(generator, tokenizer, inbox, parse, send)
    for line in inbox:
        request = parse(line)
        if isinstance(request, dict):  # the request's own error
            send(request)
            continue
        detokenizer = Detokenizer(tokenizer)
        if request.id in inbox.cancelled:  # cancelled while it waited in the queue
            send({"id": request.id, "event": "cancelled", "output_ids": []})
            continue

        def on_tokens(new: list[int], request=request, detokenizer=detokenizer) -> None:
            if request.id in inbox.cancelled:
                raise RequestCancelled(request.id)
            if request.stream:
                send(_tokens_event(request, detokenizer, new))

        try:
            result = generator.generate(
                request.prompt,
                request.max_tokens,
                request.params,
                request.end_ids,
                on_tokens,
                request.stop_sequences,
                request.banned,
                request.budget,
            )
        except RequestCancelled:  # the next request's reset discards any step still in flight, on every rank
            send({"id": request.id, "event": "cancelled", "output_ids": detokenizer.tokens})  # what was streamed
            continue
        _finish(send, generator, tokenizer, request, detokenizer, result)


def _parse(line: str, tokenizer, engine, spec, defaults, generator):
    """A `Request`, or the error event of a line that is not a valid one."""
    request_id = None
    try:
        raw = json.loads(line)
        request_id = raw.get("id") if isinstance(raw, dict) else None
        if not isinstance(raw, dict):
            raise ValueError("a request must be a JSON object")
        request = Request(raw, tokenizer, engine, spec, defaults)
        if request.budget is not None and generator.autoregressive:
            raise ValueError("ddtree_budget: this server decodes autoregressively (--autoregressive)")
    except (ValueError, TypeError) as err:
        return {"id": request_id, "event": "error", "error": str(err)}
    return request


def _tokens_event(request, detokenizer, new: list[int]) -> dict:
    delta = detokenizer.push(new)
    return {"id": request.id, "event": "tokens", "text": delta, "output_ids": new, "accept_length": len(new)}


def _finish(send, generator, tokenizer, request, detokenizer, result) -> None:
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    rest = detokenizer.finish() if request.stream else ""
    if rest:  # text held back for a partial character
        send({"id": request.id, "event": "tokens", "text": rest, "output_ids": [], "accept_length": 0})
    send(
        {
            "id": request.id,
            "event": "done",
            "text": text,
            "prompt_text": tokenizer.decode(request.prompt),
            "output_ids": result.tokens,
            "accept_lengths": result.accept_lengths,
            "target_forwards": result.target_forwards,
            "elapsed": result.elapsed,
            "mode": generator.mode(request.params, request.banned, request.budget),
            "budgets": result.budgets,
            "sampling": {
                "temperature": request.params.temperature,
                "top_k": request.params.top_k,
                "top_p": request.params.top_p,
                "from_generation_config": request.defaults_applied,
            },
        }  # fmt: skip
    )


def _serve_batched(generator, tokenizer, inbox: Inbox, parse, send: Events) -> None:
    """In-flight batching (`--max_batch_size` > 1): requests the device loop serves join the batch at the next step
    after their own prefill and leave when done (`runner/device/batch.py`), in arrival order while slots are free;
    the batch steps while any is in it, and a new request waits at most one step. A request the device loop does not
    serve (bad_words, a budget it lacks) runs alone on the host loop between two steps. A cancellation drops its
    request before the next step."""
    from runner.device.batch import Admission

    batcher = generator.batcher()
    waiting: list = []  # parsed requests without a slot yet, in arrival order
    streams: dict = {}  # request id -> (request, detokenizer)
    ended = False
    try:
        while not ended or waiting or batcher.members:
            idle = not waiting and not batcher.members
            send.release()  # the last round's events, before waiting for input
            try:  # block for input only when nothing else is to be done
                lines = [inbox.requests.get(timeout=None if idle else 0)]
            except queue.Empty:
                lines = []
            send.hold()  # this round's events (a step's: one a request) go out together
            while True:
                try:
                    lines.append(inbox.requests.get_nowait())
                except queue.Empty:
                    break
            for line in lines:
                if line is None:
                    ended = True
                    continue
                request = parse(line)
                if isinstance(request, dict):
                    send(request)
                else:
                    waiting.append(request)
            for member in list(batcher.members.values()):  # cancelled in the batch: gone before the next step
                if member.tag in inbox.cancelled:
                    batcher.remove(member)
                    request, detokenizer = streams.pop(member.tag)
                    send({"id": request.id, "event": "cancelled", "output_ids": detokenizer.tokens})
            admissions = []  # the requests free slots take, admitted together (their prefills share forwards)
            admit = bool(waiting) and batcher.admit_now(len(waiting))  # or put off to share the next step's frees
            while admit and waiting and batcher.free > len(admissions):
                request = waiting.pop(0)
                if request.id in inbox.cancelled:
                    send({"id": request.id, "event": "cancelled", "output_ids": []})
                    continue
                detokenizer = Detokenizer(tokenizer)
                on_tokens = None  # a request that does not stream: its done event alone
                if request.stream:
                    on_tokens = lambda new, r=request, d=detokenizer: send(_tokens_event(r, d, new))  # noqa: E731
                if not generator.on_device(request.params, request.banned, request.budget):
                    send.release()  # a request alone on the host loop streams its tokens as they come
                    result = generator.generate(
                        request.prompt, request.max_tokens, request.params, request.end_ids, on_tokens,
                        request.stop_sequences, request.banned, request.budget,
                    )  # fmt: skip
                    _finish(send, generator, tokenizer, request, detokenizer, result)
                    send.hold()
                    continue
                streams[request.id] = (request, detokenizer)
                admissions.append(Admission(request.prompt, request.max_tokens, request.params, request.end_ids,
                                            on_tokens, request.stop_sequences, request.budget, request.id))  # fmt: skip
            for member in generator.admit_many(batcher, admissions):
                if member.result.elapsed:  # done at its first token
                    request, detokenizer = streams.pop(member.tag)
                    _finish(send, generator, tokenizer, request, detokenizer, member.result)
            if admissions:  # their first tokens (the prefills') go out now, not a step later with the step's events
                send.release()
                send.hold()
            for member in batcher.step():
                request, detokenizer = streams.pop(member.tag)
                _finish(send, generator, tokenizer, request, detokenizer, member.result)
    finally:
        send.release()  # the last round's events (or those before an error)
