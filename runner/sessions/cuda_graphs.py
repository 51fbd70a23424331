"""The torch backend on a GPU: one CUDA graph per fixed-shape profile (draft, decode, verify_chain, verify_tree),
captured on first use and replayed after copying each new input *into* its captured buffer (a graph ignores a fresh
tensor). The caches are the runner's own tensors, captured in place.

Prefill: a prompt of up to PREFILL_GRAPH_TOKENS tokens is padded to the next of `prefill_buckets` (`RankWorker.prefill`)
and replays that length's graph: run eagerly, a prefill is about a thousand small launches (one H200, the trained
pair's 6 layers: 10-15 ms for a 70-token prompt, a quarter of a 128-token request), where a graph replays them
back to back. Longer prompts run eagerly (their launches are a small part of their time, and padding them would
not be). A graph is captured over the rank's own cache; a batch slot's prefill from row 0 replays it too (it reads no
cache row), while a later chunk of a slot's long prompt runs eagerly: recapturing whenever the cache changed took
every prefill of two alternating slots through a capture (one H200, the trained pair, two requests in flight: half
the tokens/s of one at a time).

With `record_events` (benchmarks' probes), CUDA events around every replay measure how long the GPU waits for the
host between graphs.
"""

from __future__ import annotations

import logging

import torch

from runner.sessions.base import TorchSession, length_buckets
from runner.sessions.trt import BOUND_IN_PLACE, graph_capturable

PREFILL_GRAPH_TOKENS = 256  # prompts up to this many tokens replay a prefill graph of their padded length


class CudaGraphSession(TorchSession):
    backend = "torch"

    def __init__(self, target, drafter, profiles, io, device: torch.device, record_events: bool = False):
        super().__init__(target, drafter, profiles, io)
        self.device = device
        self.graphs: dict[str, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = [] if record_events else None
        if "prefill" in profiles:
            longest = min(profiles["prefill"].dims["tokens"][2], PREFILL_GRAPH_TOKENS)
            self.prefill_buckets = tuple(length_buckets(longest))

    @torch.no_grad()
    def execute(self, profile, feeds):
        key = profile.name
        if profile.name == "prefill" and feeds["input_ids"].shape[0] in self.prefill_buckets:
            key = f"prefill:{feeds['input_ids'].shape[0]}"  # a padded prefill: its length's graph
        elif not graph_capturable(profile):
            return super().execute(profile, feeds)
        entry = self.graphs.get(key)
        moved = entry is not None and any(
            entry[1][n].data_ptr() != feeds[n].data_ptr() for n in BOUND_IN_PLACE if n in feeds
        )
        if moved and key != profile.name:  # a prefill over another cache than its graph's (a batch slot's)
            if int(feeds["cache_length"].reshape(-1)[0]) > 0:
                return super().execute(profile, feeds)  # it reads that cache's rows: eagerly, no graph per cache
            moved = False  # it reads no cache row (the kernel stops at the device length): the graph serves any cache
        if entry is None or moved:
            try:
                entry = self._capture(profile, feeds, key)
            except RuntimeError as err:
                if key == profile.name:
                    raise
                # a form that cannot be captured at this length: prefills run eagerly from now on, as before graphs
                logging.getLogger(__name__).warning("prefill graphs off, prefills run eagerly: capturing %s: %s", key,
                                                    err)  # fmt: skip
                self.prefill_buckets = ()
                return super().execute(profile, feeds)
        graph, inputs, outputs = entry
        for name, value in feeds.items():
            if name not in BOUND_IN_PLACE:
                inputs[name].copy_(value, non_blocking=True)
        if self.events is None:
            graph.replay()
        else:
            start = timing_event()
            graph.replay()
            self.events.append((key, start, timing_event()))
        if key != profile.name:  # a prefill's outputs outlive the next replay (its taps wait for the drafter)
            return {name: value.clone() for name, value in outputs.items()}
        return outputs

    def _capture(self, profile, feeds, key: str):
        inputs = {n: (v if n in BOUND_IN_PLACE else v.to(self.device, copy=True)) for n, v in feeds.items()}
        names = [t.name for t in self.io[profile.role][0]]
        module = self.modules[profile.role]
        graph, results = capture_graph(lambda: module(*(inputs[n] for n in names)), self.device, 2, self.pool)
        outputs = {t.name: value for t, value in zip(self.io[profile.role][1], results)}
        self.graphs[key] = (graph, inputs, outputs)
        return self.graphs[key]

    def host_gaps(self) -> list[float]:
        """GPU idle time (seconds) between consecutive graph replays, in order."""
        torch.cuda.synchronize(self.device)
        events = self.events or []
        return [events[i][2].elapsed_time(events[i + 1][1]) / 1e3 for i in range(len(events) - 1)]


def warm_up(fn, device: torch.device, times: int = 1) -> None:
    """Runs fn on a side stream, as graph capture wants: kernels compile and memory is allocated outside any graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def capture_graph(fn, device: torch.device, warmups: int = 1, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`warmups` warm-up runs of fn, then fn captured into a new graph (in `pool`); returns the graph and fn's result
    (the graph's output tensors, rewritten by every replay)."""
    if warmups:
        warm_up(fn, device, warmups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = fn()
    return graph, result


def timing_event() -> torch.cuda.Event:
    """A timing event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
