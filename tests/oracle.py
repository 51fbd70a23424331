"""Test drafters that know the target: they make acceptance frequent, so multi-node acceptance paths are exercised.

`TargetDraftRanks` wraps an engine and replaces its drafter's logits by the target's own logits along the target's
greedy continuation (plus optional noise), computed with an independent model (transformers). The engine's real
drafter still runs, so its caches evolve exactly as in production.
"""

from __future__ import annotations

import torch

from runner.ranks import Ranks


class TargetDraftRanks(Ranks):
    def __init__(self, engine: Ranks, hf_model, depth: int, noise: float = 0.0, seed: int = 0):
        self.engine, self.hf_model, self.depth, self.noise = engine, hf_model, depth, noise
        self.generator = torch.Generator().manual_seed(seed)
        self.sequence: list[int] = []
        self._tree_tokens = None

    def call(self, method, *args):
        return self.engine.call(method, *args)

    def reset(self):
        self.sequence = []
        self.engine.reset()

    def prefill(self, prompt):
        self.sequence = list(prompt)
        return self.engine.prefill(prompt)

    @torch.no_grad()
    def draft(self, bonus):
        real = self.engine.draft(bonus)
        sequence, rows = self.sequence + [int(bonus)], []
        for _ in range(self.depth):
            logits = self.hf_model(torch.tensor([sequence])).logits[0, -1]
            rows.append(logits)
            sequence.append(int(logits.argmax()))
        logits = torch.stack(rows)
        if self.noise:
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.generator)
        return logits.to(real.dtype)

    def verify(self, tokens, depths, mask):
        self._tree_tokens = tokens
        return self.engine.verify(tokens, depths, mask)

    def commit(self, rows):
        self.engine.commit(rows)
        self.sequence.extend(int(self._tree_tokens[r]) for r in rows)
