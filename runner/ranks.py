"""Rank 0's handle on all ranks: each call runs the same worker method on every rank and returns rank 0's result.

- `LocalRanks`: every rank in this process (one thread per rank when tp > 1): the CPU reference and tests.
- `runner.mpi.MpiRanks`: one process per rank under mpirun; rank 0 broadcasts the call, workers loop.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class Ranks:
    """The engine as the speculative loop sees it. `lead`: rank 0's own worker (its spec, caches, device loop)."""

    lead = None

    def call(self, method: str, *args):
        raise NotImplementedError

    def reset(self) -> None:
        self.call("reset")

    def prefill(self, prompt: list[int]):
        return self.call("prefill", prompt)

    def decode(self, token: int):
        return self.call("decode", token)

    def draft(self, bonus: int):
        return self.call("draft", bonus)

    def verify(self, tokens, depths, mask):
        return self.call("verify", tokens, depths, mask)

    def commit(self, rows: list[int]) -> None:
        self.call("commit", rows)

    def device_prefill_context(self) -> None:
        self.call("device_prefill_context")

    def device_load(self, bonus: int, prompt_length: int, params=None, budget=None) -> None:
        self.call("device_load", bonus, prompt_length, params, budget)

    def device_launch(self, budget=None) -> None:
        """budget: this step's tree budget (`DeviceLoop.launch`), the same on every rank."""
        self.call("device_launch", budget)

    def device_collect(self) -> list[int]:
        return self.call("device_collect")

    def close(self) -> None:
        pass


class LocalRanks(Ranks):
    def __init__(self, workers: list, group=None):
        self.workers, self.group, self.lead = workers, group, workers[0]
        self._pool = ThreadPoolExecutor(max_workers=len(workers)) if len(workers) > 1 else None

    def call(self, method: str, *args):
        if self._pool is None:
            return getattr(self.workers[0], method)(*args)
        futures = [self._pool.submit(self._run, w, method, args) for w in self.workers]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:  # the original failure, not the BrokenBarrierError it caused on the other ranks
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return futures[0].result()

    def _run(self, worker, method: str, args: tuple):
        try:
            return getattr(worker, method)(*args)
        except BaseException:
            if self.group is not None:
                self.group.abort()  # wake the ranks waiting in a collective for this one
            raise

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self._pool is not None:
            self._pool.shutdown()
