"""DDTree on the device: the tree build and the greedy walk as fixed-shape tensor ops (no host round trip, and few
kernels: a step graph launches each of them), so a whole speculative step can be one CUDA graph. Same contract and
same node set as `runner/tree.py`.

Build: a beam of `budget` prefixes per depth is exact here, because a prefix's score is a sum of independent
per-depth terms: a depth-d prefix among the best `budget` overall has its parent among the best `budget` at depth
d-1 (any better depth-(d-1) prefix extended by the best depth-d token scores at least as high). The tree is then the
`budget` best of all depths' beams, ordered by depth (parents first). Ties may be broken differently from the heap.
"""

from __future__ import annotations

import torch


def tree_forms(device: torch.device):
    """(top_logprobs, build_tree) for tensors on `device`: on GPUs the Triton kernels (`tree_kernel.py`: the
    draft top-k as two kernels, the build as one; ties go to the lower index), elsewhere the tensor-op forms below."""
    if device.type != "cuda":
        return top_logprobs, build_tree_device
    from runner.device.tree_kernel import build_tree_kernel, top_logprobs_kernel

    return top_logprobs_kernel, build_tree_kernel


def batched_tree_form(device: torch.device):
    """The build of a batch's trees in one launch (`tree_kernel.build_trees_kernel`) on GPUs, where `tree_forms`
    builds with the kernel; None elsewhere (each slot's tree built on its own, `DeviceLoop._tree`)."""
    if device.type != "cuda":
        return None
    from runner.device.tree_kernel import build_trees_kernel

    return build_trees_kernel


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits).topk(k) per row: (values fp32 [rows, k] best first, indices int64)."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def build_tree_device(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, root: torch.Tensor,
                      rows: int, pad_token: int = 0):  # fmt: skip
    """top_logprobs, top_ids: [L, K] (K <= budget, sorted descending); root: [] or [1] token.

    Returns tokens [rows], parents [rows] (-1: root/padding), depths [rows], mask [rows, rows] bool, and the
    number of real nodes [1] (root included)."""
    depth_limit, width = top_logprobs.shape
    device = top_logprobs.device
    # beam at depth 1: the K best tokens, padded to `budget` slots with -inf; a slot's flat index is parent * K + k
    scores = torch.nn.functional.pad(top_logprobs[0], (0, budget - width), value=float("-inf"))
    beam_scores, beam_index = [scores], [torch.arange(budget, device=device).clamp_max(width - 1)]
    for depth in range(1, depth_limit):  # two kernels a depth: the candidates and their best `budget`
        scores, index = _best(scores[:, None] + top_logprobs[depth][None, :], budget)
        beam_scores.append(scores)
        beam_index.append(index)
    all_scores = torch.stack(beam_scores)  # [L, budget]
    flat = torch.stack(beam_index)  # [L, budget]
    beam_tokens = top_ids.gather(1, flat % width)
    beam_parent = torch.where(torch.arange(depth_limit, device=device)[:, None] > 0, flat // width, 0)
    chosen_scores, chosen = _best(all_scores, budget)
    valid = chosen_scores > float("-inf")
    # parents first: order by depth, then by score (the flat index is depth-major, score-sorted within a depth)
    order = torch.where(valid, chosen, chosen + depth_limit * budget).argsort()
    chosen, valid = chosen[order], valid[order]
    chosen_depth = chosen // budget
    node_of = torch.full((depth_limit * budget,), -1, dtype=torch.long, device=device)
    node_of.scatter_(0, chosen, torch.where(valid, torch.arange(1, budget + 1, device=device), -1))
    parent_flat = (chosen_depth - 1).clamp_min(0) * budget + beam_parent.reshape(-1)[chosen]
    parent_node = torch.where(chosen_depth > 0, node_of[parent_flat], 0)
    pad = torch.nn.functional.pad
    root_row = root.reshape(-1)[:1].to(torch.long)
    padding = rows - budget - 1
    tokens = torch.cat((root_row, pad(torch.where(valid, beam_tokens.reshape(-1)[chosen], pad_token), (0, padding),
                                      value=pad_token)))  # fmt: skip
    parents = pad(torch.where(valid, parent_node, -1), (1, padding), value=-1)
    depths = pad(torch.where(valid, chosen_depth + 1, 0), (1, padding))
    real = pad(pad(valid, (1, 0), value=True), (0, padding), value=False)
    return tokens, parents, depths, ancestor_mask(parents, real, depth_limit), real.sum().reshape(1)


def _best(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best of the flattened scores and their flat indices; ties go to the lower index (as the Triton
    build's do). For the global choice that keeps every node's parent in: a child never scores above its parent,
    and where it scores the same (a drafted token of log-probability 0 in float32, as a very confident drafter
    gives) the parent, one depth up, has the lower flat index. `topk` breaks ties in no stated order: it could take
    the child and leave its parent out (an orphan node, never accepted)."""
    values, index = scores.reshape(-1).sort(descending=True, stable=True)
    return values[:count], index[:count]


def ancestor_mask(parents: torch.Tensor, real: torch.Tensor, depth_limit: int) -> torch.Tensor:
    """[rows, rows] ancestor-or-self visibility of the real rows; padding sees nothing and is not seen.

    Reachability by squaring: one hop (self or parent), then ceil(log2(depth_limit)) products of 0/1 matrices
    (exact in float32), instead of one gather round per depth."""
    has_parent = (real & (parents >= 0)).float()
    reach = torch.diag(real.float()).scatter_add_(1, parents.clamp_min(0)[:, None], has_parent[:, None])
    hops = 1
    while hops < depth_limit:
        reach = (reach @ reach).clamp_max_(1.0)
        hops *= 2
    return reach > 0


def accept_greedy_device(tokens, parents, depths, mask, choices: torch.Tensor, depth_limit: int):
    """The longest root path whose every node is the target's choice at its parent (no loop over depths).

    A node is accepted when it and all its ancestors are "good" (the root, or the token the target chose at the
    parent). Siblings carry distinct tokens, so the accepted nodes form one chain from the root.
    choices: [rows] the target's token at every row; mask: the tree's ancestor-or-self mask. Returns (path
    [depth_limit + 1] node indices, root first, entries past the length are 0; length [1]; next bonus token [1])."""
    path, length, bonus = accept_greedy_batched(tokens[None], parents[None], depths[None], mask[None], choices[None],
                                                depth_limit)  # fmt: skip
    return path[0], length, bonus


def accept_greedy_batched(tokens, parents, depths, mask, choices: torch.Tensor, depth_limit: int):
    """`accept_greedy_device` for B trees at once (a batched step's, `runner/device/batch.py`): tokens, parents,
    depths, choices [B, rows], mask [B, rows, rows] -> path [B, depth_limit + 1], length [B], next bonus [B]."""
    rows = tokens.shape[1]
    is_root = torch.arange(rows, device=tokens.device) == 0
    good = is_root | ((parents >= 0) & (tokens == choices.gather(1, parents.clamp_min(0))))
    accepted = mask.diagonal(dim1=1, dim2=2) & ~(mask & ~good[:, None, :]).any(dim=2)
    levels = torch.arange(depth_limit + 1, device=tokens.device)[:, None]
    path = (accepted[:, None, :] & (depths[:, None, :] == levels)).to(torch.int32).argmax(dim=2)
    length = accepted.sum(dim=1)
    return path, length, choices.gather(1, path.gather(1, (length - 1)[:, None])).reshape(-1)
