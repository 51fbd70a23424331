"""DDTree: the draft tree, built best-first from the drafter's per-depth distributions under a node budget.

Tree contract (shared with the engines, DESIGN.md): node 0 is the root (the last committed token, the bonus);
every parent precedes its children; `depths[i]` is the distance from the root; token i sits at position
`start + depths[i]`; token i sees token j iff j is an ancestor of i or i itself. Rows past `num_nodes` are
padding: they see nothing and nothing sees them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Tree:
    tokens: np.ndarray  # [rows] int64, padding rows hold `pad_token`
    parents: np.ndarray  # [rows] int64, -1 for the root and padding
    depths: np.ndarray  # [rows] int64, 0 for the root and padding
    num_nodes: int  # real rows (root + drafted nodes)
    children: list[dict[int, int]] = field(default_factory=list)  # node -> {token: child node}
    scores: np.ndarray | None = None  # [num_nodes] path log-probability under the drafter (root 0), non-increasing

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def mask(self) -> np.ndarray:
        """[rows, rows] bool, ancestor-or-self visibility; padding rows and columns all False."""
        visible = np.zeros((self.rows, self.rows), dtype=bool)
        nodes = np.arange(self.num_nodes)
        visible[nodes, nodes] = True
        ancestor = self.parents[: self.num_nodes].copy()
        while (ancestor >= 0).any():  # one pass per tree level, vectorised over nodes
            live = ancestor >= 0
            visible[nodes[live], ancestor[live]] = True
            ancestor[live] = self.parents[ancestor[live]]
        return visible

    def positions(self, start: int) -> np.ndarray:
        return start + self.depths

    def prefix(self, budget: int, rows: int, pad_token: int = 0) -> Tree:
        """The tree of the first `budget` drafted nodes (best-first: the tree `build_tree` gives for that budget),
        padded to `rows`."""
        count = min(self.num_nodes, budget + 1)
        tokens = np.full(rows, pad_token, dtype=np.int64)
        parents, depths = np.full(rows, -1, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        tokens[:count], parents[:count], depths[:count] = self.tokens[:count], self.parents[:count], self.depths[:count]
        children: list[dict[int, int]] = [{} for _ in range(count)]
        for node in range(1, count):
            children[int(parents[node])][int(tokens[node])] = node
        scores = self.scores[:count] if self.scores is not None else None
        return Tree(tokens=tokens, parents=parents, depths=depths, num_nodes=count, children=children, scores=scores)


def build_tree(
    top_logprobs: np.ndarray, top_ids: np.ndarray, budget: int, root_token: int, rows: int, pad_token: int = 0
) -> Tree:
    """Best-first DDTree over per-depth top-k draft log-probabilities.

    Args:
        top_logprobs: [depth, k] log-probabilities of each depth's k best draft tokens, sorted descending.
        top_ids: [depth, k] the token ids.
        budget: nodes to add below the root (fewer when the candidates run out).
        root_token: node 0.
        rows: output rows (>= budget + 1); the rest is padding.

    A node's score is the sum of its path's log-probabilities. Popping the best candidate and pushing its next
    sibling and its first child enumerates prefixes in non-increasing score, so the first `budget` pops are the
    `budget` best prefixes, and they form an ancestor-closed tree with every parent popped before its children.
    """
    depth_limit, k = top_logprobs.shape
    if rows < budget + 1:
        raise ValueError(f"budget={budget} needs {budget + 1} tree rows, got {rows}")
    tokens = np.full(rows, pad_token, dtype=np.int64)
    parents = np.full(rows, -1, dtype=np.int64)
    depths = np.zeros(rows, dtype=np.int64)
    tokens[0] = root_token
    scores = [0.0]
    children: list[dict[int, int]] = [{}]
    # Python lists: the loop reads single entries, which numpy scalars make several times slower
    logprobs, ids = top_logprobs.tolist(), top_ids.tolist()
    taken = []  # (token, parent, depth) of nodes 1, 2, ...
    # entries: (-score, tie-breaker, depth, rank, parent)
    heap = [(-logprobs[0][0], 0, 1, 0, 0)] if depth_limit > 0 and k > 0 else []
    count, pushes = 1, 1
    while heap and count <= budget:
        neg_score, _, depth, rank, parent = heapq.heappop(heap)
        node = count
        count += 1
        token = ids[depth - 1][rank]
        taken.append((token, parent, depth))
        children[parent][token] = node
        children.append({})
        score = -neg_score
        scores.append(score)
        if rank + 1 < k:
            row = logprobs[depth - 1]
            heapq.heappush(heap, (-(score - row[rank] + row[rank + 1]), pushes, depth, rank + 1, parent))
            pushes += 1
        if depth < depth_limit:
            heapq.heappush(heap, (-(score + logprobs[depth][0]), pushes, depth + 1, 0, node))
            pushes += 1
    if taken:
        tokens[1:count], parents[1:count], depths[1:count] = np.array(taken, dtype=np.int64).T
    return Tree(tokens=tokens, parents=parents, depths=depths, num_nodes=count, children=children,
                scores=np.array(scores, dtype=np.float64))  # fmt: skip


def follow_tree(tree: Tree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Walks from the root while the target's own token at a node is one of that node's children.

    Returns (accepted path of node indices, starting with the root; the target's token after the path end,
    the next bonus). `target_tokens[i]` is the target's choice (argmax or sample) at node i.
    """
    path, node = [0], 0
    while True:
        token = int(target_tokens[node])
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child
