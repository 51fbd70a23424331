"""The torch backend on a GPU: one CUDA graph per fixed-shape profile (draft, decode, verify_chain, verify_tree),
captured on first use and replayed after copying each new input *into* its captured buffer (a graph ignores a fresh
tensor). The caches are the runner's own tensors, captured in place. Prefill profiles run eagerly.

With `record_events` (benchmarks' probes), CUDA events around every replay measure how long the GPU waits for the
host between graphs.
"""

from __future__ import annotations

import torch

from runner.sessions.base import TorchSession
from runner.sessions.trt import BOUND_IN_PLACE, graph_capturable


class CudaGraphSession(TorchSession):
    backend = "torch"

    def __init__(self, target, drafter, profiles, io, device: torch.device, record_events: bool = False):
        super().__init__(target, drafter, profiles, io)
        self.device = device
        self.graphs: dict[str, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = [] if record_events else None

    @torch.no_grad()
    def execute(self, profile, feeds):
        if not graph_capturable(profile):
            return super().execute(profile, feeds)
        entry = self.graphs.get(profile.name)
        if entry is None or any(entry[1][n].data_ptr() != feeds[n].data_ptr() for n in BOUND_IN_PLACE if n in feeds):
            entry = self._capture(profile, feeds)
        graph, inputs, outputs = entry
        for name, value in feeds.items():
            if name not in BOUND_IN_PLACE:
                inputs[name].copy_(value, non_blocking=True)
        if self.events is None:
            graph.replay()
        else:
            start = timing_event()
            graph.replay()
            self.events.append((profile.name, start, timing_event()))
        return outputs

    def _capture(self, profile, feeds):
        inputs = {n: (v if n in BOUND_IN_PLACE else v.to(self.device, copy=True)) for n, v in feeds.items()}
        names = [t.name for t in self.io[profile.role][0]]
        module = self.modules[profile.role]
        graph, results = capture_graph(lambda: module(*(inputs[n] for n in names)), self.device, 2, self.pool)
        outputs = {t.name: value for t, value in zip(self.io[profile.role][1], results)}
        self.graphs[profile.name] = (graph, inputs, outputs)
        return self.graphs[profile.name]

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
