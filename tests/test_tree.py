import itertools

import numpy as np
import pytest

from runner.tree import build_tree, follow_tree


def _random_top(rng, depth, k):
    logits = rng.normal(size=(depth, 50)) * 2
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-logprobs, axis=-1)[:, :k]
    return np.take_along_axis(logprobs, order, -1), order


def _prefix_paths(tree):
    """Each node as its tuple of per-depth ranks is not stored; use token paths (unique per depth's top-k)."""
    paths = {}
    for node in range(1, tree.num_nodes):
        path, n = [], node
        while n > 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        paths[node] = tuple(reversed(path))
    return paths


@pytest.mark.parametrize("seed", range(12))
def test_tree_is_the_brute_force_top_budget_prefixes(seed):
    rng = np.random.default_rng(seed)
    depth, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    logprobs, ids = _random_top(rng, depth, k)
    total = sum(k**d for d in range(1, depth + 1))
    budget = int(rng.integers(1, total + 3))
    tree = build_tree(logprobs, ids, budget, root_token=7, rows=budget + 4)
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            scored.append(
                (sum(logprobs[i, r] for i, r in enumerate(ranks)), tuple(int(ids[i, r]) for i, r in enumerate(ranks)))
            )
    scored.sort(key=lambda item: -item[0])
    expected = {path for _, path in scored[: min(budget, total)]}
    assert tree.num_nodes == 1 + min(budget, total)
    assert set(_prefix_paths(tree).values()) == expected


def test_contract_parents_first_depths_mask_positions_and_padding():
    rng = np.random.default_rng(3)
    logprobs, ids = _random_top(rng, depth=7, k=6)
    tree = build_tree(logprobs, ids, budget=20, root_token=99, rows=33, pad_token=5)
    assert tree.num_nodes == 21 and tree.rows == 33 and tree.tokens[0] == 99
    mask = tree.mask()
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        assert 0 <= parent < node  # parents precede children
        assert tree.depths[node] == tree.depths[parent] + 1
        ancestors, n = {node}, node
        while n > 0:
            n = int(tree.parents[n])
            ancestors.add(n)
        assert set(np.flatnonzero(mask[node])) == ancestors  # ancestor-or-self
    assert mask[0].tolist() == [True] + [False] * 32
    assert (mask == np.tril(mask)).all()  # lower-triangular: the GPU TreeAttention kernel stops at a row's own node
    assert not mask[21:].any() and not mask[:, 21:].any()  # padding: sees nothing, seen by nothing
    assert (tree.tokens[21:] == 5).all() and (tree.depths[21:] == 0).all()
    assert (tree.positions(100)[: tree.num_nodes] == 100 + tree.depths[: tree.num_nodes]).all()


def test_per_depth_topk_cap_and_chain():
    rng = np.random.default_rng(1)
    logprobs, ids = _random_top(rng, depth=7, k=1)
    chain = build_tree(logprobs, ids, budget=7, root_token=0, rows=8)
    assert chain.num_nodes == 8 and chain.parents[1:].tolist() == list(range(7))
    assert chain.tokens[1:].tolist() == ids[:, 0].tolist()
    few = build_tree(logprobs, ids, budget=32, root_token=0, rows=33)  # only 7 candidates exist
    assert few.num_nodes == 8 and not few.mask()[8:].any()


def test_follow_tree_walks_the_targets_choices():
    rng = np.random.default_rng(0)
    logprobs, ids = _random_top(rng, depth=3, k=3)
    tree = build_tree(logprobs, ids, budget=10, root_token=1, rows=11)
    # the target picks node 0's best child, then that child's best child, then something off-tree
    child = tree.children[0][int(ids[0, 0])]
    grandchild = tree.children[child][int(ids[1, 0])]
    choices = [-1] * tree.num_nodes
    choices[0], choices[child], choices[grandchild] = int(ids[0, 0]), int(ids[1, 0]), 4242
    assert follow_tree(tree, choices) == ([0, child, grandchild], 4242)
    choices[0] = 4343
    assert follow_tree(tree, choices) == ([0], 4343)


def test_rows_must_hold_the_budget():
    logprobs, ids = _random_top(np.random.default_rng(0), 3, 3)
    with pytest.raises(ValueError, match="budget=32 needs 33 tree rows, got 8"):
        build_tree(logprobs, ids, budget=32, root_token=0, rows=8)


def test_tree_scores_are_path_log_probabilities_in_best_first_order():
    """`Tree.scores` (what the cost-aware budget reads): node i's score is the sum of its path's draft
    log-probabilities, non-increasing in node order, so budget b's tree is the first b nodes."""
    from runner.tree import build_tree

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 6))
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-logprobs, axis=1)
    top_logprobs, top_ids = np.take_along_axis(logprobs, order, 1), order
    tree = build_tree(top_logprobs, top_ids, 12, root_token=99, rows=16)
    assert tree.scores[0] == 0 and np.all(np.diff(tree.scores[1:]) <= 1e-12)
    for node in range(1, tree.num_nodes):
        expected, walk = 0.0, node
        while walk > 0:
            depth, token = tree.depths[walk], tree.tokens[walk]
            expected += logprobs[depth - 1, token]
            walk = tree.parents[walk]
        assert abs(tree.scores[node] - expected) < 1e-9
    small = build_tree(top_logprobs, top_ids, 5, root_token=99, rows=8)
    cut = tree.prefix(5, rows=8)  # budget 5's tree = the first 5 nodes, the same rows, mask and walk
    assert cut.tokens.tolist() == small.tokens.tolist() and cut.parents.tolist() == small.parents.tolist()
    assert (cut.mask() == small.mask()).all() and cut.children == small.children and cut.num_nodes == 6
