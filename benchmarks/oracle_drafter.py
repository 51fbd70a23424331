"""An oracle drafter for measuring the pipeline itself: the real drafter still runs (its time is real), but its
logits are replaced by a peaked distribution on the target's known greedy continuation, so greedy DDTree accepts
a whole block every step (accept length = block_size) and the measured speed is the best this runtime delivers."""

from __future__ import annotations

import torch

from runner.ranks import Ranks


class OracleDraftRanks(Ranks):
    def __init__(self, engine: Ranks, continuation: list[int], margin: float = 30.0):
        self.engine, self.continuation, self.margin = engine, list(continuation), margin
        self.prompt_length = self.committed = 0

    def call(self, method, *args):
        return self.engine.call(method, *args)

    def reset(self):
        self.engine.reset()

    def prefill(self, prompt):
        self.prompt_length = self.committed = len(prompt)
        return self.engine.prefill(prompt)

    def draft(self, bonus):
        logits = self.engine.draft(bonus)  # [depth, V]
        first = self.committed - self.prompt_length + 1  # continuation index of depth 1
        tokens = self.continuation[first : first + logits.shape[0]]
        oracle = torch.zeros_like(logits)
        if tokens:
            rows = torch.arange(len(tokens), device=logits.device)
            oracle[rows, torch.tensor(tokens, device=logits.device)] = self.margin
        return oracle

    def verify(self, tokens, depths, mask):
        return self.engine.verify(tokens, depths, mask)

    def commit(self, rows):
        self.engine.commit(rows)
        self.committed += len(rows)

    def decode(self, token):
        return self.engine.decode(token)
