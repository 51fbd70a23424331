"""DDTree on the device: the tree build and the greedy walk as fixed-shape tensor ops (no host round trip), so a
whole speculative step can be one CUDA graph. Same contract and same node set as `runner/tree.py`.

Build: a beam of `budget` prefixes per depth is exact here, because a prefix's score is a sum of independent
per-depth terms: a depth-d prefix among the best `budget` overall has its parent among the best `budget` at depth
d-1 (any better depth-(d-1) prefix extended by the best depth-d token scores at least as high). The tree is then the
`budget` best of all depths' beams, ordered by depth (parents first). Ties may be broken differently from the heap.
"""

from __future__ import annotations

import torch


def build_tree_device(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, root: torch.Tensor,
                      rows: int, pad_token: int = 0):  # fmt: skip
    """top_logprobs, top_ids: [L, K] (K <= budget, sorted descending); root: [] or [1] token.

    Returns tokens [rows], parents [rows] (-1: root/padding), depths [rows], mask [rows, rows] bool, and the
    number of real nodes [1] (root included)."""
    depth_limit, width = top_logprobs.shape
    device = top_logprobs.device
    neg = torch.full((1,), float("-inf"), device=device, dtype=top_logprobs.dtype)
    # beam at depth 1: the K best tokens, padded to `budget` slots with -inf
    scores = torch.cat((top_logprobs[0], neg.expand(budget - width)))
    beam_scores, beam_tokens, beam_parent = (
        [scores],
        [torch.cat((top_ids[0], top_ids[0, :1].expand(budget - width)))],
        [torch.zeros(budget, dtype=torch.long, device=device)],
    )
    for depth in range(1, depth_limit):
        candidates = (scores[:, None] + top_logprobs[depth][None, :]).reshape(-1)  # [budget * K]
        scores, index = candidates.topk(budget)
        beam_scores.append(scores)
        beam_tokens.append(top_ids[depth][index % width])
        beam_parent.append(index // width)  # slot in the previous beam
    all_scores = torch.stack(beam_scores)  # [L, budget]
    chosen = all_scores.reshape(-1).topk(budget).indices
    chosen_depth, chosen_slot = chosen // budget, chosen % budget
    valid = all_scores.reshape(-1)[chosen] > float("-inf")
    # parents first: order by depth, then by score (the flat index is depth-major, score-sorted within a depth)
    key = torch.where(valid, chosen, chosen + depth_limit * budget)
    order = key.argsort()
    chosen_depth, chosen_slot, valid = chosen_depth[order], chosen_slot[order], valid[order]
    node_of = torch.full((depth_limit, budget), -1, dtype=torch.long, device=device)
    node_of[chosen_depth, chosen_slot] = torch.where(valid, torch.arange(1, budget + 1, device=device), -1)
    parent_slot = torch.stack(beam_parent)[chosen_depth, chosen_slot]
    parent_node = torch.where(chosen_depth > 0, node_of[(chosen_depth - 1).clamp_min(0), parent_slot], 0)
    tokens = torch.full((rows,), pad_token, dtype=torch.long, device=device)
    parents = torch.full((rows,), -1, dtype=torch.long, device=device)
    depths = torch.zeros(rows, dtype=torch.long, device=device)
    tokens[0] = root.reshape(-1)[0]
    tokens[1 : budget + 1] = torch.where(valid, torch.stack(beam_tokens)[chosen_depth, chosen_slot], pad_token)
    parents[1 : budget + 1] = torch.where(valid, parent_node, -1)
    depths[1 : budget + 1] = torch.where(valid, chosen_depth + 1, 0)
    # no Python-scalar stores into device tensors: they would be host copies inside a CUDA-graph capture
    root_row = torch.ones(1, dtype=torch.bool, device=device)
    real = torch.cat((root_row, valid, torch.zeros(rows - budget - 1, dtype=torch.bool, device=device)))
    return tokens, parents, depths, ancestor_mask(parents, real, depth_limit), real.sum().reshape(1)


def ancestor_mask(parents: torch.Tensor, real: torch.Tensor, depth_limit: int) -> torch.Tensor:
    """[rows, rows] ancestor-or-self visibility of the real rows; padding sees nothing and is not seen."""
    rows = parents.shape[0]
    index = torch.arange(rows, device=parents.device)
    mask = torch.zeros(rows, rows, dtype=torch.bool, device=parents.device)
    mask[index, index] = real
    ancestor = parents.clone()
    for _ in range(depth_limit):
        live = (ancestor >= 0) & real
        mask[index, ancestor.clamp_min(0)] |= live
        ancestor = torch.where(live, parents[ancestor.clamp_min(0)], -1)
    return mask


def accept_greedy_device(tokens, parents, real, choices: torch.Tensor, depth_limit: int):
    """Walks from the root while the target's choice at the current node is one of its children.

    choices: [rows] the target's token at every row. Returns (path [depth_limit + 1] node indices, root first,
    entries past the length are 0; length [1]; next bonus token [1])."""
    current = torch.zeros((), dtype=torch.long, device=tokens.device)
    alive = torch.ones((), dtype=torch.bool, device=tokens.device)
    path = [current]
    length = torch.ones((), dtype=torch.long, device=tokens.device)
    for _ in range(depth_limit):
        wanted = choices.index_select(0, current.reshape(1))  # a tensor index would sync (int conversion)
        match = real & (parents == current) & (tokens == wanted)
        found = match.any() & alive
        following = match.to(torch.int32).argmax()
        current = torch.where(found, following, current)
        path.append(torch.where(found, following, 0))
        length = length + found.to(torch.long)
        alive = found
    return torch.stack(path), length.reshape(1), choices.index_select(0, current.reshape(1))
