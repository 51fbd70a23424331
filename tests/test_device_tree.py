"""The device-side tree build and greedy walk equal the host versions (runner/tree.py) on random cases."""

import numpy as np
import pytest
import torch

from runner.device.tree import accept_greedy_device, build_tree_device
from runner.tree import build_tree, follow_tree
from tests.interpreter import run_interpreted


def _top(rng, depth, k):
    logits = rng.normal(size=(depth, 60)) * 2
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-logprobs, axis=-1)[:, :k]
    return np.take_along_axis(logprobs, order, -1), order


def _paths(tokens, parents, count):
    out = set()
    for node in range(1, count):
        path, n = [], node
        while n > 0:
            path.append(int(tokens[n]))
            n = int(parents[n])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_device_tree_equals_host_tree(seed):
    rng = np.random.default_rng(seed)
    depth, budget = int(rng.integers(1, 8)), int(rng.integers(1, 40))
    k = min(budget, int(rng.integers(1, 6)))
    logprobs, ids = _top(rng, depth, k)
    rows = budget + 1 + int(rng.integers(0, 4))
    host = build_tree(logprobs, ids, budget, root_token=5, rows=rows)
    tokens, parents, depths, mask, count = build_tree_device(torch.tensor(logprobs), torch.tensor(ids), budget,
                                                             torch.tensor(5), rows)  # fmt: skip
    n = int(count)
    assert n == host.num_nodes
    assert _paths(tokens, parents, n) == _paths(host.tokens, host.parents, host.num_nodes)
    for node in range(1, n):
        assert 0 <= parents[node] < node and depths[node] == depths[parents[node]] + 1
    # the same visibility once rows are matched by their token paths
    host_rows = {}
    for node in range(host.num_nodes):
        host_rows[_node_path(host.tokens, host.parents, node)] = node
    order = [host_rows[_node_path(tokens, parents, node)] for node in range(n)]
    assert np.array_equal(mask[:n, :n].numpy(), host.mask()[np.ix_(order, order)])
    assert not mask[n:].any() and not mask[:, n:].any()


def test_a_confident_drafter_gives_no_orphan_nodes():
    """Draft tokens of log-probability exactly 0 in float32 (one logit 30 above the rest, as a very confident
    drafter or the benchmarks' oracle gives): children tie with their parents and the alternatives tie with each
    other. Every node's parent is still in the tree (ties go to the lower depth), as the host build has it."""
    logits = torch.zeros(7, 512)
    logits[torch.arange(7), 10 + torch.arange(7)] = 30.0
    top = torch.log_softmax(logits, dim=-1).topk(32, dim=-1)
    assert (top.values[:, 0] == 0).all()
    tokens, parents, depths, mask, count = build_tree_device(top.values, top.indices, 32, torch.tensor(1), 33)
    assert int(count) == 33
    for node in range(1, 33):
        assert 0 <= parents[node] < node and depths[node] == depths[parents[node]] + 1, node
    chain = [n for n in range(33) if _node_path(tokens, parents, n) == tuple(range(10, 10 + int(depths[n])))]
    assert len(chain) == 8  # the root and the whole confident chain


def _node_path(tokens, parents, node):
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return tuple(reversed(path))


@pytest.mark.parametrize("seed", range(10))
def test_device_walk_equals_host_walk(seed):
    rng = np.random.default_rng(100 + seed)
    logprobs, ids = _top(rng, 5, 3)
    tokens, parents, depths, mask, count = build_tree_device(
        torch.tensor(logprobs), torch.tensor(ids), 20, torch.tensor(1), 24
    )
    host = build_tree(logprobs, ids, 20, root_token=1, rows=24)
    # target choices that follow the tree for a random number of steps, then leave it
    choices = torch.tensor(rng.integers(0, 60, size=24))
    node = 0
    for _ in range(int(rng.integers(0, 5))):
        kids = [i for i in range(int(count)) if int(parents[i]) == node and i > 0]
        if not kids:
            break
        child = kids[int(rng.integers(0, len(kids)))]
        choices[node] = tokens[child]
        node = child
    path, length, bonus = accept_greedy_device(tokens, parents, depths, mask, choices, 5)
    accepted = [int(tokens[i]) for i in path[1 : int(length)]]
    host_choices = [int(choices[_index(tokens, parents, host, i)]) for i in range(host.num_nodes)]
    host_path, host_bonus = follow_tree(host, host_choices)
    assert accepted == [int(host.tokens[i]) for i in host_path[1:]] and int(bonus) == host_bonus


def _index(tokens, parents, host, host_node):
    """The device row holding the host node's token path."""
    want = _node_path(host.tokens, host.parents, host_node)
    for row in range(len(tokens)):
        if _node_path(tokens, parents, row) == want and (row == 0 or parents[row] >= 0):
            return row
    raise AssertionError(want)


def test_tree_kernel_equals_tensor_op_build_under_the_interpreter():
    """runner/device/tree_kernel.py (the one-program Triton build used on GPUs) gives the tensor-op build's outputs."""
    done = run_interpreted("""
        import numpy as np, torch
        from runner.device.tree import build_tree_device
        from runner.device.tree_kernel import build_tree_kernel
        cases = [(int(d), int(b), int(k)) for d, b, k in np.random.default_rng(7).integers(1, [9, 34, 9], size=(20, 3))]
        cases += [(7, 32, 32), (15, 16, 4), (1, 1, 1), (7, 7, 1), (8, 64, 16), (3, 40, 40), (7, 32, 32), (7, 16, 8)]
        for seed, (depth, budget, k) in enumerate(cases):
            rng = np.random.default_rng(seed)
            k = min(k, budget)
            logits = rng.normal(size=(depth, 80)) * 2
            if seed >= len(cases) - 2:  # a confident drafter: log-probabilities of exactly 0, ties everywhere
                logits = np.zeros((depth, 80))
                logits[np.arange(depth), 10 + np.arange(depth)] = 30.0
            logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            if seed >= len(cases) - 2:  # in float32, as the step computes them: exactly 0 for the winners
                logprobs = torch.log_softmax(torch.tensor(logits, dtype=torch.float32), -1).double().numpy()
                assert (logprobs.max(-1) == 0).all()
            order = np.argsort(-logprobs, -1, kind="stable")[:, :k]
            top = torch.tensor(np.take_along_axis(logprobs, order, -1), dtype=torch.float32)
            ids = torch.tensor(order)
            rows = budget + 1 + seed % 3
            expected = build_tree_device(top, ids, budget, torch.tensor(3), rows, pad_token=9)
            got = build_tree_kernel(top, ids, budget, torch.tensor(3), rows, pad_token=9)
            for name, a, b in zip(("tokens", "parents", "depths", "mask", "count"), expected, got):
                assert a.dtype == b.dtype and torch.equal(a, b), (depth, budget, k, name, a, b)
            assert torch.equal(got[3], got[3].tril())  # parents first: what the TreeAttention kernel relies on
        print("ok", len(cases))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "28"


def test_batched_tree_kernel_builds_each_tree_as_the_tensor_op_build_under_the_interpreter():
    """`build_trees_kernel` (a batched step's trees in one launch, a program each) gives every tree the tensor-op
    build's outputs from its own candidates and root, at every batch size and shape tried (the programs read and
    write at their own offsets: a tree's neighbours change nothing)."""
    done = run_interpreted("""
        import numpy as np, torch
        from runner.device.tree import build_tree_device
        from runner.device.tree_kernel import build_trees_kernel
        cases = [(7, 8, 8, 16), (7, 32, 32, 3), (3, 16, 4, 5), (1, 1, 1, 2), (7, 7, 1, 4), (5, 20, 6, 3)]
        for seed, (depth, budget, k, trees) in enumerate(cases):
            rng = np.random.default_rng(seed)
            logits = torch.tensor(rng.normal(size=(trees, depth, 60)) * 2, dtype=torch.float32)
            if seed == 0:  # a confident drafter in one tree: ties everywhere there
                logits[1] = 0.0
                logits[1, torch.arange(depth), 10 + torch.arange(depth)] = 30.0
            top = torch.log_softmax(logits, -1).topk(k, dim=-1)
            roots = torch.tensor(rng.integers(0, 60, size=trees))
            rows = budget + 1 + seed % 2
            got = build_trees_kernel(top.values, top.indices, budget, roots, rows, pad_token=9)
            assert [tuple(t.shape) for t in got] == [(trees, rows)] * 3 + [(trees, rows, rows), (trees,)]
            for b in range(trees):
                want = build_tree_device(top.values[b], top.indices[b], budget, roots[b], rows, pad_token=9)
                for name, a, g in zip(("tokens", "parents", "depths", "mask", "count"), want,
                                      (*(t[b] for t in got[:4]), got[4][b : b + 1])):
                    assert a.dtype == g.dtype and torch.equal(a, g), (depth, budget, k, b, name, a, g)
        print("ok", len(cases))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "6"


def test_top_logprobs_kernel_equals_log_softmax_topk_under_the_interpreter():
    """The GPU draft top-k (two Triton kernels) equals torch's log_softmax + topk: values, indices and order; on
    ties the lower index comes first."""
    done = run_interpreted("""
        import torch
        from runner.device.tree_kernel import top_logprobs_kernel
        gen = torch.Generator().manual_seed(0)
        cases = ((7, 2500, 32, 512), (3, 777, 8, 256), (1, 64, 64, 2048), (2, 100, 5, 16), (7, 300, 1, 64))
        for rows, vocab, k, chunk in cases:
            logits = torch.randn(rows, vocab, generator=gen) * 3
            want = torch.log_softmax(logits, -1).topk(k, dim=-1)
            values, indices = top_logprobs_kernel(logits, k, chunk=chunk)
            assert torch.equal(indices, want.indices), (rows, vocab, k)
            assert (values - want.values).abs().max() < 1e-5, (rows, vocab, k)
        tied = torch.zeros(2, 300)
        tied[0, 250] = tied[1, 7] = 30.0  # as the oracle drafter's logits: one winner, the rest equal
        values, indices = top_logprobs_kernel(tied, 4, chunk=64)
        assert indices.tolist() == [[250, 0, 1, 2], [7, 0, 1, 2]], indices
        try:
            top_logprobs_kernel(tied, 301)
        except ValueError as err:
            assert "k=301" in str(err)
        else:
            raise AssertionError("k > vocab accepted")
        print("ok")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"
