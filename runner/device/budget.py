"""The cost-aware tree budget inside the device loop: the choice of `runner/budget.py`, as fixed-shape tensor ops.

The step builds the tree of the largest budget and verifies it in one forward of that budget's rows (one CUDA
graph); the budget chosen for the step decides which nodes are *active*: the b best by path log-probability (with
the root). They form the best-first tree of budget b (a child never scores above its parent), the same nodes the
host loop's `Tree.prefix(b)` verifies. The other nodes are made padding for this step: they see nothing, nothing
sees them, the walk never accepts them, and the target's MoE routes them to the root's experts with zero weight
(`models/moe.py`, `Router.row_active`), so a narrow step reads the experts of its own nodes only.

The choice needs no host round trip: expected drafted tokens E_b from the tree's own scores, the host policy's
calibration factors and costs (device tensors the host refreshes between launches from a pinned slot: every rank
receives the same values with the launch call, so every rank chooses the same budget), rate_b = (1 + c_b E_b) /
cost_b, the first maximum (the smallest budget on ties, as the host policy). The step's statistics (the budget
index, E_b at every budget, and the accepted nodes each budget would have accepted) come back with its tokens, and
the host policy learns from them as it does from host steps (`BudgetPolicy.observe`).
"""

from __future__ import annotations

import torch


def node_scores(tokens, depths, mask, top_values, top_ids) -> torch.Tensor:
    """Each real node's path log-probability under the drafter (root 0; padding -inf): [rows] float32.

    A depth-d node's token is one of the drafter's top candidates at depth d (the tree is built from them), so its
    own log-probability is looked up there; the path's is the sum over the node's ancestors-or-self (the mask)."""
    real = mask.diagonal()
    row = (depths - 1).clamp_min(0)
    match = top_ids.index_select(0, row) == tokens[:, None]  # [rows, K]
    own = torch.where(match, top_values.index_select(0, row), 0.0).sum(dim=1)
    own = torch.where(real & (depths > 0), own, 0.0)
    scores = mask.to(torch.float32) @ own
    return torch.where(real, scores, float("-inf"))


def rank_nodes(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank [rows]: each node's place in best-first order, the root 0; sorted scores [rows]). Ties keep the node
    order, in which every parent precedes its children, so the b best always include each one's ancestors."""
    ordered, order = scores.sort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return rank, ordered


def expected_drafted(ordered_scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """E_b for each budget: the drafter's expected accepted drafted tokens of the b best nodes, [nb] float64."""
    cumulative = ordered_scores[1:].to(torch.float64).exp().cumsum(0)
    return cumulative.index_select(0, (budgets - 1).clamp_max(cumulative.numel() - 1))


def choose_budget(drafted, calibration, costs, fixed) -> torch.Tensor:
    """The index [1] of the budget with the most expected tokens a second (`fixed` >= 0: that index instead)."""
    rate = (1.0 + calibration * drafted) / costs
    best = rate.argmax().reshape(1)
    return torch.where(fixed >= 0, fixed, best)


def accepted_at(rank, path, length, budgets) -> torch.Tensor:
    """For each budget b, the accepted path's drafted nodes among the b best (what budget b would have accepted:
    the target's choices at those nodes are the same), [nb] int64."""
    steps = torch.arange(path.numel(), device=path.device)
    drafted = (steps > 0) & (steps < length)
    return ((rank.index_select(0, path)[None, :] <= budgets[:, None]) & drafted[None, :]).sum(dim=1)
