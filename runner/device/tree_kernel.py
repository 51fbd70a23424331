"""The DDTree build of `runner/device/tree.py` as one Triton kernel (one program a tree; a batched step's trees in one
launch, `build_trees_kernel`), for CUDA tensors.

The tensor-op build launches ~90 small kernels (a top-k per depth, the global top-`budget`, the ordering, index
arithmetic and the ancestor mask); inside a step graph each costs a few microseconds. Here one program does all of
it: per depth the candidate scores (of the `budget x K`, only the ~budget * ln(budget) that can make the beam) are
packed with their index into order-preserving int64 keys and sorted (the first `budget` are the beam), the beams'
best `budget` are chosen the same way, ordered parents first, and the ancestor mask is built by walking the parent
links. Same outputs as the tensor-op build (the tests compare them under the Triton interpreter); ties between equal
scores may be broken differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(score):
    """fp32 -> int64 whose signed order is the float order (then room for 32 low bits)."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) << 32


@triton.jit
def _key_score(packed):
    key = (packed >> 32).to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _build_tree(
    top_lp, top_ids, root, tokens_out, parents_out, depths_out, mask_out, count_out,
    scratch, beam_score, beam_parent, beam_k, node_of,
    L: tl.constexpr, K: tl.constexpr, B: tl.constexpr, R: tl.constexpr, pad_token,
    KP: tl.constexpr, BP: tl.constexpr, LP: tl.constexpr, RP: tl.constexpr, NPAIRS: tl.constexpr, NP: tl.constexpr,
    SCR: tl.constexpr,
):  # fmt: skip
    NEG = float("-inf")
    # one program a tree: program b builds tree b of a batch (its inputs, outputs and scratch at b's offsets)
    b = tl.program_id(0)
    top_lp += b * (L * K)
    top_ids += b * (L * K)
    root += b
    tokens_out += b * R
    parents_out += b * R
    depths_out += b * R
    mask_out += b * (R * R)
    count_out += b
    scratch += b * SCR
    beam_score += b * (LP * BP)
    beam_parent += b * (LP * BP)
    beam_k += b * (LP * BP)
    node_of += b * (LP * BP)
    slot = tl.arange(0, BP)
    # depth 0: the K best tokens, padded to `budget` slots with -inf
    scores = tl.load(top_lp + slot, mask=slot < K, other=NEG)
    scores = tl.where(slot < B, scores, NEG)
    tl.store(beam_score + slot, scores)
    tl.store(beam_parent + slot, tl.zeros([BP], dtype=tl.int32))
    tl.store(beam_k + slot, tl.minimum(slot, K - 1))
    # the candidates that can reach a depth's top `budget`: parents and children are both sorted best first, so
    # (parent p, child c) is beaten by every (p' <= p, c' <= c), which also win ties (lower flat index): only pairs
    # with (p + 1) * (c + 1) <= budget can be among the best `budget` (~budget * ln(budget) of them, not
    # budget * K). Pair f of that staircase: row p = how many row ends lie at or before f, c = f - row start.
    rows_p = tl.arange(0, BP)
    counts = tl.where(rows_p < B, tl.minimum(K, B // (rows_p + 1)), 0)
    ends = tl.cumsum(counts, axis=0)  # pairs up to and including row p
    f = tl.arange(0, NP)
    before = ends[None, :] <= f[:, None]
    parent = tl.sum(before.to(tl.int32), axis=1)
    child = f - tl.max(tl.where(before, ends[None, :], 0), axis=1)
    pair_ok = f < NPAIRS
    flat = tl.where(pair_ok, parent * KP + child, BP * KP - 1)  # padding: a valid index, the lowest tie rank
    for depth in range(1, L):
        tl.debug_barrier()  # the previous depth's beam is in memory
        prev = tl.load(beam_score + (depth - 1) * BP + parent, mask=pair_ok, other=NEG)
        extra = tl.load(top_lp + depth * K + child, mask=pair_ok & (child < K), other=NEG)
        cand = tl.where(pair_ok, prev + extra, NEG)
        packed = tl.sort(_order_key(cand) | (BP * KP - 1 - flat).to(tl.int64), descending=True)
        tl.store(scratch + f, packed)
        tl.debug_barrier()
        best = tl.load(scratch + slot)  # the first `budget` of the sorted candidates
        tl.debug_barrier()
        index = BP * KP - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        scores = tl.where(slot < B, _key_score(best), NEG)
        tl.store(beam_score + depth * BP + slot, scores)
        tl.store(beam_parent + depth * BP + slot, index // KP)
        tl.store(beam_k + depth * BP + slot, index % KP)
    tl.debug_barrier()
    # the `budget` best of all beams
    pos = tl.arange(0, LP * BP)
    level, within = pos // BP, pos % BP
    every = tl.load(beam_score + pos, mask=level < L, other=NEG)
    every = tl.where(within < B, every, NEG)
    ranked = tl.sort(_order_key(every) | (LP * BP - 1 - pos).to(tl.int64), descending=True)
    tl.store(scratch + pos, ranked)
    tl.debug_barrier()
    best = tl.load(scratch + slot)
    tl.debug_barrier()
    chosen = LP * BP - 1 - (best & 0xFFFFFFFF).to(tl.int32)
    valid = (slot < B) & (_key_score(best) > NEG)
    # parents first: by depth, then by score (beam slots are score-sorted within a depth); invalid ones last
    order_key = tl.where(valid, chosen, chosen + LP * BP).to(tl.int64)
    ordered = tl.sort(tl.where(slot < B, order_key, 2 * LP * BP), descending=False)
    is_valid = ordered < LP * BP
    chosen = tl.where(is_valid, ordered, ordered - LP * BP).to(tl.int32)
    depth_of = chosen // BP
    node = slot + 1
    tl.store(node_of + tl.arange(0, LP * BP), tl.full([LP * BP], -1, tl.int32))
    tl.debug_barrier()
    tl.store(node_of + chosen, node, mask=is_valid & (slot < B))
    tl.debug_barrier()
    up = tl.load(beam_parent + chosen, mask=slot < B, other=0)
    parent_node = tl.load(node_of + (tl.maximum(depth_of - 1, 0) * BP + up), mask=slot < B, other=0)
    parent_node = tl.where(depth_of > 0, parent_node, 0)
    token = tl.load(top_ids + depth_of * K + tl.load(beam_k + chosen, mask=slot < B, other=0), mask=slot < B,
                    other=0)  # fmt: skip
    live = is_valid & (slot < B)
    row = slot + 1
    tl.store(tokens_out + row, tl.where(live, token, pad_token), mask=slot < B)
    tl.store(parents_out + row, tl.where(live, parent_node, -1).to(tl.int64), mask=slot < B)
    tl.store(depths_out + row, tl.where(live, depth_of + 1, 0).to(tl.int64), mask=slot < B)
    count = 1 + tl.sum(live.to(tl.int32), axis=0)
    tail = tl.arange(0, RP)
    rest = (tail > B) & (tail < R)
    tl.store(tokens_out + tail, tl.full([RP], 0, tl.int64) + pad_token, mask=rest)
    tl.store(parents_out + tail, tl.full([RP], -1, tl.int64), mask=rest | (tail == 0))
    tl.store(depths_out + tail, tl.zeros([RP], dtype=tl.int64), mask=rest | (tail == 0))
    tl.store(tokens_out + tail, tl.load(root + tail * 0, mask=tail == 0, other=0), mask=tail == 0)
    tl.store(count_out + tail, count.to(tl.int64) + tail * 0, mask=tail == 0)
    tl.debug_barrier()
    # ancestor-or-self mask of the real rows (rows < count)
    i = tl.arange(0, RP)[:, None]
    j = tl.arange(0, RP)[None, :]
    real = i < count
    mask = (i == j) & real
    up = tl.load(parents_out + tl.arange(0, RP), mask=tl.arange(0, RP) < R, other=-1)[:, None]
    for _ in range(L):
        alive = (up >= 0) & real
        mask = mask | (alive & (j == up))
        up = tl.where(alive, tl.load(parents_out + tl.maximum(up, 0), mask=alive, other=-1), -1)
    tl.store(mask_out + i * R + j, mask.to(tl.int8), mask=(i < R) & (j < R))


def build_tree_kernel(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, root: torch.Tensor,
                      rows: int, pad_token: int = 0):  # fmt: skip
    """Same contract as `device_tree.build_tree_device` (top_logprobs fp32 [L, K], K <= budget)."""
    tokens, parents, depths, mask, count = build_trees_kernel(top_logprobs[None], top_ids[None], budget,
                                                              root.reshape(-1)[:1], rows, pad_token)  # fmt: skip
    return tokens[0], parents[0], depths[0], mask[0], count


def build_trees_kernel(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, roots: torch.Tensor,
                       rows: int, pad_token: int = 0):  # fmt: skip
    """N trees in one launch, a program each (a batched step's, `runner/device/batch.py`: one launch for every slot,
    where one a slot took 6.6 µs each, 105 µs of a 16-slot step of 1.38 ms on one H100): top_logprobs fp32
    [N, L, K] and top_ids [N, L, K] (each tree's as `build_tree_kernel` takes them), roots [N]. Returns tokens,
    parents, depths [N, rows], mask [N, rows, rows] and counts [N]."""
    trees, depth_limit, width = top_logprobs.shape
    device = top_logprobs.device
    kp, bp = triton.next_power_of_2(width), triton.next_power_of_2(budget)
    lp, rp = triton.next_power_of_2(depth_limit), triton.next_power_of_2(rows)
    long = {"dtype": torch.long, "device": device}
    tokens, parents, depths = (torch.empty(trees, rows, **long) for _ in range(3))
    mask, count = torch.empty(trees, rows, rows, dtype=torch.bool, device=device), torch.empty(trees, **long)
    pairs = sum(min(width, budget // (p + 1)) for p in range(budget))  # the candidate staircase (see the kernel)
    np_ = triton.next_power_of_2(pairs)
    scr = max(np_, lp * bp)  # each tree's scratch
    scratch = torch.empty(trees * scr, dtype=torch.int64, device=device)
    beam_score = torch.empty(trees * lp * bp, dtype=torch.float32, device=device)
    beam_parent, beam_k = (torch.empty(trees * lp * bp, dtype=torch.int32, device=device) for _ in range(2))
    node_of = torch.empty(trees * lp * bp, dtype=torch.int32, device=device)
    _build_tree[(trees,)](top_logprobs.float().contiguous(), top_ids.contiguous(), roots.to(torch.long).contiguous(),
                          tokens, parents, depths, mask.view(torch.int8), count, scratch, beam_score, beam_parent,
                          beam_k, node_of, L=depth_limit, K=width, B=budget, R=rows, pad_token=pad_token, KP=kp, BP=bp,
                          LP=lp, RP=rp, NPAIRS=pairs, NP=np_, SCR=scr, num_warps=4)  # fmt: skip
    return tokens, parents, depths, mask, count


@triton.jit
def _chunk_top(logits, row_stride, V, cand, part_max, part_sum, KP: tl.constexpr, CH: tl.constexpr):
    """Program (row, chunk): the chunk's KP best logits (packed with their index, best first), its max and the sum
    of exp(logit - max)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    chunks = tl.num_programs(1)
    offs = chunk * CH + tl.arange(0, CH)
    ok = offs < V
    x = tl.load(logits + row * row_stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    tl.store(part_max + row * chunks + chunk, m)
    tl.store(part_sum + row * chunks + chunk, tl.sum(tl.where(ok, tl.exp(x - m), 0.0), axis=0))
    packed = _order_key(x) | tl.where(ok, V - 1 - offs, 0).to(tl.int64)  # ties: the lower index first
    tl.store(cand + (row * chunks + chunk) * KP + tl.arange(0, KP), tl.topk(packed, KP))


@triton.jit
def _merge_top(cand, part_max, part_sum, values, indices, V, chunks, K: tl.constexpr, KP: tl.constexpr,
               NC: tl.constexpr, NCAND: tl.constexpr):  # fmt: skip
    """Program row: log-sum-exp of the chunks, then the K best of all chunks' candidates as log-probabilities."""
    row = tl.program_id(0)
    c = tl.arange(0, NC)
    m = tl.load(part_max + row * chunks + c, mask=c < chunks, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    s = tl.load(part_sum + row * chunks + c, mask=c < chunks, other=0.0)
    lse = m_max + tl.log(tl.sum(tl.where(c < chunks, s * tl.exp(m - m_max), 0.0), axis=0))
    i = tl.arange(0, NCAND)
    packed = tl.load(cand + row * chunks * KP + i, mask=i < chunks * KP, other=-(2**63) + 1)
    best = tl.topk(packed, KP)
    j = tl.arange(0, KP)
    tl.store(values + row * K + j, _key_score(best) - lse, mask=j < K)
    tl.store(indices + row * K + j, (V - 1 - (best & 0xFFFFFFFF)).to(tl.int64), mask=j < K)


def top_logprobs_kernel(logits: torch.Tensor, k: int, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits).topk(k) of every row (values fp32 best first, int64 indices; ties: the lower index), in
    two kernels instead of torch's ~23: per chunk of the vocabulary its k best and its exp-sum, then per row the
    merge."""
    rows, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k needs 1 <= k <= vocab ({vocab}), got k={k}")
    device = logits.device
    kp = max(2, triton.next_power_of_2(k))  # tl.topk needs k >= 2: keep 2 a chunk, return the first k
    chunk = max(min(chunk, triton.next_power_of_2(vocab)), kp)
    chunks = triton.cdiv(vocab, chunk)
    cand = torch.empty(rows * chunks * kp, dtype=torch.int64, device=device)
    part_max = torch.empty(rows * chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows * chunks, dtype=torch.float32, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=device)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _chunk_top[(rows, chunks)](logits, logits.stride(0), vocab, cand, part_max, part_sum, KP=kp, CH=chunk,
                               num_warps=4)  # fmt: skip
    _merge_top[(rows,)](cand, part_max, part_sum, values, indices, vocab, chunks, K=k, KP=kp,
                        NC=max(2, triton.next_power_of_2(chunks)), NCAND=triton.next_power_of_2(chunks * kp),
                        num_warps=4)  # fmt: skip
    return values, indices
