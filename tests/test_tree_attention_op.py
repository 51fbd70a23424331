"""TreeAttention: every implementation against the torch reference (the oracle), on fresh random inputs.

Tolerances by dtype: float32 1e-5 relative (the GPU kernel's bf16 tolerance, 1e-2, is checked on the H200 by
benchmarks/tree_attention_gpu.py). The Triton kernel runs here under the Triton interpreter (TRITON_INTERPRET=1).
"""

import numpy as np
import pytest
import torch

from plugins.tree_attention.reference import tree_attention
from tests.interpreter import run_interpreted

TOLERANCE = {torch.float32: 1e-5}
# (tokens, heads, capacity, length, latent, rope): empty cache, spare capacity, one token, odd sizes, a short cache in
# a large capacity (most splits unused), a full one
SHAPES = [(3, 2, 10, 7, 32, 8), (5, 4, 70, 66, 32, 8), (33, 2, 0, 0, 64, 16), (1, 8, 40, 40, 32, 8),
          (8, 2, 100, 100, 32, 16), (17, 3, 9, 0, 32, 8), (5, 4, 400, 37, 32, 8), (2, 2, 300, 300, 32, 8)]  # fmt: skip


def random_case(tokens, heads, capacity, length, latent, rope, seed):
    gen = torch.Generator().manual_seed(seed)
    width = latent + rope
    mask = torch.eye(tokens, dtype=torch.bool)
    for node in range(1, tokens):
        mask[node] |= mask[int(torch.randint(0, node, (1,), generator=gen))]
    return (torch.randn(tokens, heads, width, generator=gen), torch.randn(capacity, width, generator=gen),
            torch.tensor([length]), torch.randn(tokens, width, generator=gen), mask)  # fmt: skip


def rel(a, b):
    return float((torch.as_tensor(a).double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def batched_against_alone(config: dict) -> tuple[bool, float]:
    """Several requests in one kernel launch (run under the interpreter): each request's cache a layer of its own
    slot's caches (a strided view of [slots, layers, S, D], NaN past its length), with its own length, tree mask and
    rows. Returns whether each request's rows equal a launch of its own bit for bit, and the worst relative error
    against the reference."""
    from plugins.tree_attention.kernel import tree_attention_cuda

    tokens, heads, capacity, width, latent = 9, 2, 80, 40, 32
    lengths = [0, 37, 80, 5]
    cases = [random_case(tokens, heads, capacity, n, latent, width - latent, seed=i) for i, n in enumerate(lengths)]
    slots = torch.full((len(lengths), 3, capacity, width), float("nan"))
    for b, (_, cache, _, _, _) in enumerate(cases):
        slots[b, 1, : lengths[b]] = cache[: lengths[b]]
    q, new_kv = torch.cat([c[0] for c in cases]), torch.cat([c[3] for c in cases])
    masks = torch.stack([c[4] for c in cases])
    out = tree_attention_cuda(q, slots[:, 1], torch.tensor(lengths), new_kv, masks, 0.3, latent, **config)
    assert not out.isnan().any()
    worst, same = 0.0, True
    for b, (qb, cache, cached, kv, mask) in enumerate(cases):
        alone = tree_attention_cuda(qb, slots[b, 1], cached, kv, mask, 0.3, latent, **config)
        same &= torch.equal(out[b * tokens : (b + 1) * tokens], alone)
        expected = tree_attention(qb.double(), cache.double(), cached, kv.double(), mask, 0.3, latent)
        worst = max(worst, rel(out[b * tokens : (b + 1) * tokens], expected))
    return same, worst


def test_reference_matches_dense_masked_softmax():
    q, cache, length, new_kv, mask = random_case(6, 3, 20, 13, 32, 8, seed=1)
    keys = torch.cat((cache[:13], new_kv)).double()
    visible = torch.cat((torch.ones(6, 13, dtype=torch.bool), mask), 1)
    scores = torch.einsum("thd,kd->thk", q.double(), keys) * 0.3
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1)
    expected = torch.einsum("thk,kc->thc", probs, keys[:, :32])
    assert rel(tree_attention(q, cache, length, new_kv, mask, 0.3, 32), expected) < TOLERANCE[torch.float32]


def test_rows_that_see_nothing_are_zero():
    q, cache, _, new_kv, mask = random_case(4, 2, 5, 0, 32, 8, seed=2)
    mask[2] = False
    out = tree_attention(q, cache, torch.tensor([0]), new_kv, mask, 0.3, 32)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and not out.isnan().any()


@pytest.mark.parametrize("shape", SHAPES)
def test_onnx_runtime_op_matches_reference(shape):
    from plugins.tree_attention.ort_op import tree_attention_numpy

    q, cache, length, new_kv, mask = random_case(*shape, seed=sum(shape))
    expected = tree_attention(q.double(), cache.double(), length, new_kv.double(), mask, 0.25, shape[4])
    got = tree_attention_numpy(q.numpy(), cache.numpy(), length.numpy(), new_kv.numpy(), mask.numpy(), 0.25, shape[4])
    assert got.dtype == np.float32 and rel(got, expected) < TOLERANCE[torch.float32]


def test_triton_kernel_matches_reference_under_the_interpreter():
    """Every shape at two split sizes and two SM counts, then the merge of the splits' partial results in its other
    forms (fewer columns a program, other numbers of splits loaded at a time, a split count given): the reference's
    result, and no row left unwritten."""
    script = f"""
        import torch
        from plugins.tree_attention.kernel import tree_attention_cuda
        from plugins.tree_attention.reference import tree_attention
        from tests.test_tree_attention_op import random_case, rel
        worst = 0.0
        from plugins.tree_attention import kernel
        cases = [(shape, dict(min_blocks=min_blocks), sms) for shape in {SHAPES!r} for min_blocks in (1, 3)
                 for sms in (4, 64)]
        merges = [dict(combine_columns=8, split_group=4), dict(combine_columns=16, split_group=2, splits=5),
                  dict(splits=1), dict(split_group=32, splits=9)]
        merged = [(1, 8, 300, 290, 32, 8), (8, 2, 100, 100, 32, 16)]
        cases += [(shape, dict(min_blocks=1, **form), 4) for shape in merged for form in merges]
        for i, (shape, form, sms) in enumerate(cases):  # a split takes >= min_blocks key blocks of 16
            kernel._sm_count = lambda device: sms  # 64 "SMs": more than 8 splits, the combine loops over groups
            q, cache, length, new_kv, mask = random_case(*shape, seed=i)
            out = torch.full((shape[0], shape[1], shape[4]), float("nan"))
            tree_attention_cuda(q, cache, length, new_kv, mask, 0.3, shape[4], out=out, block_m=16, block_n=16,
                                num_warps=1, num_stages=1, **form)
            expected = tree_attention(q.double(), cache.double(), length, new_kv.double(), mask, 0.3, shape[4])
            assert not out.isnan().any(), (shape, form)
            worst = max(worst, rel(out, expected))
        print("worst", worst)
    """
    done = run_interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE[torch.float32]


def test_triton_kernel_whole_blocks_and_tensor_descriptors_match_the_reference():
    """The forms that take a split's whole key blocks without masks, by pointer loads, by tensor descriptors and with
    every product keys-major (its partial last block and the tree's rows masked): the reference's result on every
    shape (rows past the device length NaN: never read), and several requests batched over strided slot caches equal
    to a launch each."""
    script = f"""
        import torch
        from plugins.tree_attention.kernel import tree_attention_cuda
        from plugins.tree_attention.reference import tree_attention
        from tests.test_tree_attention_op import batched_against_alone, random_case, rel
        from plugins.tree_attention import kernel
        kernel._sm_count = lambda device: 4
        worst, same = 0.0, True
        for form in (dict(tma=False), dict(tma=True), dict(keys_major=True), dict(keys_major=True, tma=True)):
            config = dict(block_m=16, block_n=16, num_warps=1, num_stages=1, min_blocks=3, whole_blocks=True, **form)
            for i, shape in enumerate({SHAPES!r}):
                q, cache, length, new_kv, mask = random_case(*shape, seed=i)
                expected = tree_attention(q.double(), cache.double(), length, new_kv.double(), mask, 0.3, shape[4])
                cache[int(length):] = float("nan")
                out = torch.full((shape[0], shape[1], shape[4]), float("nan"))
                tree_attention_cuda(q, cache, length, new_kv, mask, 0.3, shape[4], out=out, **config)
                assert not out.isnan().any(), (shape, form)
                worst = max(worst, rel(out, expected))
            batch_same, batch_worst = batched_against_alone(config)
            same, worst = same and batch_same, max(worst, batch_worst)
        print("same", same, "worst", worst)
    """
    done = run_interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same True" in done.stdout, done.stdout
    assert float(done.stdout.split()[-1]) < TOLERANCE[torch.float32]


def test_triton_kernel_causal_prefill_skips_hidden_blocks_exactly():
    """A causal prefill (after a cached prefix, and with none): the kernel stops at the key block of a row tile's
    last token (parents first: no row sees a later one); the result is still the reference's."""
    script = """
        import torch
        from plugins.tree_attention.kernel import tree_attention_cuda
        from plugins.tree_attention.reference import tree_attention
        from tests.test_tree_attention_op import random_case, rel
        worst = 0.0
        for i, (tokens, capacity, length) in enumerate([(70, 0, 0), (45, 64, 20)]):
            q, cache, cached, new_kv, _ = random_case(tokens, 2, capacity, length, 32, 8, seed=i)
            mask = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
            out = torch.full((tokens, 2, 32), float("nan"))
            tree_attention_cuda(q, cache, cached, new_kv, mask, 0.3, 32, out=out, block_m=16, block_n=16,
                                num_warps=1, num_stages=1)
            expected = tree_attention(q.double(), cache.double(), cached, new_kv.double(), mask, 0.3, 32)
            assert not out.isnan().any()
            worst = max(worst, rel(out, expected))
        print("worst", worst)
    """
    done = run_interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE[torch.float32]


def test_triton_kernel_reads_no_cache_row_past_the_device_length():
    """A cache's rows from the device length on are never read (they are NaN here): a prefill graph captured over one
    cache replays for a batch slot's prefill from row 0 (`runner/sessions/cuda_graphs.py`), whose rows it must not
    see, and a verify never sees rows past its request's length."""
    script = """
        import torch
        from plugins.tree_attention.kernel import tree_attention_cuda
        from plugins.tree_attention.reference import tree_attention
        from tests.test_tree_attention_op import random_case, rel
        worst = 0.0
        for i, (tokens, capacity, length) in enumerate([(24, 96, 0), (33, 96, 0), (9, 96, 37)]):
            q, cache, cached, new_kv, _ = random_case(tokens, 2, capacity, length, 32, 8, seed=i)
            mask = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
            expected = tree_attention(q.double(), cache.double(), cached, new_kv.double(), mask, 0.3, 32)
            cache[length:] = float("nan")
            out = torch.full((tokens, 2, 32), float("nan"))
            tree_attention_cuda(q, cache, cached, new_kv, mask, 0.3, 32, out=out, block_m=16, block_n=16,
                                num_warps=1, num_stages=1)
            assert not out.isnan().any(), (tokens, length)
            worst = max(worst, rel(out, expected))
        print("worst", worst)
    """
    done = run_interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE[torch.float32]


def test_triton_kernel_batches_requests_each_as_its_own_launch():
    """Several requests in one launch (batched steps): each request's cache is a layer of its own slot's caches
    (a strided view of [slots, layers, S, D], NaN past its length), with its own length, tree mask and rows; each
    request's rows equal a launch of its own bit for bit (the same splits), and the reference's."""
    script = """
        from plugins.tree_attention import kernel
        from tests.test_tree_attention_op import batched_against_alone
        kernel._sm_count = lambda device: 8
        same, worst = batched_against_alone(dict(block_m=16, block_n=16, num_warps=1, num_stages=1))
        print("same", same, "worst", worst)
    """
    done = run_interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same True" in done.stdout, done.stdout
    assert float(done.stdout.split()[-1]) < TOLERANCE[torch.float32]


def test_kernel_forms_compile_for_hopper_within_a_block(tmp_path, monkeypatch):
    """The split kernel's forms the launcher takes at the decode and verify shapes, compiled for sm_90 ahead of time
    (`benchmarks/kernel_resources.py`, no GPU): each fits a Hopper block's shared memory, multiplies on tensor cores
    and pipelines its cache loads (asynchronous copies), as the JIT compiles them on the GPU; the 16x16 forms the
    interpreter tests run say nothing of these."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from benchmarks.kernel_resources import SHAPES, measure

    for shape in SHAPES:
        row = measure(*shape)
        assert row["fits_a_block"], row
        assert row["wgmma"] + row["mma_sync"] > 0, row
        assert row["cp_async"] + row["tma_loads"] > 0, row
    assert row["form"]["tma"] and row["tma_loads"] > 0, row  # T = 33 at 16 heads: whole blocks by descriptors
