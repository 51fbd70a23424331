"""An oracle for measuring the pipeline itself at full acceptance.

The real drafter and the real verify forward both run (their time is real), but the drafter's logits are replaced
by a peaked distribution on a known greedy continuation, and so are the target's verify logits along it. Greedy
DDTree then accepts a whole block every step (accept length = block_size) and emits exactly that continuation.

Why the verify logits too: in bf16 the target's argmax at a T=33 verify row and at the same position in a T=1
decode differ now and then (different kernels and reduction orders; MoE top-k routing turns a rounding difference
into a different expert set), so the autoregressive continuation stops being the target's own choice after a few
tokens and an oracle built from it stops being accepted. Overriding the logits after the forward keeps the cost of
every stage and removes that dependence; the tokens emitted are the autoregressive baseline's."""

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
        logits = self.engine.verify(tokens, depths, mask)  # [rows, V], computed for real
        start = self.committed - self.prompt_length + 1
        agree = torch.zeros_like(logits)
        # every node's row points at the continuation token one past its depth, so the walk follows the chain
        wanted = [self.continuation[min(start + int(d), len(self.continuation) - 1)] for d in depths]
        agree[torch.arange(len(wanted), device=logits.device), torch.tensor(wanted, device=logits.device)] = 1.0
        return agree

    def commit(self, rows):
        self.engine.commit(rows)
        self.committed += len(rows)

    def decode(self, token):
        return self.engine.decode(token)
