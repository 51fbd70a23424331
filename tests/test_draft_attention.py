"""The drafter's GPU attention kernel (models/draft_attention_kernel.py) against a float64 softmax over exactly the
keys a draft sees (valid cached rows, valid context rows, the block), under the Triton interpreter."""

import pytest
import torch

from tests.interpreter import run_interpreted


def reference(q, cache, length, k_new, v_new, context_rows, count, scale):
    """q [KV, R, D], cache [2, S, KV, D], k_new / v_new [C + B, KV, D] -> [KV, R, D] float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for g in range(q.shape[0]):
        keys = torch.cat([cache[0, :length, g], k_new[:count, g], k_new[context_rows:, g]]).double()
        values = torch.cat([cache[1, :length, g], v_new[:count, g], v_new[context_rows:, g]]).double()
        out[g] = torch.softmax(q[g].double() @ keys.T * scale, dim=-1) @ values
    return out


def random_case(kv, groups, blocks, context_rows, capacity, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(kv, groups * blocks, dim, generator=gen)
    cache = torch.randn(2, capacity, kv, dim, generator=gen)
    new = context_rows + blocks
    k_new = torch.randn(new, kv, dim, generator=gen)
    wide = torch.randn(new, kv * dim + 24, generator=gen)  # v rows strided, as split from the fused qkv GEMM
    v_new = wide[:, 24:].view(new, kv, dim)
    return q, cache, k_new, v_new


# (KV heads, query heads a KV head, block rows, context rows, capacity, head dim, cached rows, valid context rows)
CASES = [
    (1, 8, 8, 8, 128, 32, 0, 0),  # a first step: nothing cached, no context: the block alone
    (1, 8, 8, 8, 128, 32, 5, 3),
    (1, 8, 8, 8, 128, 32, 100, 8),
    (2, 4, 8, 4, 1024, 32, 300, 2),  # two KV heads, a short cache in a large capacity
    (1, 2, 4, 8, 640, 16, 600, 5),  # > 16 splits with 64 "SMs"
]


def test_draft_attention_kernel_matches_reference_under_the_interpreter():
    script = f"""
        import torch
        from models import draft_attention_kernel as dk
        from tests.test_draft_attention import random_case, reference
        worst = 0.0
        for i, (kv, groups, blocks, ctx, cap, dim, length, count) in enumerate({CASES!r}):
            for sms, min_blocks in ((4, 1), (64, 1), (4, 3)):
                dk._sm_count = lambda device: sms
                q, cache, k_new, v_new = random_case(kv, groups, blocks, ctx, cap, dim, seed=i)
                out = dk.draft_attention_cuda(q, cache, torch.tensor([length]), k_new, v_new, ctx,
                                              torch.tensor([count]), 0.3, block_m=16, block_n=16, num_warps=1,
                                              num_stages=1, min_blocks=min_blocks)
                expected = reference(q, cache, length, k_new, v_new, ctx, count, 0.3)
                assert out.shape == q.shape and not out.isnan().any()
                worst = max(worst, float((out.double() - expected).norm() / expected.norm()))
        print("worst", worst)
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-5


def test_draft_attention_refuses_mismatched_inputs():
    from models.draft_attention_kernel import draft_attention_cuda

    q, cache, k_new, v_new = random_case(1, 8, 8, 8, 64, 32, seed=0)
    with pytest.raises(ValueError, match="disagree on KV heads / head dim"):
        draft_attention_cuda(q, cache[:, :, :, :16], torch.tensor([3]), k_new, v_new, 8, torch.tensor([2]), 0.3)
    with pytest.raises(ValueError, match=r"context_rows must be in \[0, 16\]"):
        draft_attention_cuda(q, cache, torch.tensor([3]), k_new, v_new, 17, torch.tensor([2]), 0.3)
    with pytest.raises(ValueError, match="each K/V row's heads must be contiguous"):
        strided = torch.randn(16, 1, 64)[..., ::2]
        draft_attention_cuda(q, cache, torch.tensor([3]), strided, v_new, 8, torch.tensor([2]), 0.3)


def test_drafter_with_the_kernel_equals_the_torch_form_under_the_interpreter(demo_ckpt):
    """The whole drafter with its attention through the kernel (as on GPUs: heads folded, kernel, unfolded) gives the
    torch form's logits and context K/V: a draft after earlier ones (cached rows) with 3 of 8 context rows valid."""
    script = f"""
        import torch
        from models.loader import load_rank_models
        from models.ops import ModelOps
        from models.parallel import SingleRank
        from plugins.tree_attention.reference import tree_attention
        from tests.interpreter import use_small_draft_kernel
        _, _, drafter = load_rank_models({str(demo_ckpt(1))!r}, 0, ModelOps(tree_attention, SingleRank()))
        d = drafter.layers[0].self_attn
        gen = torch.Generator().manual_seed(5)
        context = torch.randn(8, drafter.fc.weight.shape[1], generator=gen)
        cache = torch.randn(len(drafter.layers), 2, 64, d.kv_heads, d.head_dim, generator=gen)
        block = torch.tensor([17] + [3] * 7)
        positions, block_positions = torch.arange(30, 38), torch.arange(33, 41)
        args = (context, positions, torch.tensor([3]), block, block_positions, cache, torch.tensor([30]))
        with torch.no_grad():
            torch_logits, torch_kv = drafter(*args)
            use_small_draft_kernel()
            logits, kv = drafter(*args)
        print("diff", float((logits - torch_logits).norm() / torch_logits.norm()), float((kv - torch_kv).norm()))
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logits_diff, kv_diff = (float(v) for v in done.stdout.split()[-2:])
    assert logits_diff < 1e-5 and kv_diff == 0.0


def test_draft_attention_kernel_batches_requests_each_as_its_own_launch():
    """Several requests' blocks in one launch (batched steps): each request's cache a row of the slots' caches (NaN
    past its length), its own lengths, its context rows a share of the context part and its block a share of the
    block part; each request's output equals a launch of its own bit for bit, and the reference's."""
    script = """
        import torch
        from models import draft_attention_kernel as dk
        from tests.test_draft_attention import random_case, reference
        dk._sm_count = lambda device: 8
        kv, groups, blocks, ctx, capacity, dim = 2, 4, 8, 8, 96, 16
        lengths, counts = [0, 40, 96], [0, 3, 8]
        cases = [random_case(kv, groups, blocks, ctx, capacity, dim, seed=i) for i in range(3)]
        slots = torch.full((3, 3, 2, capacity, kv, dim), float("nan"))
        for r, (_, cache, _, _) in enumerate(cases):
            slots[r, 1, :, : lengths[r]] = cache[:, : lengths[r]]
        k_new = torch.cat([c[2][:ctx] for c in cases] + [c[2][ctx:] for c in cases])
        v_new = torch.cat([c[3][:ctx] for c in cases] + [c[3][ctx:] for c in cases])
        q = torch.stack([c[0] for c in cases])
        config = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)
        out = dk.draft_attention_cuda(q, slots[:, 1], torch.tensor(lengths), k_new, v_new, 3 * ctx,
                                      torch.tensor(counts), 0.3, **config)
        assert out.shape == q.shape and not out.isnan().any()
        worst, same = 0.0, True
        for r, (qr, cache, kr, vr) in enumerate(cases):
            alone = dk.draft_attention_cuda(qr, slots[r, 1], torch.tensor([lengths[r]]), kr, vr, ctx,
                                            torch.tensor([counts[r]]), 0.3, **config)
            same &= torch.equal(out[r], alone)
            expected = reference(qr, cache, lengths[r], kr, vr, ctx, counts[r], 0.3)
            worst = max(worst, float((out[r].double() - expected).norm() / expected.norm()))
        print("same", same, "worst", worst)
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same True" in done.stdout, done.stdout
    assert float(done.stdout.split()[-1]) < 1e-5
