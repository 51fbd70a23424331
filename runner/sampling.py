"""Target-side token choice: greedy argmax, or one exact sample per row from the temperature / top-k / top-p
adjusted distribution. DDTree acceptance walks the tree with these choices, so every emitted token is an exact
target sample (lossless)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5  # vLLM samples greedily below it; here it is refused (0 is greedy)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # NaN, infinities and temperatures so small that logits / temperature overflow would poison the sampler on
        # every rank (a request's "probability tensor contains inf, nan" ended the whole job)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cap), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] probabilities after temperature, then top-k, then top-p (nucleus)."""
    scores = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Rank 0's token chooser; its generator is the only source of randomness of a generation.

    `banned_tokens` (bad words) are removed from the target's distribution at every position before the choice,
    so speculative output stays exactly the output of the target with those tokens banned."""

    def __init__(self, params: SamplingParams, banned_tokens: tuple[int, ...] = ()):
        self.params = params
        self.banned = list(banned_tokens)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.params.seed)
        return self._generators[device]

    def choose(self, logits: torch.Tensor) -> list[int]:
        """[R, V] -> one token per row."""
        if self.banned:
            logits = logits.clone()
            logits[:, self.banned] = float("-inf")
        if self.params.greedy:
            return logits.argmax(dim=-1).tolist()
        probs = sampling_probs(logits, self.params)
        return torch.multinomial(probs, 1, generator=self._generator(probs.device)).squeeze(-1).tolist()
