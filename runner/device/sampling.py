"""Sampling as tensor ops, for the device loop: temperature, top-k and top-p (the order transformers applies them),
then one exact draw per row by the Gumbel-max trick, with noise from a counter-based generator.

The noise of a draw is a hash of (seed, counter, row, token id): no generator state, so a replayed CUDA graph draws
fresh numbers when the counter (a device tensor) advances, a request is reproducible from its seed, and every rank
computes the same draw without communicating. The hash uses 32-bit arithmetic inside int64 tensors with no
overflow (16-bit halves multiplied separately), so CPUs and GPUs give the same bits.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without leaving int64's range."""
    high, low = x >> 16, x & 0xFFFF
    return (((high * constant) & 0xFFFF) << 16) + low * constant & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds, "lowbias32")."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """[rows, columns] uniforms in (0, 1), float32, a function of (seed, counter, row, column) alone."""
    device = seed.device
    row = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
    column = torch.arange(columns, device=device, dtype=torch.int64)[None, :]
    key = _mix32(_mix32(_mix32(seed.reshape(1, 1)) ^ counter.reshape(1, 1)) ^ row)
    return bits_to_uniform(_mix32(key ^ column))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms strictly inside (0, 1): the top 23 bits, centred in their cell. (24 bits
    were one too many: the last cell's centre, 1 - 2^-25, rounds to 1.0 in float32, where the Gumbel noise is
    infinite; about one draw in 4000 over a 4096-token vocabulary then took a token outside the top-k.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def filtered_scores(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """[R, V] logits -> the sampling scores: logits / temperature, -inf outside the top-k (ties with the k-th kept)
    and outside the nucleus (the fewest best tokens whose probability reaches top_p). temperature and top_p are
    float tensors [1], top_k an int64 tensor [1] (0: no cap)."""
    scores = logits.to(torch.float32) / temperature
    vocab = scores.shape[-1]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_scores.gather(-1, (k - 1).expand(scores.shape[0], 1))
    sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, float("-inf"))
    probs = torch.softmax(sorted_scores, dim=-1)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p  # the mass before a token already reaches top_p
    sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)


def sample_tokens(logits: torch.Tensor, temperature, top_k, top_p, seed, counter, filter: str = "sort") -> torch.Tensor:
    """One exact draw per row of the filtered distribution: argmax(scores + Gumbel noise) -> [R] int64. filter
    (`filter_kind`, known on the host when a request loads): "none" skips top-k / top-p, "top_p" is top-p alone (on
    GPUs without a sort: `sampling_kernel.nucleus_argmax_kernel`), "sort" the sorted filter of `filtered_scores`."""
    if filter == "none":
        return gumbel_argmax(logits.to(torch.float32) / temperature, seed, counter)
    if filter == "top_p" and logits.is_cuda:
        from runner.device.sampling_kernel import nucleus_argmax_kernel

        return nucleus_argmax_kernel(logits.to(torch.float32) / temperature, top_p, seed, counter)
    return gumbel_argmax(filtered_scores(logits, temperature, top_k, top_p), seed, counter)


def gumbel_argmax(scores: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R]: argmax(scores - log(-log(u))), u = `counter_uniform`; on GPUs one Triton kernel of the same
    hash (`sampling_kernel.py`), elsewhere these tensor ops."""
    if scores.is_cuda:
        from runner.device.sampling_kernel import gumbel_argmax_kernel

        return gumbel_argmax_kernel(scores, seed, counter)
    return gumbel_argmax_tensor_ops(scores, seed, counter)


def gumbel_argmax_tensor_ops(scores: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    uniform = counter_uniform(seed, counter, *scores.shape)
    return (scores - torch.log(-torch.log(uniform))).argmax(dim=-1)


def filter_kind(params) -> str:
    """`sample_tokens`' filter for a request: "none" (neither top-k nor top-p), "top_p" (top-p alone), "sort"."""
    if params.top_k > 0:
        return "sort"
    return "top_p" if params.top_p < 1.0 else "none"


def sampling_tensors(params, device) -> dict[str, torch.Tensor]:
    """A request's `SamplingParams` as the device tensors `sample_tokens` takes."""
    return {
        "temperature": torch.tensor([float(params.temperature)], device=device),
        "top_k": torch.tensor([int(params.top_k)], dtype=torch.int64, device=device),
        "top_p": torch.tensor([float(params.top_p)], device=device),
        "seed": torch.tensor(
            [(int(params.seed) ^ (int(params.seed) >> 32)) & _MASK32], dtype=torch.int64, device=device
        ),  # fmt: skip
    }
