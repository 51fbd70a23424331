"""W4A16 MoE in CUDA C compiled at first use by NVRTC: one token (a decode's routed experts, two launches) and a
block of tokens (a draft block's, a verify's: `int4_moe_block`, below).

A decode step's token chooses k distinct experts, so each chosen expert's packed words are read exactly once: a GEMV
whose floor is the time to stream the bytes. Measured (`benchmarks/int4_token_probe.py`, BENCHMARKS.md section 8),
the time goes to the multiplies on the CUDA cores more than to the loads (a one-launch form, since removed: 33.9 us
of kernel time on one H100, 14.7 us with its math left out). So the forms here issue a row's 16-byte loads and
scales before its first multiply and spend as few instructions a weight as they can, over many warps.

Layout: the "rows" words (`kernel.repack_rows`: nibble j of word w holds input j * words + w), scales bfloat16,
x bfloat16, routing weights float32, expert ids int32 or int64 (the router's, read as they come).

"split" (what runs: `GATE_FORM`):
1. `gate_up_split` (block: one warp a 16-byte chunk c of a row, RPB (pair, row)s of gate and of up). Lane l reads
   chunk l + 32 c of each row (words 4 (l + 32 c) .. + 3). Nibble j of those four words holds inputs j * words +
   4 (l + 32 c) .. + 3, all in one group (group | 4, 4 | words): the lane sums four products (one lop3 and one fma a
   weight, the nibble's bias taken off the four inputs' sum: `nibble_dot_biased`) and adds them times the group's
   scale; its x slice stays in registers for the block's rows. Each warp's lanes are summed by a butterfly (a fixed
   order), the warps in chunk order; silu(gate) * up of each row, rounded to bfloat16, goes into act [k, width].
2. `down` (block: 8 warps; warp: ROWS output rows). Lane l takes expert l / (32 / k) and a slice of its act
   (words of that slice, every nibble: 8 x slice-words inputs), held in registers for all of the warp's rows; per
   row it loads its slice's words (16 bytes at a time) and the slice's scales, sums, multiplies by its pair's
   routing weight; the butterfly sums experts and slices; lane 0 writes the row in bfloat16.

"mma" (`launch(..., gate_form="mma")`): `gate_up_mma` and `down_mma`, the multiplies on tensor cores (mma.sync
m16n8k16, bfloat16 fragments made from the words by one lop3 and two bfloat16 fmas a pair of weights, float32 sums),
fewer instructions a weight than the split form (sm_90 SASS). Their computation is checked on the CPU fragment by
fragment (`algorithm_mma`); on one H100 they took as long as the split form, so it is not the default.

"bulk" (`launch(..., gate_form="bulk")`, `token_bulk`): the same two computations in one launch, a block an SM.
Each block asks the TMA unit for all of its share at once (its row pairs of gate and up, and its rows of down for
every chosen expert: about 190 KB of shared memory at Kimi K2.x's per-rank dimensions), multiplies each pair as its
copies land, waits for every block's act (a grid-wide arrival counter), then computes its down rows from shared memory,
so down's bytes are read while gate/up computes and there is one launch instead of two. Its sums are the split
form's, in its order (the same bits: the GPU test checks it; `algorithm` is its computation too). Where it does not
fit (`token_bulk_fits`: sm_90, the rows aligned and contiguous, one group a lane's down words) the split form runs.
Measured on one H100 it is 1.55x slower than the split form (its copies alone take 1.53x the byte floor, and its
multiplies on one block an SM are not hidden behind them): not the default (BENCHMARKS.md, section 8).

A block of T tokens (`int4_moe_block`, the pairs sorted by expert by `kernel.route`): `gate_up_mma_bulk` (persistent
blocks, one an SM, each taking a contiguous run of the chosen experts' 8-row tiles of gate and up, the runs even in work
whatever the routing (a tile's work: its expert's passes of 8 tokens), mostly one or two experts a block, whose tokens'
x stays in L1; BALANCE = 0: CHUNK consecutive tiles at a time from a queue instead; the next tile's rows of words and
scales copied into shared memory by the TMA unit (one-dimensional bulk copies, an mbarrier a stage) while the current
one is multiplied by up to 8 of its expert's tokens a pass: the MMA's columns; `gate_up_mma_stream` is the same by
cp.async with the tiles strided over the grid, `gate_up_mma_tokens` a block a tile), `down_mma_stream` (persistent
warps, 16 rows of one expert a task, DCHUNK tasks at a time from a queue, the next ones copied in by cp.async, into each
pair's own float32 row; `down_mma_tokens` a block 8 tasks) and `sum_pairs` (each token's k rows in a fixed order). Every
form of a kernel adds the same products in the same order: the same bits. `block_forms` picks the forms a GPU and the
tensors allow (bulk copies need sm_90; each persistent form needs its shared memory and aligned rows).
`algorithm_mma_block` is that computation fragment by fragment in torch.

`algorithm` is the split form's computation in torch, lane by lane (the same chunks, nibbles, groups and
butterflies), so the kernels' index arithmetic is checked against the reference on a CPU (tests/test_int4_moe.py);
a GPU test checks the compiled kernels themselves.
"""

from __future__ import annotations

import torch

LANES = 32
WARPS = 8  # warps a block, both kernels
# the best of `benchmarks/int4_token_probe.py`'s shapes on one H100 (BENCHMARKS.md, section 8)
DOWN_ROWS = 4  # output rows a down warp computes
RPB = 4  # gate/up row pairs a `gate_up_split` block computes
SPLIT_MIN_BLOCKS = 2  # `gate_up_split` blocks an SM the compiler keeps registers for (128 a thread)
STAGES = 2  # `gate_up_mma_stream`, `gate_up_mma_bulk`: tiles in shared memory a block (multiplied, being copied)
PARTS = 2  # `gate_up_mma_stream`, `gate_up_mma_bulk`: passes' column sums in shared memory (2: one barrier a pass)
# `gate_up_mma_bulk`: 1 shares the tiles out by their work before the first copy (a contiguous run a block, counted
# by its loop), 0 takes them from the queue (CHUNK at a time); on one H100 the runs took 274.0 against 300.2 us at
# T = 33 with random routing, 228.6 against 247.3 skewed (BENCHMARKS.md section 8)
BALANCE = 1
CHUNK = 4  # `gate_up_mma_bulk` with BALANCE = 0: tiles a block takes from the queue at a time
DOWN_CHUNK = 4  # `down_mma_stream`: tasks a warp takes from the queue at a time
DOWN_STAGES = 4  # `down_mma_stream`: tasks in shared memory a warp
DOWN_WARPS = 16  # `down_mma_stream`: warps a block
DOWN_BLOCKS = 1  # `down_mma_stream`: blocks an SM (the grid, and the registers the compiler may take)
TOKEN_BULK_ROWS = 2  # `token_bulk`: down rows a warp at a time (at 4 the compiler spills: 14 warps leave 128 registers)

SOURCE = r"""
typedef unsigned short bf16;
typedef IDS_T id_t;

__device__ __forceinline__ float from_bf16(bf16 h) { return __int_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ bf16 to_bf16(float f) {  // round to nearest even (finite values)
    unsigned u = __float_as_uint(f);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// (src & (0xF << P)) | exponent bits in one lop3: the mask an immediate, the exponent a register (a lop3 takes one
// immediate; written in C, the compiler spends a second lop3 on the other constant)
template <int P>
__device__ __forceinline__ float raw_at(unsigned src) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(src), "n"(0xFu << P), "r"((150u - P) << 23));
    return __uint_as_float(r);
}

// sum over the four words of (nibble J - 8) * x, with one add a weight fewer than unpacking each: the nibble, at bit
// P (8, 12 or 16) of the word, of the word << 8 or of the word >> 12, read as 2^(23 - P) + value (exact), the four
// products summed (exact below P = 8; at P = 8 rounded at 2^-7 of x), then (2^(23 - P) + 8) times the four inputs'
// sum `x_sum` taken off once
template <int J>
__device__ __forceinline__ float nibble_dot_biased(uint4 w, float4 x, float x_sum) {
    constexpr int P = J == 0 || J == 2 || J == 5 ? 8 : (J == 1 || J == 3 || J == 6 ? 12 : 16);
    constexpr float BIAS = (float)((1 << (23 - P)) + 8);
#define RAW(W) raw_at<P>(J < 2 ? (W) << 8 : (J < 5 ? (W) : (W) >> 12))
    float s = RAW(w.x) * x.x;
    s = fmaf(RAW(w.y), x.y, s);
    s = fmaf(RAW(w.z), x.z, s);
    s = fmaf(RAW(w.w), x.w, s);
#undef RAW
    return fmaf(-BIAS, x_sum, s);
}

// sum of j's products for J = 0 .. 7, the loops unrolled (a template argument for each nibble)
#define FOR_NIBBLES(BODY) BODY(0) BODY(1) BODY(2) BODY(3) BODY(4) BODY(5) BODY(6) BODY(7)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// the split forms' pieces, shared by `gate_up_split` / `down` and `token_bulk` (the same sums: the same bits)
// a gate/up lane's x slice at word w: nibble j's four inputs j * WORDS_IN + w .. + 3, and their sum
__device__ __forceinline__ void x_slice(const bf16* __restrict__ x, int w, float4 (&xv)[8], float (&x_sum)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint2 two = __ldg((const uint2*)(x + j * WORDS_IN + w));
        xv[j] = make_float4(__uint_as_float(two.x << 16), __uint_as_float(two.x & 0xFFFF0000u),
                            __uint_as_float(two.y << 16), __uint_as_float(two.y & 0xFFFF0000u));
        x_sum[j] = (xv[j].x + xv[j].y) + (xv[j].z + xv[j].w);
    }
}

// gate's and up's sums over a warp's 16-byte chunk of one row pair: each lane's words g, u and its scales a nibble
// (sg[j], su[j]: registers, or shared memory through `Spaced`), the lanes summed by the butterfly
template <class Scales>
__device__ __forceinline__ float2 chunk_sums(uint4 g, uint4 u, const Scales& sg, const Scales& su,
                                             const float4 (&xv)[8], const float (&x_sum)[8]) {
    float acc_g[2] = {0.0f, 0.0f}, acc_u[2] = {0.0f, 0.0f};  // even and odd nibbles: two chains
#define GATE_UP(J) {                                                                                                \
    acc_g[J & 1] = fmaf(from_bf16(sg[J]), nibble_dot_biased<J>(g, xv[J], x_sum[J]), acc_g[J & 1]);                   \
    acc_u[J & 1] = fmaf(from_bf16(su[J]), nibble_dot_biased<J>(u, xv[J], x_sum[J]), acc_u[J & 1]); }
    FOR_NIBBLES(GATE_UP)
#undef GATE_UP
    return make_float2(warp_sum(acc_g[0] + acc_g[1]), warp_sum(acc_u[0] + acc_u[1]));
}

struct Spaced {  // nibble j's scale of a staged row: j * (WORDS_IN / GROUP) values on
    const bf16* p;
    __device__ __forceinline__ bf16 operator[](int j) const { return p[j * (WORDS_IN / GROUP)]; }
};

// a row pair's act from its chunks' (gate, up) sums, added in chunk order: silu(gate) * up in bfloat16
__device__ __forceinline__ bf16 act_value(const float (&chunks)[CHUNKS][2]) {
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) { gate += chunks[k][0]; up += chunks[k][1]; }
    return to_bf16(gate / (1.0f + __expf(-gate)) * up);
}

// a down lane's act inputs (nibble j of word w0 + i is input j * WORDS_W + w0 + i of its pair's row `row`) and each
// (nibble, chunk)'s four inputs summed; COHERENT: read past L1 (act written by other blocks of the same launch)
template <bool COHERENT>
__device__ __forceinline__ void act_slice(const bf16* row, int w0, float (&a)[8][WORDS_PER_LANE],
                                          float (&a_sum)[8][CHUNKS_PER_LANE]) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < WORDS_PER_LANE; i += 4) {
            const uint2* at = (const uint2*)(row + j * WORDS_W + w0 + i);
            const uint2 two = COHERENT ? __ldcg(at) : *at;
            a[j][i] = __uint_as_float(two.x << 16);
            a[j][i + 1] = __uint_as_float(two.x & 0xFFFF0000u);
            a[j][i + 2] = __uint_as_float(two.y << 16);
            a[j][i + 3] = __uint_as_float(two.y & 0xFFFF0000u);
        }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < CHUNKS_PER_LANE; ++c)
            a_sum[j][c] = (a[j][4 * c] + a[j][4 * c + 1]) + (a[j][4 * c + 2] + a[j][4 * c + 3]);
}

// a down lane's sum over its words q of one row, its words in one group a nibble (`ONE_GROUP`: sd[j] each nibble's
// scale), the even and odd nibbles' chains added
__device__ __forceinline__ float down_row_one_group(const uint4 (&q)[CHUNKS_PER_LANE],
                                                    const float (&a)[8][WORDS_PER_LANE],
                                                    const float (&a_sum)[8][CHUNKS_PER_LANE], const bf16 (&sd)[8]) {
    float acc[2] = {0.0f, 0.0f};  // even and odd nibbles: two chains
#define DOT(J, C) nibble_dot_biased<J>(q[C], make_float4(a[J][4 * C], a[J][4 * C + 1], a[J][4 * C + 2],            \
                                                         a[J][4 * C + 3]), a_sum[J][C])
#define DOWN(J) {                                                                                                   \
    float t = DOT(J, 0);                                                                                             \
    _Pragma("unroll") for (int c = 1; c < CHUNKS_PER_LANE; ++c) t += DOT(J, c);                                      \
    acc[J & 1] = fmaf(from_bf16(sd[J]), t, acc[J & 1]); }
    FOR_NIBBLES(DOWN)
#undef DOWN
#undef DOT
    return acc[0] + acc[1];
}

// gate and up with the K dimension split over the block's warps: warp c reads chunk c (16 bytes a lane) of each of
// the block's RPB row pairs, its x slice held in registers for all of them; the warps' sums meet in shared memory and
// are added in chunk order.
extern "C" __global__ void __launch_bounds__(32 * CHUNKS, SPLIT_MIN_BLOCKS)
gate_up_split(const bf16* __restrict__ x, const id_t* __restrict__ ids, const uint4* __restrict__ gate_p,
              const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
              bf16* __restrict__ act, int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r) {
    __shared__ float part[RPB][CHUNKS][2];
    const int lane = threadIdx.x & 31, c = threadIdx.x >> 5;
    const int row_id = blockIdx.x * RPB;  // RPB | WIDTH: the block's rows are rows of one pair
    const int pair = row_id / WIDTH, row0 = row_id % WIDTH;
    const long long e = (long long)ids[pair];
    const int w = 4 * (lane + 32 * c);
    uint4 g[RPB], u[RPB];
#pragma unroll
    for (int r = 0; r < RPB; ++r) {
        const long long p_off = (e * p_stride_e + (long long)(row0 + r) * p_stride_r + w) / 4;
        g[r] = __ldg(gate_p + p_off);
        u[r] = __ldg(up_p + p_off);
    }
    float4 xv[8];
    float x_sum[8];
    x_slice(x, w, xv, x_sum);
    // every scale the lane multiplies by, loaded with the words before any math (a second round trip to DRAM
    // otherwise waits behind the first multiplies)
    bf16 sg[RPB][8], su[RPB][8];
#pragma unroll
    for (int r = 0; r < RPB; ++r) {
        const long long s_off = e * s_stride_e + (long long)(row0 + r) * s_stride_r;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#if WORDS_IN % GROUP == 0  // nibble j's group is j * (WORDS_IN / GROUP) + w / GROUP: one address, constant offsets
            const long long at = s_off + w / GROUP + j * (WORDS_IN / GROUP);
#else
            const long long at = s_off + (j * WORDS_IN + w) / GROUP;
#endif
            sg[r][j] = __ldg(gate_s + at);
            su[r][j] = __ldg(up_s + at);
        }
    }
#pragma unroll
    for (int r = 0; r < RPB; ++r) {
        const float2 sums = chunk_sums(g[r], u[r], sg[r], su[r], xv, x_sum);
        if (lane == 0) { part[r][c][0] = sums.x; part[r][c][1] = sums.y; }
    }
    __syncthreads();
    if (threadIdx.x < RPB) {
        const int r = threadIdx.x;
        act[pair * WIDTH + row0 + r] = act_value(part[r]);
    }
}

// ---- tensor cores: `gate_up_mma` and `down_mma` (mma.sync m16n8k16, bfloat16 in, float32 sums) -----------------
// A warp multiplies 16 weight rows (the MMA's M side) by x broadcast to the 8 columns (N). Thread (g = lane / 4,
// t = lane % 4) loads 16 bytes (words base + 4t .. + 3) of row g and of row g + 8 for each 16-word step at base. One
// lop3 turns nibbles J and J + 4 of a word into the bfloat16 pair (128 + n_J, 128 + n_(J+4)); two bfloat16 fmas
// make (n - 8) * scale, rounded once to bfloat16 (the reference's own weight). The pair is the A fragment's two
// elements at k = 2t, 2t + 1 (words 2q of the thread's four) or 2t + 8, 2t + 9 (word 2q + 1): so MMA (J, q) of a step
// multiplies inputs J * words + w and (J + 4) * words + w, w = base + 4t + 2q + {0, 1}, and its B fragment is x at
// those inputs, paired the same way in shared memory (`xp`). The float32 sums of every step stay in the MMA's C.
__device__ __forceinline__ unsigned nibble_pair(unsigned shifted) {  // bfloat16 (128 + bits 0-3, 128 + bits 16-19)
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(shifted), "n"(0x000F000F), "r"(0x43004300u));
    return r;
}
__device__ __forceinline__ unsigned bf16x2_fma(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// the bfloat16 pair (n_lo - 8) * s_lo, (n_hi - 8) * s_hi: 128 + n - 136 is exact, the product rounded once
__device__ __forceinline__ unsigned scaled_pair(unsigned shifted, unsigned scales) {
    const unsigned centred = bf16x2_fma(nibble_pair(shifted), 0x3F803F80u, 0xC308C308u);  // * 1 - 136
    return bf16x2_fma(centred, scales, 0x80008000u);                                    // * s + (-0)
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the B side of `mma_step`: pairs(e) is the uint4 of bfloat16 pairs (input e + i, input e + i + 4 * words),
// i = 0 .. 3 (e a multiple of 4). From shared memory where a block built the paired row (`xp`, `ap`):
struct SharedPairs {
    const unsigned* p;
    __device__ __forceinline__ uint4 operator()(int e) const { return *(const uint4*)(p + e); }
};
// or straight from a bfloat16 row in global memory (a token's x, a pair's act: its column of the MMA's B), two 8-byte
// loads paired in registers
template <int WORDS>
struct RowPairs {
    const unsigned* row;  // the row read as bfloat16 pairs
    __device__ __forceinline__ uint4 operator()(int e) const {
        const uint2 lo = __ldg((const uint2*)(row + e / 2)), hi = __ldg((const uint2*)(row + e / 2 + 2 * WORDS));
        return make_uint4(__byte_perm(lo.x, hi.x, 0x5410), __byte_perm(lo.x, hi.x, 0x7632),
                          __byte_perm(lo.y, hi.y, 0x5410), __byte_perm(lo.y, hi.y, 0x7632));
    }
};
// one 16-word step of rows g (words `lo`) and g + 8 (`hi`) against the paired inputs `pairs` (J * words + w at
// J * words + w), scales (J, J + 4) of row g in `s_lo[J]`, of row g + 8 in `s_hi[J]`
template <int WORDS, class Pairs>
__device__ __forceinline__ void mma_step(float (&c)[4], uint4 lo, uint4 hi, const unsigned* s_lo,
                                         const unsigned* s_hi, const Pairs& pairs, int w) {
    const unsigned lw[4] = {lo.x, lo.y, lo.z, lo.w}, hw[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 b4 = pairs(j * WORDS + w);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const uint2 b = q == 0 ? make_uint2(b4.x, b4.y) : make_uint2(b4.z, b4.w);
            mma_bf16(c, scaled_pair(lw[2 * q] >> (4 * j), s_lo[j]), scaled_pair(hw[2 * q] >> (4 * j), s_hi[j]),
                     scaled_pair(lw[2 * q + 1] >> (4 * j), s_lo[j]), scaled_pair(hw[2 * q + 1] >> (4 * j), s_hi[j]),
                     b.x, b.y);
        }
    }
}

#define KSTEPS (WORDS_IN / 16)
#define STEPS_PER_WARP (KSTEPS / KSPLIT)
static_assert(KSTEPS % KSPLIT == 0 && (STEPS_PER_WARP * 16) % GROUP == 0, "KSPLIT: whole groups a warp");
#define STEPS_PER_GROUP (GROUP / 16)
#define MMA_GROUPS ((STEPS_PER_WARP + STEPS_PER_GROUP - 1) / STEPS_PER_GROUP)

// a gate/up warp's loads, every one issued before any math: row `row` of gate and of up (the MMA's rows g and g + 8),
// 16 bytes a step of its STEPS_PER_WARP steps from `step0`, and the scales of the warp's groups (GROUP / 16 steps a
// group; a warp's first step starts a group: `mma_fits`), nibbles J and J + 4 paired as the weights are
__device__ __forceinline__ void load_gate_up(uint4 (&gw)[STEPS_PER_WARP], uint4 (&uw)[STEPS_PER_WARP],
                                             unsigned (&sg)[MMA_GROUPS][4], unsigned (&su)[MMA_GROUPS][4],
                                             const uint4* __restrict__ gate_p, const bf16* __restrict__ gate_s,
                                             const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
                                             long long e, int row, int t, int step0, int p_stride_e, int p_stride_r,
                                             int s_stride_e, int s_stride_r) {
    const long long p_off = (e * p_stride_e + (long long)row * p_stride_r) / 4 + t;
    const long long s_off = e * s_stride_e + (long long)row * s_stride_r;
#pragma unroll
    for (int i = 0; i < STEPS_PER_WARP; ++i) {
        gw[i] = __ldg(gate_p + p_off + 4 * (step0 + i));
        uw[i] = __ldg(up_p + p_off + 4 * (step0 + i));
    }
    constexpr int FAR = 4 * WORDS_IN / GROUP;  // nibble J + 4's group, 4 * words inputs on
#pragma unroll
    for (int k = 0; k < MMA_GROUPS; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long at = s_off + j * (WORDS_IN / GROUP) + (16 * step0) / GROUP + k;
            sg[k][j] = (unsigned)__ldg(gate_s + at) | ((unsigned)__ldg(gate_s + at + FAR) << 16);
            su[k][j] = (unsigned)__ldg(up_s + at) | ((unsigned)__ldg(up_s + at + FAR) << 16);
        }
}

// a down warp's loads: rows h0 + g (`dl`) and h0 + g + 8 (`dh`) of expert e, all WORDS_W / 16 steps, and their scales
__device__ __forceinline__ void load_down(uint4 (&dl)[WORDS_W / 16], uint4 (&dh)[WORDS_W / 16],
                                          unsigned (&sl)[WORDS_W / 16][4], unsigned (&sh)[WORDS_W / 16][4],
                                          const uint4* __restrict__ down_p, const bf16* __restrict__ down_s,
                                          long long e, int h0, int g, int t, int p_stride_e, int p_stride_r,
                                          int s_stride_e, int s_stride_r) {
    const long long lo_off = (e * p_stride_e + (long long)(h0 + g) * p_stride_r) / 4 + t;
    const long long hi_off = lo_off + (8LL * p_stride_r) / 4;
    const long long s_lo = e * s_stride_e + (long long)(h0 + g) * s_stride_r, s_hi = s_lo + 8LL * s_stride_r;
#pragma unroll
    for (int i = 0; i < WORDS_W / 16; ++i) {
        dl[i] = __ldg(down_p + lo_off + 4 * i);
        dh[i] = __ldg(down_p + hi_off + 4 * i);
    }
#pragma unroll
    for (int i = 0; i < WORDS_W / 16; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int at = (j * WORDS_W + 16 * i) / GROUP;
            constexpr int FAR = 4 * WORDS_W / GROUP;
            sl[i][j] = (unsigned)__ldg(down_s + s_lo + at) | ((unsigned)__ldg(down_s + s_lo + at + FAR) << 16);
            sh[i][j] = (unsigned)__ldg(down_s + s_hi + at) | ((unsigned)__ldg(down_s + s_hi + at + FAR) << 16);
        }
}

// block: KSPLIT warps over the 16-word steps of 8 rows of gate (the MMA's rows 0-7) and the same 8 rows of up
// (rows 8-15) of one pair; the warps' sums added in warp order; silu(gate) * up in bfloat16 into act
extern "C" __global__ void __launch_bounds__(32 * KSPLIT)
gate_up_mma(const bf16* __restrict__ x, const id_t* __restrict__ ids, const uint4* __restrict__ gate_p,
            const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
            bf16* __restrict__ act, int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r) {
    __shared__ __align__(16) unsigned xp[4 * WORDS_IN];  // (x[J * words + w], x[(J + 4) * words + w]) at J * words + w
    __shared__ float part[KSPLIT][8][2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int pair = blockIdx.x / (WIDTH / 8), row = (blockIdx.x % (WIDTH / 8)) * 8 + g;
    const long long e = (long long)ids[pair];
    const int step0 = warp * STEPS_PER_WARP;
    uint4 gw[STEPS_PER_WARP], uw[STEPS_PER_WARP];
    unsigned sg[MMA_GROUPS][4], su[MMA_GROUPS][4];
    load_gate_up(gw, uw, sg, su, gate_p, gate_s, up_p, up_s, e, row, t, step0, p_stride_e, p_stride_r, s_stride_e,
                 s_stride_r);
    // x paired: two neighbouring words' inputs of nibbles J and J + 4 at once
    for (int i = threadIdx.x; i < 2 * WORDS_IN; i += 32 * KSPLIT) {
        const unsigned lo = __ldg((const unsigned*)x + i), hi = __ldg((const unsigned*)x + i + 2 * WORDS_IN);
        *(uint2*)(xp + 2 * i) = make_uint2(__byte_perm(lo, hi, 0x5410), __byte_perm(lo, hi, 0x7632));
    }
    __syncthreads();
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < STEPS_PER_WARP; ++i)
        mma_step<WORDS_IN>(c, gw[i], uw[i], sg[i / STEPS_PER_GROUP], su[i / STEPS_PER_GROUP], SharedPairs{xp},
                           16 * (step0 + i) + 4 * t);
    if (t == 0) { part[warp][g][0] = c[0]; part[warp][g][1] = c[2]; }  // column 0: rows g (gate) and g + 8 (up)
    __syncthreads();
    if (threadIdx.x < 8) {
        float sum_g = 0.0f, sum_u = 0.0f;
#pragma unroll
        for (int k = 0; k < KSPLIT; ++k) { sum_g += part[k][threadIdx.x][0]; sum_u += part[k][threadIdx.x][1]; }
        act[pair * WIDTH + (blockIdx.x % (WIDTH / 8)) * 8 + threadIdx.x] =
            to_bf16(sum_g / (1.0f + __expf(-sum_g)) * sum_u);
    }
}

// block: TOP_K warps, warp p multiplies 16 output rows of down by pair p's act (its steps of 16 words), times the
// pair's routing weight; the pairs' sums added in pair order, each row written in bfloat16
extern "C" __global__ void __launch_bounds__(32 * TOP_K)
down_mma(const bf16* __restrict__ act, const id_t* __restrict__ ids, const float* __restrict__ weights,
         const uint4* __restrict__ down_p, const bf16* __restrict__ down_s, bf16* __restrict__ out, int p_stride_e,
         int p_stride_r, int s_stride_e, int s_stride_r) {
    __shared__ __align__(16) unsigned ap[TOP_K][4 * WORDS_W];  // act paired as x is in `gate_up_mma`, a pair each
    __shared__ float part[TOP_K][16];
    const int lane = threadIdx.x & 31, p = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int h0 = blockIdx.x * 16;  // 16 | HIDDEN
    const long long e = (long long)ids[p];
    uint4 dl[WORDS_W / 16], dh[WORDS_W / 16];
    unsigned sl[WORDS_W / 16][4], sh[WORDS_W / 16][4];
    load_down(dl, dh, sl, sh, down_p, down_s, e, h0, g, t, p_stride_e, p_stride_r, s_stride_e, s_stride_r);
    for (int i = threadIdx.x; i < TOP_K * 2 * WORDS_W; i += 32 * TOP_K) {
        const int q = i / (2 * WORDS_W), k = i % (2 * WORDS_W);
        const unsigned* pair = (const unsigned*)(act + q * WIDTH);
        const unsigned lo = pair[k], hi = pair[k + 2 * WORDS_W];
        *(uint2*)(&ap[q][2 * k]) = make_uint2(__byte_perm(lo, hi, 0x5410), __byte_perm(lo, hi, 0x7632));
    }
    __syncthreads();
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < WORDS_W / 16; ++i)
        mma_step<WORDS_W>(c, dl[i], dh[i], sl[i], sh[i], SharedPairs{ap[p]}, 16 * i + 4 * t);
    const float weight = weights[p];
    if (t == 0) { part[p][g] = c[0] * weight; part[p][g + 8] = c[2] * weight; }
    __syncthreads();
    if (threadIdx.x < 16) {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) sum += part[k][threadIdx.x];
        out[h0 + threadIdx.x] = to_bf16(sum);
    }
}

// ---- a block of tokens (a verify's, a draft's): `gate_up_mma_tokens`, `down_mma_tokens`, `sum_pairs` -----------
// The (token, expert) pairs sorted by expert (`kernel.route`: sorted pair p's token `token[p]`, its place in the
// T x k order `order[p]`; expert e's pairs start[e] .. start[e] + count[e] - 1; slot -> expert or -1). A block takes
// one chosen expert's tile, loads its words once, and multiplies them by up to 8 of the expert's pairs at a time:
// the MMA's 8 columns, column n = g reading its own pair's row (`RowPairs`); more pairs, another 8 columns over the
// same words. Each column's sums are those `gate_up_mma` / `down_mma` make for its token alone, in the same order.

// the column passes of a gate/up tile (rows tile * 8 .. + 7 of gate and of up of one expert, this warp's steps in
// registers): up to 8 of the expert's pairs a pass, the warps' sums added in warp order in `part`, silu(gate) * up in
// bfloat16 into act [sorted pairs, WIDTH]. Every thread of the block calls it with the same pairs. BUFFERS = 1: two
// barriers a pass (the sums read before the next pass writes them); BUFFERS = 2: `part` holds two passes' sums,
// taken in turn (`pass` counts the block's passes), and one barrier a pass: a warp writes a buffer again only after
// the barrier of the pass between, which the warps adding it reach once they have added it. They take turns too.
template <int BUFFERS>
__device__ __forceinline__ void gate_up_columns(const uint4 (&gw)[STEPS_PER_WARP], const uint4 (&uw)[STEPS_PER_WARP],
                                                const unsigned (&sg)[MMA_GROUPS][4],
                                                const unsigned (&su)[MMA_GROUPS][4], const bf16* __restrict__ x,
                                                const int* __restrict__ token, int first, int pairs, int tile,
                                                float (*part)[2][8][8], bf16* __restrict__ act, int& pass) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int step0 = warp * STEPS_PER_WARP;
    for (int m0 = 0; m0 < pairs; m0 += 8, ++pass) {
        const int column = min(m0 + g, pairs - 1);  // past the last pair: its row again, the sums not written
        const RowPairs<WORDS_IN> b{(const unsigned*)(x + (long long)token[first + column] * HIDDEN)};
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < STEPS_PER_WARP; ++i)
            mma_step<WORDS_IN>(c, gw[i], uw[i], sg[i / STEPS_PER_GROUP], su[i / STEPS_PER_GROUP], b,
                               16 * (step0 + i) + 4 * t);
        float (*sums)[2][8][8] = part + (BUFFERS == 2 ? (pass & 1) * KSPLIT : 0);
        // c: (row g, columns 2t and 2t + 1) of gate, then of up (the MMA's rows g + 8)
        sums[warp][0][g][2 * t] = c[0];
        sums[warp][0][g][2 * t + 1] = c[1];
        sums[warp][1][g][2 * t] = c[2];
        sums[warp][1][g][2 * t + 1] = c[3];
        __syncthreads();
        const int turn = BUFFERS == 2 ? 64 * (pass % (KSPLIT / 2 > 0 ? KSPLIT / 2 : 1)) : 0;  // the adding warps
        for (int i = threadIdx.x - turn; 0 <= i && i < 64; i += 32 * KSPLIT) {
            const int r = i >> 3, n = i & 7;
            if (m0 + n < pairs) {
                float sum_g = 0.0f, sum_u = 0.0f;
#pragma unroll
                for (int k = 0; k < KSPLIT; ++k) { sum_g += sums[k][0][r][n]; sum_u += sums[k][1][r][n]; }
                act[(long long)(first + m0 + n) * WIDTH + tile * 8 + r] =
                    to_bf16(sum_g / (1.0f + __expf(-sum_g)) * sum_u);
            }
        }
        if (BUFFERS == 1) __syncthreads();
    }
}

// block: as `gate_up_mma` over rows tile * 8 .. + 7 of the slot's expert, a block a tile
extern "C" __global__ void __launch_bounds__(32 * KSPLIT, 1)
gate_up_mma_tokens(const bf16* __restrict__ x, const int* __restrict__ token, const int* __restrict__ slot_expert,
                   const int* __restrict__ start, const int* __restrict__ count, const uint4* __restrict__ gate_p,
                   const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
                   bf16* __restrict__ act, int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r) {
    __shared__ float part[KSPLIT][2][8][8];  // warp, gate / up, row g, column
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int slot = blockIdx.x / (WIDTH / 8), tile = blockIdx.x % (WIDTH / 8);
    const int expert = slot_expert[slot];
    if (expert < 0) return;  // a slot no expert filled (the grid holds as many as the pairs could choose)
    uint4 gw[STEPS_PER_WARP], uw[STEPS_PER_WARP];
    unsigned sg[MMA_GROUPS][4], su[MMA_GROUPS][4];
    load_gate_up(gw, uw, sg, su, gate_p, gate_s, up_p, up_s, expert, tile * 8 + g, t, warp * STEPS_PER_WARP,
                 p_stride_e, p_stride_r, s_stride_e, s_stride_r);
    int pass = 0;
    gate_up_columns<1>(gw, uw, sg, su, x, token, start[expert], count[expert], tile, part, act, pass);
}

// ---- the same tiles streamed: persistent blocks, block b the tiles b, b + grid, b + 2 grid, ... (slot-major), the
// words and scales of the next STAGES - 1 tiles copied into shared memory (cp.async) while it multiplies the current
// one. A lane copies the very words it multiplies and a quad the scales of its own row.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>  // until at most PENDING of this thread's groups are in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING)); }

// a queue of tasks 0 .. tasks - 1 shared by the grid, taken TAKE consecutive tasks at a time (so a block's tiles come
// mostly of one expert, whose tokens' x stays in L1, and every block or warp takes more while there are some, however
// unevenly the routing loads them); `queue` is zero before the launch. next() is called by one thread, which asks
// for its next run a run ahead (the atomic's round trip hidden behind the run it has).
template <int TAKE>
struct TaskQueue {
    int* queue;
    int tasks, at = 0, left = 0, ahead = -1;
    __device__ __forceinline__ int next() {  // the next task, or -1 once none is left
        if (left == 0) {
            at = (ahead < 0 ? atomicAdd(queue, 1) : ahead) * TAKE;
            ahead = atomicAdd(queue, 1);
            left = TAKE;
        }
        --left;
        const int task = at++;
        return task < tasks ? task : -1;
    }
};

// an inclusive prefix sum over the block's threads (at most 32 warps), and the block's total; `sums`: 32 in shared
// memory, free again on return
__device__ __forceinline__ long long block_scan(long long v, long long* sums, long long& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const long long u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        long long w = lane < warps ? sums[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const long long u = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += u;
        }
        sums[lane] = w;
    }
    __syncthreads();
    total = sums[warps - 1];
    const long long before = warp > 0 ? sums[warp - 1] : 0;
    __syncthreads();
    return v + before;
}

// the tiles block b takes when they are shared out by work (BALANCE = 1): a tile's work is its passes (its expert's
// pairs / 8, rounded up), and block b takes the tiles whose work starts in [b W / grid, (b + 1) W / grid), W the
// total: a contiguous run (mostly one or two experts, whose tokens' x stays in L1), as even in time as whole tiles
// allow whatever the routing. Every thread of the block calls it.
__device__ int2 balanced_tiles(const int* __restrict__ slot_expert, const int* __restrict__ count, int active) {
    constexpr int TILES = WIDTH / 8;
    __shared__ long long sums[32];
    __shared__ int found[2];
    long long total = 0, part;
    for (int base = 0; base < active; base += blockDim.x) {
        const int i = base + threadIdx.x;
        block_scan(i < active ? (long long)TILES * ((__ldg(count + __ldg(slot_expert + i)) + 7) / 8) : 0, sums, part);
        total += part;
    }
    const long long lo = total * blockIdx.x / gridDim.x, hi = total * (blockIdx.x + 1) / gridDim.x;
    if (threadIdx.x < 2) found[threadIdx.x] = active * TILES;  // a bound at the very end
    __syncthreads();
    long long carry = 0;
    for (int base = 0; base < active; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const int passes = i < active ? (__ldg(count + __ldg(slot_expert + i)) + 7) / 8 : 0;
        const long long end = carry + block_scan((long long)TILES * passes, sums, part);  // work before slot i + 1
        const long long begin = end - (long long)TILES * passes;
        if (i < active) {
            if (begin <= lo && lo < end) found[0] = i * TILES + (int)((lo - begin + passes - 1) / passes);
            if (begin <= hi && hi < end) found[1] = i * TILES + (int)((hi - begin + passes - 1) / passes);
        }
        carry += part;
    }
    __syncthreads();
    return make_int2(found[0], found[1]);
}

// a row's scale values a warp reads: MMA_GROUPS groups x 4 nibble pairs x (J, J + 4) x (gate, up)
#define ROW_SCALES (16 * MMA_GROUPS)
#define STAGE_WORDS (KSPLIT * STEPS_PER_WARP * 2 * 32)  // uint4s a stage: warp, step, gate / up, lane
#define STAGE_SCALES (KSPLIT * 8 * ROW_SCALES)            // 4-byte words a stage: warp, row g, value

// scale value v of row g (gate then up; group k, pair j, J or J + 4) -> its index in the row's scales
__device__ __forceinline__ long long scale_index(int v, long long s_off, int step0) {
    const int rem = v % (8 * MMA_GROUPS), k = rem / 8, j = rem % 4, far = (rem % 8) / 4;
    return s_off + j * (WORDS_IN / GROUP) + (16 * step0) / GROUP + k + far * (4 * WORDS_IN / GROUP);
}

// issue the copies of one tile into a stage: each lane its own words; lanes t of a row's quad that row's scales, as
// the 4-byte words that hold them (the scales' rows and experts start at even indices: `launch_block` checks)
__device__ __forceinline__ void stage_tile(uint4* words, unsigned* scales, const uint4* __restrict__ gate_p,
                                           const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p,
                                           const bf16* __restrict__ up_s, long long e, int row, int p_stride_e,
                                           int p_stride_r, int s_stride_e, int s_stride_r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int step0 = warp * STEPS_PER_WARP;
    const long long p_off = (e * p_stride_e + (long long)row * p_stride_r) / 4 + t;
#pragma unroll
    for (int i = 0; i < STEPS_PER_WARP; ++i) {
        uint4* at = words + ((warp * STEPS_PER_WARP + i) * 2) * 32 + lane;
        cp_async16(at, gate_p + p_off + 4 * (step0 + i));
        cp_async16(at + 32, up_p + p_off + 4 * (step0 + i));
    }
    const long long s_off = e * s_stride_e + (long long)row * s_stride_r;
    unsigned* mine = scales + (warp * 8 + g) * ROW_SCALES;
#pragma unroll
    for (int v = t; v < ROW_SCALES; v += 4) {
        const bf16* base = v < 8 * MMA_GROUPS ? gate_s : up_s;
        cp_async4(mine + v, base + (scale_index(v, s_off, step0) & ~1LL));
    }
}

extern "C" __global__ void __launch_bounds__(32 * KSPLIT, 1)
gate_up_mma_stream(const bf16* __restrict__ x, const int* __restrict__ token, const int* __restrict__ slot_expert,
                   const int* __restrict__ start, const int* __restrict__ count, const uint4* __restrict__ gate_p,
                   const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
                   bf16* __restrict__ act, int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r,
                   const int* __restrict__ active) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* words = (uint4*)smem;                                   // [STAGES][STAGE_WORDS]
    unsigned* scales = (unsigned*)(words + STAGES * STAGE_WORDS);  // [STAGES][STAGE_SCALES]
    float (*part)[2][8][8] = (float (*)[2][8][8])(scales + STAGES * STAGE_SCALES);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    constexpr int TILES = WIDTH / 8;
    const int step0 = warp * STEPS_PER_WARP;
    const int tasks = __ldg(active) * TILES;  // the chosen experts' tiles; block b takes b, b + grid, b + 2 grid, ...
    auto task_at = [&](int i) { return (int)blockIdx.x + i * (int)gridDim.x; };
    int pass = 0;  // the block's column passes so far
    auto stage = [&](int task, int s) {
        stage_tile(words + s * STAGE_WORDS, scales + s * STAGE_SCALES, gate_p, gate_s, up_p, up_s,
                   __ldg(slot_expert + task / TILES), (task % TILES) * 8 + g, p_stride_e, p_stride_r, s_stride_e,
                   s_stride_r);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (task_at(s) < tasks) stage(task_at(s), s);
        cp_async_commit();  // one group a tile, empty past the last: the waits below count tiles
    }
    for (int i = 0, s = 0; task_at(i) < tasks; ++i, s = s + 1 == STAGES ? 0 : s + 1) {
        const int task = task_at(i), ahead = task_at(i + STAGES - 1);
        if (ahead < tasks) stage(ahead, s == 0 ? STAGES - 1 : s - 1);  // into the stage read a tile ago
        cp_async_commit();
        const int expert = __ldg(slot_expert + task / TILES), tile = task % TILES;
        const int first = __ldg(start + expert), pairs = __ldg(count + expert);
        cp_async_wait<STAGES - 1>();  // this tile's copies landed (the next ones' may not have)
        __syncwarp();                 // and the quad's scales are seen by every lane of the row
        uint4 gw[STEPS_PER_WARP], uw[STEPS_PER_WARP];
        const uint4* mine = words + s * STAGE_WORDS + (warp * STEPS_PER_WARP * 2) * 32 + lane;
#pragma unroll
        for (int i = 0; i < STEPS_PER_WARP; ++i) {
            gw[i] = mine[(2 * i) * 32];
            uw[i] = mine[(2 * i + 1) * 32];
        }
        const unsigned* row_scales = scales + s * STAGE_SCALES + (warp * 8 + g) * ROW_SCALES;
        const long long s_off = (long long)expert * s_stride_e + (long long)(tile * 8 + g) * s_stride_r;
        unsigned sg[MMA_GROUPS][4], su[MMA_GROUPS][4];
#pragma unroll
        for (int k = 0; k < MMA_GROUPS; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int v = 8 * k + j;  // J; J + 4 at v + 4; up 8 * MMA_GROUPS on
                const unsigned at_lo = (unsigned)scale_index(v, s_off, step0) & 1u;
                const unsigned at_hi = (unsigned)scale_index(v + 4, s_off, step0) & 1u;
                sg[k][j] = ((row_scales[v] >> (16 * at_lo)) & 0xFFFFu) | ((row_scales[v + 4] >> (16 * at_hi)) << 16);
                const int u = v + 8 * MMA_GROUPS;
                su[k][j] = ((row_scales[u] >> (16 * at_lo)) & 0xFFFFu) | ((row_scales[u + 4] >> (16 * at_hi)) << 16);
            }
        // (its barrier also keeps every lane's reads of this stage before the copies a tile on write into it)
        gate_up_columns<PARTS>(gw, uw, sg, su, x, token, first, pairs, tile, part, act, pass);
    }
    cp_async_wait<0>();
}

// ---- the same tiles by bulk copies (Hopper's TMA unit, one-dimensional: no tensor map), each block a run of tiles
// even in work (`balanced_tiles`, BALANCE = 1: every thread counts the run), or, BALANCE = 0, the tiles taken from a
// `TaskQueue` by lane 0 of warp 0, which writes each stage's task (or -1: no more) into shared memory before the
// stage's mbarrier arrival. Lane i of warp 0 copies row i % 8 of gate's words, up's words, gate's scales or up's
// scales (i / 8) of the tile into the stage, each row padded so that a quarter warp's 16-byte reads of rows g and
// g + 1 fall in distinct banks; the mbarrier counts the bytes landed. A stage is filled again a tile after it was
// read: warp 0 issues those copies only after the barrier of the pass that read it, which every warp reaches after
// its reads.
#define ROW_STRIDE (WORDS_IN * 4 + 64)             // bytes of a staged row of words
#define SROW_STRIDE ((HIDDEN / GROUP) * 2 + 16)    // bytes of a staged row of scales
#define BULK_STAGE (16 * ROW_STRIDE + 16 * SROW_STRIDE)  // gate rows, up rows, gate scales, up scales
static_assert(STAGES <= 8, "the stages' mbarriers and tasks fit the first 128 bytes of shared memory");

// (sm_90 and later: on an older GPU the kernel is compiled empty and `launch_block` does not choose it)
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_at(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_at(dst)), "l"(src), "r"(bytes), "r"(smem_at(bar)) : "memory");
}
__device__ __forceinline__ bool bar_done(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(smem_at(bar)), "r"(parity) : "memory");
    return done;
}
#endif

extern "C" __global__ void __launch_bounds__(32 * KSPLIT, 1)
gate_up_mma_bulk(const bf16* __restrict__ x, const int* __restrict__ token, const int* __restrict__ slot_expert,
                 const int* __restrict__ start, const int* __restrict__ count, const uint4* __restrict__ gate_p,
                 const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p, const bf16* __restrict__ up_s,
                 bf16* __restrict__ act, int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r,
                 const int* __restrict__ active, int* __restrict__ queue) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = (unsigned long long*)smem;  // [STAGES] mbarriers,
    volatile int* stage_task = (volatile int*)(smem + 64);  // [STAGES] the stages' tasks, then the stages
    unsigned char* stages = smem + 128;
    float (*part)[2][8][8] = (float (*)[2][8][8])(stages + STAGES * BULK_STAGE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    constexpr int TILES = WIDTH / 8;
    const int step0 = warp * STEPS_PER_WARP;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(smem_at(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    auto copy = [&](int task, int s) {  // warp 0: tile `task`'s rows into stage s
        const long long e = __ldg(slot_expert + task / TILES), row = (task % TILES) * 8 + (lane & 7);
        unsigned char* stage = stages + s * BULK_STAGE;
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                         :: "r"(smem_at(bars + s)), "r"(16 * (WORDS_IN * 4 + (HIDDEN / GROUP) * 2)) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stage's reads before these writes
        const int kind = lane >> 3;  // gate words, up words, gate scales, up scales
        if (kind < 2)
            bulk_copy(stage + (lane & 15) * ROW_STRIDE,
                      (kind ? up_p : gate_p) + (e * p_stride_e + row * p_stride_r) / 4, WORDS_IN * 4, bars + s);
        else
            bulk_copy(stage + 16 * ROW_STRIDE + (lane & 15) * SROW_STRIDE,
                      (kind == 3 ? up_s : gate_s) + e * s_stride_e + row * s_stride_r, (HIDDEN / GROUP) * 2, bars + s);
    };
    int pass = 0;  // the block's column passes so far
    // every warp: tile `task` (its expert's first sorted pair and pairs) from stage s, once its copies landed
    auto multiply = [&](int task, int first, int pairs, int s) {
        const int tile = task % TILES;
        const unsigned char* stage = stages + s * BULK_STAGE;
        uint4 gw[STEPS_PER_WARP], uw[STEPS_PER_WARP];
#pragma unroll
        for (int k = 0; k < STEPS_PER_WARP; ++k) {
            gw[k] = *(const uint4*)(stage + g * ROW_STRIDE + 64 * (step0 + k) + 16 * t);
            uw[k] = *(const uint4*)(stage + (8 + g) * ROW_STRIDE + 64 * (step0 + k) + 16 * t);
        }
        const bf16* gs = (const bf16*)(stage + 16 * ROW_STRIDE + g * SROW_STRIDE);
        const bf16* us = (const bf16*)(stage + 16 * ROW_STRIDE + (8 + g) * SROW_STRIDE);
        unsigned sg[MMA_GROUPS][4], su[MMA_GROUPS][4];
        constexpr int FAR = 4 * WORDS_IN / GROUP;  // nibble J + 4's group, 4 * words inputs on
#pragma unroll
        for (int k = 0; k < MMA_GROUPS; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int at = j * (WORDS_IN / GROUP) + (16 * step0) / GROUP + k;
                sg[k][j] = (unsigned)gs[at] | ((unsigned)gs[at + FAR] << 16);
                su[k][j] = (unsigned)us[at] | ((unsigned)us[at + FAR] << 16);
            }
        gate_up_columns<PARTS>(gw, uw, sg, su, x, token, first, pairs, tile, part, act, pass);
    };
#if BALANCE
    // this block's run of tiles, known to every thread: the loop counts them
    const int2 run = balanced_tiles(slot_expert, count, __ldg(active));  // (its barriers also order the inits)
    if (warp == 0)
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (run.x + s < run.y) copy(run.x + s, s);
    for (int task = run.x, i = 0; task < run.y; ++task, ++i) {
        const int s = i % STAGES;
        if (warp == 0 && task + STAGES - 1 < run.y) copy(task + STAGES - 1, (i + STAGES - 1) % STAGES);
        const int expert = __ldg(slot_expert + task / TILES);  // (loaded while the copies land)
        const int first = __ldg(start + expert), pairs = __ldg(count + expert);
        while (!bar_done(bars + s, (i / STAGES) & 1)) {}
        multiply(task, first, pairs, s);
    }
#else
    // tiles from the queue, taken by lane 0 of warp 0, each stage's task (or -1: no more) in shared memory, written
    // before the stage's arrival
    __syncthreads();
    TaskQueue<CHUNK> tiles{queue, __ldg(active) * TILES};
    bool more = true;  // warp 0: there may be more
    auto next = [&](int s) {
        int task = 0;
        if (lane == 0) stage_task[s] = task = tiles.next();
        task = __shfl_sync(0xffffffffu, task, 0);
        more = task >= 0;
        if (more)
            copy(task, s);
        else if (lane == 0)  // the arrival alone completes the stage's phase: its readers find -1
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_at(bars + s)) : "memory");
    };
    if (warp == 0)
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (more) next(s);
    for (int i = 0;; ++i) {
        const int s = i % STAGES;
        if (warp == 0 && more) next((i + STAGES - 1) % STAGES);
        while (!bar_done(bars + s, (i / STAGES) & 1)) {}
        const int task = stage_task[s];
        if (task < 0) break;  // (no copy was issued after it)
        const int expert = __ldg(slot_expert + task / TILES);
        multiply(task, __ldg(start + expert), __ldg(count + expert), s);
    }
#endif
#endif
}

// the column passes of a down warp's 16 rows h0 .. h0 + 15 (rows g and g + 8 of the MMA, their steps in registers):
// up to 8 of the expert's pairs a pass, each pair's row times its routing weight into its own float32 row of `routed`
__device__ __forceinline__ void down_columns(const uint4 (&dl)[WORDS_W / 16], const uint4 (&dh)[WORDS_W / 16],
                                             const unsigned (&sl)[WORDS_W / 16][4],
                                             const unsigned (&sh)[WORDS_W / 16][4], const bf16* __restrict__ act,
                                             const long long* __restrict__ order, const float* __restrict__ weights,
                                             float* __restrict__ routed, int first, int pairs, int h0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int m0 = 0; m0 < pairs; m0 += 8) {
        const int column = min(m0 + g, pairs - 1);  // past the last pair: its row again, the sums not written
        const RowPairs<WORDS_W> b{(const unsigned*)(act + (long long)(first + column) * WIDTH)};
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < WORDS_W / 16; ++i) mma_step<WORDS_W>(c, dl[i], dh[i], sl[i], sh[i], b, 16 * i + 4 * t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // c: rows h0 + g and h0 + g + 8 of columns 2t and 2t + 1
            const int n = m0 + 2 * t + h;
            if (n < pairs) {
                const long long source = __ldg(order + first + n);
                const float weight = __ldg(weights + source);
                routed[source * HIDDEN + h0 + g] = c[h] * weight;
                routed[source * HIDDEN + h0 + g + 8] = c[2 + h] * weight;
            }
        }
    }
}

// block: WARPS warps of 16 output rows each (as a `down_mma` warp) of the slot's expert, every one of its pairs'
// act, times the pair's routing weight, into the pair's own float32 row of `routed` [T x k, HIDDEN]
extern "C" __global__ void __launch_bounds__(32 * WARPS)
down_mma_tokens(const bf16* __restrict__ act, const long long* __restrict__ order, const float* __restrict__ weights,
                const int* __restrict__ slot_expert, const int* __restrict__ start, const int* __restrict__ count,
                const uint4* __restrict__ down_p, const bf16* __restrict__ down_s, float* __restrict__ routed,
                int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r) {
    constexpr int TILES = (HIDDEN + 16 * WARPS - 1) / (16 * WARPS);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int slot = blockIdx.x / TILES, h0 = (blockIdx.x % TILES) * 16 * WARPS + 16 * warp;
    const int expert = slot_expert[slot];
    if (expert < 0 || h0 >= HIDDEN) return;  // 16 | HIDDEN: a warp's rows are all in or all out
    const int first = start[expert], pairs = count[expert];
    uint4 dl[WORDS_W / 16], dh[WORDS_W / 16];
    unsigned sl[WORDS_W / 16][4], sh[WORDS_W / 16][4];
    load_down(dl, dh, sl, sh, down_p, down_s, expert, h0, g, t, p_stride_e, p_stride_r, s_stride_e, s_stride_r);
    down_columns(dl, dh, sl, sh, act, order, weights, routed, first, pairs, h0);
}

// down streamed: persistent warps taking 16-row tasks (expert-major) from a `TaskQueue`, DCHUNK at a time, the words
// and scales of its next DSTAGES - 1 tasks copied into its own shared memory (cp.async) while it multiplies the
// current one, as a `down_mma_tokens` warp does: no barrier but the warp's own. A row's WIDTH / GROUP scales are
// copied 16 bytes at a time (`launch_block` checks they fit).
#define DSTEPS (WORDS_W / 16)
#define DROW_SCALES (WIDTH / GROUP)               // bfloat16 scales a row
#define DSTAGE_WORDS (2 * DSTEPS * 32)             // uint4s of a warp's stage: step, rows g / g + 8, lane
#define DSTAGE (DSTAGE_WORDS + 2 * DROW_SCALES)    // uint4s of a warp's stage: its words, then its 16 rows' scales

__device__ __forceinline__ unsigned bf16_at(const unsigned* row, int i) {  // scale i of a row held as pairs
    return (row[i / 2] >> (16 * (i & 1))) & 0xFFFFu;
}

extern "C" __global__ void __launch_bounds__(32 * DWARPS, DBLOCKS)
down_mma_stream(const bf16* __restrict__ act, const long long* __restrict__ order, const float* __restrict__ weights,
                const int* __restrict__ slot_expert, const int* __restrict__ start, const int* __restrict__ count,
                const uint4* __restrict__ down_p, const bf16* __restrict__ down_s, float* __restrict__ routed,
                int p_stride_e, int p_stride_r, int s_stride_e, int s_stride_r, const int* __restrict__ active,
                int* __restrict__ queue) {
    extern __shared__ __align__(16) uint4 dsmem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    uint4* mine = dsmem + warp * (DSTAGES * DSTAGE);
    volatile int* stage_task = (volatile int*)(dsmem + DWARPS * DSTAGES * DSTAGE) + warp * DSTAGES;  // or -1
    constexpr int TILES = HIDDEN / 16;
    TaskQueue<DCHUNK> tasks{queue, __ldg(active) * TILES};  // lane 0's
    bool more = true;
    auto stage = [&](int s) {  // the warp's next task into stage s, or -1 there
        int task = lane == 0 ? tasks.next() : 0;
        task = __shfl_sync(0xffffffffu, task, 0);
        if (lane == 0) stage_task[s] = task;
        more = task >= 0;
        if (!more) return;
        const long long e = __ldg(slot_expert + task / TILES);
        const int h0 = (task % TILES) * 16;
        uint4* at = mine + s * DSTAGE;
        const long long lo_off = (e * p_stride_e + (long long)(h0 + g) * p_stride_r) / 4 + t;
        const long long hi_off = lo_off + (8LL * p_stride_r) / 4;
#pragma unroll
        for (int i = 0; i < DSTEPS; ++i) {
            cp_async16(at + (2 * i) * 32 + lane, down_p + lo_off + 4 * i);
            cp_async16(at + (2 * i + 1) * 32 + lane, down_p + hi_off + 4 * i);
        }
        for (int c = lane; c < 2 * DROW_SCALES; c += 32) {  // 16-byte chunk c % (DROW_SCALES / 8) of row c / ...
            const int r = c / (DROW_SCALES / 8), part = c % (DROW_SCALES / 8);
            cp_async16(at + DSTAGE_WORDS + c, down_s + e * s_stride_e + (long long)(h0 + r) * s_stride_r + 8 * part);
        }
    };
#pragma unroll
    for (int s = 0; s < DSTAGES - 1; ++s) {
        if (more) stage(s);
        cp_async_commit();
    }
    for (int s = 0;; s = s + 1 == DSTAGES ? 0 : s + 1) {
        __syncwarp();  // every lane done with the stage the next copies go into (its scales are the warp's)
        if (more) stage(s == 0 ? DSTAGES - 1 : s - 1);
        cp_async_commit();
        cp_async_wait<DSTAGES - 1>();
        __syncwarp();
        const int task = stage_task[s];
        if (task < 0) break;  // (nothing was staged after it)
        const int expert = __ldg(slot_expert + task / TILES), h0 = (task % TILES) * 16;
        const int first = __ldg(start + expert), pairs = __ldg(count + expert);
        const uint4* at = mine + s * DSTAGE;
        uint4 dl[DSTEPS], dh[DSTEPS];
#pragma unroll
        for (int i = 0; i < DSTEPS; ++i) {
            dl[i] = at[(2 * i) * 32 + lane];
            dh[i] = at[(2 * i + 1) * 32 + lane];
        }
        unsigned rl[DROW_SCALES / 2], rh[DROW_SCALES / 2];  // rows g and g + 8's scales, two a word
#pragma unroll
        for (int c = 0; c < DROW_SCALES / 8; ++c) {
            const uint4 lo = at[DSTAGE_WORDS + g * (DROW_SCALES / 8) + c];
            const uint4 hi = at[DSTAGE_WORDS + (g + 8) * (DROW_SCALES / 8) + c];
            rl[4 * c] = lo.x; rl[4 * c + 1] = lo.y; rl[4 * c + 2] = lo.z; rl[4 * c + 3] = lo.w;
            rh[4 * c] = hi.x; rh[4 * c + 1] = hi.y; rh[4 * c + 2] = hi.z; rh[4 * c + 3] = hi.w;
        }
        unsigned sl[DSTEPS][4], sh[DSTEPS][4];  // as `load_down` pairs them
#pragma unroll
        for (int i = 0; i < DSTEPS; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int a = (j * WORDS_W + 16 * i) / GROUP;
                constexpr int FAR = 4 * WORDS_W / GROUP;
                sl[i][j] = bf16_at(rl, a) | (bf16_at(rl, a + FAR) << 16);
                sh[i][j] = bf16_at(rh, a) | (bf16_at(rh, a + FAR) << 16);
            }
        down_columns(dl, dh, sl, sh, act, order, weights, routed, first, pairs, h0);
    }
    cp_async_wait<0>();
}

// out[token] = the sum of its k rows of `routed` in pair order, in bfloat16 (a thread an element)
extern "C" __global__ void __launch_bounds__(256)
sum_pairs(const float* __restrict__ routed, bf16* __restrict__ out, int elements) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= elements) return;
    const long long base = (long long)(i / HIDDEN) * TOP_K * HIDDEN + i % HIDDEN;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < TOP_K; ++k) sum += routed[base + (long long)k * HIDDEN];
    out[i] = to_bf16(sum);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
down(const bf16* __restrict__ act, const id_t* __restrict__ ids, const float* __restrict__ weights,
     const uint4* __restrict__ down_p, const bf16* __restrict__ down_s, bf16* __restrict__ out, int p_stride_e,
     int p_stride_r, int s_stride_e, int s_stride_r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pair = lane / LANES_PER_PAIR, part = lane % LANES_PER_PAIR;
    const long long e = (long long)ids[pair];
    const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
    const int w0 = part * WORDS_PER_LANE;  // the lane's first word of each row
    uint4 q[ROWS][CHUNKS_PER_LANE];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const long long p_off = (e * p_stride_e + (long long)min(row0 + r, HIDDEN - 1) * p_stride_r + w0) / 4;
#pragma unroll
        for (int c = 0; c < CHUNKS_PER_LANE; ++c) q[r][c] = __ldg(down_p + p_off + c);
    }
    float a[8][WORDS_PER_LANE], a_sum[8][CHUNKS_PER_LANE];
    act_slice<false>(act + pair * WIDTH, w0, a, a_sum);
    const float weight = weights[pair];
#if ONE_GROUP
    bf16 sd[ROWS][8];  // the rows' scales, loaded before any math (as gate_up_split's)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = 0; j < 8; ++j)
            sd[r][j] = __ldg(down_s + e * s_stride_e + (long long)min(row0 + r, HIDDEN - 1) * s_stride_r + w0 / GROUP
                             + j * (WORDS_W / GROUP));
#endif
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + r;
#if ONE_GROUP  // the lane's words of a row lie in one group for each nibble: one scale a nibble (`sd`)
        const float lane_sum = down_row_one_group(q[r], a, a_sum, sd[r]);
#else
        const long long s_off = e * s_stride_e + (long long)min(row, HIDDEN - 1) * s_stride_r;
        float acc[2] = {0.0f, 0.0f};  // even and odd nibbles: two chains
#define DOT(J, C) nibble_dot_biased<J>(q[r][C], make_float4(a[J][4 * C], a[J][4 * C + 1], a[J][4 * C + 2],         \
                                                            a[J][4 * C + 3]), a_sum[J][C])
#pragma unroll
        for (int c = 0; c < CHUNKS_PER_LANE; ++c) {
#define DOWN(J) acc[J & 1] = fmaf(from_bf16(__ldg(down_s + s_off + (J * WORDS_W + w0 + 4 * c) / GROUP)), DOT(J, c),  \
                                  acc[J & 1]);
            FOR_NIBBLES(DOWN)
        }
#undef DOWN
#undef DOT
        const float lane_sum = acc[0] + acc[1];
#endif
        const float sum = warp_sum(lane_sum * weight);
        if (lane == 0 && row < HIDDEN) out[row] = to_bf16(sum);
    }
}

// ---- one token in one launch (`token_bulk`): block b of the grid's G takes row pairs [p0, p1) of the k x WIDTH
// (gate's and up's rows) and down's rows [r0, r1) of every chosen expert, and warp 0 asks the TMA unit for all of
// their words and scales at once (bulk copies into shared memory, an mbarrier a pair and one for down's rows), so every
// byte of the call is in flight from its start, down's too. Each pair is multiplied as it lands, exactly as
// `gate_up_split` does (warp (c, h): chunk c of every second pair from h, its x slice in registers; the chunks' sums in
// chunk order), its act written; a grid-wide wait (an arrival counter: every block is resident, one an SM, the grid
// no larger than the SMs); then each block's down rows from shared memory, exactly as `down` does. The same sums in
// the same order as the two launches: the same bits. The counters return to zero when the last block leaves.
#define TB_WARPS (2 * CHUNKS)
#define PAIR_BYTES (2 * WORDS_IN * 4 + 2 * (HIDDEN / GROUP) * 2)  // a pair's gate and up words, then their scales
#define DROW_BYTES (WORDS_W * 4)
#define DSROW_BYTES ((WIDTH / GROUP) * 2)
#ifndef TB_MATH
#define TB_MATH 1  // 0: copies and the grid-wide wait only (a probe of the loads' time; the output is not written)
#endif

extern "C" __global__ void __launch_bounds__(32 * TB_WARPS, 1)
token_bulk(const bf16* __restrict__ x, const id_t* __restrict__ ids, const float* __restrict__ weights,
           const uint4* __restrict__ gate_p, const bf16* __restrict__ gate_s, const uint4* __restrict__ up_p,
           const bf16* __restrict__ up_s, const uint4* __restrict__ down_p, const bf16* __restrict__ down_s,
           bf16* act, bf16* __restrict__ out, int* sync, int p_stride_e, int p_stride_r, int s_stride_e,
           int s_stride_r, int d_stride_e, int ds_stride_e) {
#if __CUDA_ARCH__ >= 900 && ONE_GROUP && WORDS_IN % GROUP == 0
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int PAIRS = TOP_K * WIDTH;
    const int blocks = gridDim.x, b = blockIdx.x;
    const int p0 = (int)((long long)b * PAIRS / blocks), np = (int)((long long)(b + 1) * PAIRS / blocks) - p0;
    const int r0 = (int)((long long)b * HIDDEN / blocks), nr = (int)((long long)(b + 1) * HIDDEN / blocks) - r0;
    const int most_pairs = (PAIRS + blocks - 1) / blocks, most_rows = (HIDDEN + blocks - 1) / blocks;
    unsigned long long* bars = (unsigned long long*)smem;  // [most_pairs + 1]: a pair's, then down's
    float (*part)[CHUNKS][2] = (float (*)[CHUNKS][2])(smem + 8 * (most_pairs + 1));
    unsigned char* pair_at = smem + ((8 * (most_pairs + 1) + most_pairs * CHUNKS * 8 + 127) & ~127);
    unsigned char* down_words = pair_at + most_pairs * PAIR_BYTES;  // [TOP_K][most_rows] rows of words
    unsigned char* down_scales = down_words + TOP_K * most_rows * DROW_BYTES;  // [TOP_K][most_rows] rows of scales
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        for (int i = 0; i <= np; ++i)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(smem_at(bars + i)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {  // every copy of the block: the pairs' in order, then down's rows
        if (lane == 0) {
            for (int i = 0; i < np; ++i)
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                             :: "r"(smem_at(bars + i)), "r"(PAIR_BYTES) : "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                         :: "r"(smem_at(bars + np)), "r"(TOP_K * nr * (DROW_BYTES + DSROW_BYTES)) : "memory");
        }
        __syncwarp();
        for (int task = lane; task < 4 * np + 2 * TOP_K; task += 32) {
            if (task < 4 * np) {  // pair i's gate words, up words, gate scales, up scales
                const int i = task >> 2, kind = task & 3, p = p0 + i;
                const long long e = (long long)ids[p / WIDTH], row = p % WIDTH;
                unsigned char* slot = pair_at + i * PAIR_BYTES;
                if (kind < 2)
                    bulk_copy(slot + kind * WORDS_IN * 4,
                              (kind ? up_p : gate_p) + (e * p_stride_e + row * p_stride_r) / 4, WORDS_IN * 4, bars + i);
                else
                    bulk_copy(slot + 2 * WORDS_IN * 4 + (kind - 2) * (HIDDEN / GROUP) * 2,
                              (kind == 3 ? up_s : gate_s) + e * s_stride_e + row * s_stride_r, (HIDDEN / GROUP) * 2,
                              bars + i);
            } else {  // expert k's rows [r0, r0 + nr) of down: words, scales
                const int t = task - 4 * np, k = t >> 1;
                const long long e = (long long)ids[k];
                if (t & 1)
                    bulk_copy(down_scales + k * most_rows * DSROW_BYTES,
                              down_s + e * ds_stride_e + (long long)r0 * (WIDTH / GROUP), nr * DSROW_BYTES, bars + np);
                else
                    bulk_copy(down_words + k * most_rows * DROW_BYTES,
                              down_p + (e * d_stride_e + (long long)r0 * WORDS_W) / 4, nr * DROW_BYTES, bars + np);
            }
        }
    }
    // gate and up: warp (c, h) takes chunk c of pairs h, h + 2, ... (`gate_up_split`'s lane sums)
    const int c = warp % CHUNKS, h = warp / CHUNKS;
    const int w = 4 * (lane + 32 * c);
    float4 xv[8];
    float x_sum[8];
    x_slice(x, w, xv, x_sum);
    for (int i = h; i < np; i += 2) {
        while (!bar_done(bars + i, 0)) {}
#if TB_MATH
        const unsigned char* slot = pair_at + i * PAIR_BYTES;
        const uint4 g = *(const uint4*)(slot + 16 * (lane + 32 * c));
        const uint4 u = *(const uint4*)(slot + WORDS_IN * 4 + 16 * (lane + 32 * c));
        const bf16* gs = (const bf16*)(slot + 2 * WORDS_IN * 4) + w / GROUP;
        const float2 sums = chunk_sums(g, u, Spaced{gs}, Spaced{gs + HIDDEN / GROUP}, xv, x_sum);
        if (lane == 0) { part[i][c][0] = sums.x; part[i][c][1] = sums.y; }
#endif
    }
    __syncthreads();
#if TB_MATH
    if (threadIdx.x < np) {
        const int i = threadIdx.x;
        act[p0 + i] = act_value(part[i]);
    }
    __syncthreads();
#endif
    // every block's act written: the grid-wide wait
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(sync, 1);
        while (*(volatile int*)sync < blocks) {}
        __threadfence();
        if (atomicAdd(sync + 1, 1) == blocks - 1) { sync[0] = 0; sync[1] = 0; }  // the last to leave: for the next call
    }
    __syncthreads();
    while (!bar_done(bars + np, 0)) {}
#if TB_MATH
    // down: warp w takes TB_ROWS rows at a time from w * TB_ROWS (`down`'s lane sums: lane l, expert l / (32 / k))
    const int pair = lane / LANES_PER_PAIR, w0 = (lane % LANES_PER_PAIR) * WORDS_PER_LANE;
    float a[8][WORDS_PER_LANE], a_sum[8][CHUNKS_PER_LANE];
    act_slice<true>(act + pair * WIDTH, w0, a, a_sum);  // other blocks' act
    const float weight = weights[pair];
    const unsigned char* dw = down_words + pair * most_rows * DROW_BYTES + w0 * 4;
    const bf16* ds = (const bf16*)(down_scales + pair * most_rows * DSROW_BYTES) + w0 / GROUP;
    for (int first = warp * TB_ROWS; first < nr; first += TB_WARPS * TB_ROWS) {
        uint4 q[TB_ROWS][CHUNKS_PER_LANE];
        bf16 sd[TB_ROWS][8];
#pragma unroll
        for (int r = 0; r < TB_ROWS; ++r) {
            const int row = min(first + r, nr - 1);
#pragma unroll
            for (int cc = 0; cc < CHUNKS_PER_LANE; ++cc) q[r][cc] = *(const uint4*)(dw + row * DROW_BYTES + 16 * cc);
#pragma unroll
            for (int j = 0; j < 8; ++j) sd[r][j] = ds[row * (WIDTH / GROUP) + j * (WORDS_W / GROUP)];
        }
#pragma unroll
        for (int r = 0; r < TB_ROWS; ++r) {
            const float sum = warp_sum(down_row_one_group(q[r], a, a_sum, sd[r]) * weight);
            if (lane == 0 && first + r < nr) out[r0 + first + r] = to_bf16(sum);
        }
    }
#endif
#endif
}
"""


def fits(hidden: int, width: int, group_size: int, top_k: int) -> bool:
    """The shapes the kernels take: 32 lanes of 16-byte chunks across a row's input words; each chunk's four words
    in one group for every nibble; k dividing 32, each of a pair's lanes a whole number of chunks of down's words."""
    words_in, words_w = hidden // 8, width // 8
    if hidden % group_size or width % group_size or group_size % 4 or words_in % (4 * LANES):
        return False
    if top_k < 1 or LANES % top_k:
        return False
    # hidden up to 12288: the sizes the forms were written for (a gate/up block is 32 * CHUNKS threads, x held in
    # registers; the tensor-core form's paired x, 2 * hidden bytes of shared memory, has its own bound: `mma_fits`)
    return words_w % (4 * (LANES // top_k)) == 0 and width % RPB == 0 and hidden <= 12288


def _defines(hidden: int, width: int, group_size: int, top_k: int, ids_dtype: torch.dtype) -> dict[str, str]:
    words_in, words_w = hidden // 8, width // 8
    per_pair = LANES // top_k
    return {
        "HIDDEN": hidden, "WIDTH": width, "GROUP": group_size, "TOP_K": top_k, "WARPS": WARPS, "ROWS": DOWN_ROWS,
        "WORDS_IN": words_in, "WORDS_W": words_w, "CHUNKS": words_in // (4 * LANES), "LANES_PER_PAIR": per_pair,
        "WORDS_PER_LANE": words_w // per_pair, "CHUNKS_PER_LANE": words_w // per_pair // 4,
        "IDS_T": "long long" if ids_dtype == torch.int64 else "int", "RPB": RPB, "SPLIT_MIN_BLOCKS": SPLIT_MIN_BLOCKS,
        "KSPLIT": mma_ksplit(hidden, group_size),
        "STAGES": STAGES, "PARTS": PARTS, "CHUNK": CHUNK, "BALANCE": BALANCE, "DCHUNK": DOWN_CHUNK,
        "DSTAGES": DOWN_STAGES,
        "DWARPS": DOWN_WARPS, "DBLOCKS": DOWN_BLOCKS, "TB_ROWS": TOKEN_BULK_ROWS,
        # a lane's words of a down row lie in one group for every nibble: its scale loaded once a nibble
        "ONE_GROUP": int(words_w % group_size == 0 and group_size % (words_w // per_pair) == 0),
    }  # fmt: skip


_COMPILED: dict[tuple, tuple[dict, dict]] = {}  # (constants, {name: kernel}) a key
# what `int4_moe_token` launches: "split" (`gate_up_split` then `down`: the fastest measured, BENCHMARKS.md section 8),
# "mma" (`gate_up_mma` then `down_mma`: as fast) or "bulk" (`token_bulk`, one launch: 28.2 against 18.2 us a call on
# one H100, its copies alone 13.5)
GATE_FORM = "split"


TOKEN_KERNELS = ("gate_up_split", "down", "gate_up_mma", "down_mma", "token_bulk")  # one token's forms
# a block of tokens' forms
BLOCK_KERNELS = (
    "gate_up_mma_tokens",
    "gate_up_mma_stream",
    "gate_up_mma_bulk",
    "down_mma_tokens",
    "down_mma_stream",
    "sum_pairs",
)
# a block's gate/up: "bulk" (`gate_up_mma_bulk`: persistent blocks, the next tile's rows copied in by the TMA unit
# while the current one is multiplied), "stream" (`gate_up_mma_stream`: the same by cp.async, every lane its own
# words, the tiles strided over the grid) or "tiles" (`gate_up_mma_tokens`: a block a tile, its words loaded into
# registers); its down: "stream"
# (`down_mma_stream`: persistent warps, cp.async) or "tiles" (`down_mma_tokens`). Measured fastest first
# (BENCHMARKS.md, section 8); each falls back to the next where the tensors' alignment does not allow it.
BLOCK_GATE = "bulk"
BLOCK_DOWN = "stream"


def kernels(device: torch.device, hidden: int, width: int, group_size: int, top_k: int, ids_dtype: torch.dtype,
            names: tuple[str, ...] = TOKEN_KERNELS, **overrides) -> tuple[dict, dict]:  # fmt: skip
    """(the constants they were compiled with, {name: kernel}) for these dimensions on this device's architecture,
    compiled once a process; `overrides` replace launch constants (WARPS, ROWS, RPB, SPLIT_MIN_BLOCKS, KSPLIT:
    `benchmarks/int4_token_probe.py` times them)."""
    key = (device, hidden, width, group_size, top_k, ids_dtype, names, tuple(sorted(overrides.items())))
    if key not in _COMPILED:
        defines = {**_defines(hidden, width, group_size, top_k, ids_dtype), **overrides}
        source = kernel_source(defines)
        major, minor = torch.cuda.get_device_capability(device)
        with torch.cuda.device(device):
            _COMPILED[key] = (defines, compile_source(source, names, f"{major}{minor}"))
    return _COMPILED[key]


def kernel_source(defines: dict) -> str:
    """`SOURCE` with its compile-time constants defined first."""
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE


NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")


def compile_source(source: str, names: tuple[str, ...], capability: str, together: bool = True) -> dict:
    """{name: kernel} of the `extern "C"` kernels `names` of `source`, for compute capability `capability` ("90"):
    one NVRTC compile of the source and one module for all of them (`together`), or, where this torch lacks the
    module loader, one `torch.cuda._compile_kernel` a name (each compiles the whole source)."""
    options = list(NVRTC_OPTIONS)
    if together:
        try:
            from torch.cuda._utils import _cuda_load_module, _nvrtc_compile
        except ImportError:
            together = False
    if not together:
        return {name: torch.cuda._compile_kernel(source, name, compute_capability=capability, nvcc_options=options)
                for name in names}  # fmt: skip
    binary, _ = _nvrtc_compile(source, names[0], capability, None, options)  # extern "C": the names as written
    return _cuda_load_module(binary, list(names))


def launch(x, ids, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, act, out, group_size,
           gate_form: str | None = None, **overrides) -> None:  # fmt: skip
    """The launches into `act` [k, width] and `out` [1, hidden] (ids and weights flat, as `int4_moe_token` prepares
    them): `gate_form` (None: `GATE_FORM`, read at the call) "bulk" (one launch, `token_bulk`, where it fits), "split"
    or "mma" (two)."""
    gate_form = GATE_FORM if gate_form is None else gate_form
    hidden, width, top_k = x.shape[1], gate_packed.shape[1], ids.numel()
    defines, compiled = kernels(x.device, hidden, width, group_size, top_k, ids.dtype, **overrides)
    gate_args = [x, ids, gate_packed, gate_scale, up_packed, up_scale, act, gate_packed.stride(0),
                 gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1)]  # fmt: skip
    if gate_form == "bulk" and token_bulk_fits(defines, x.device, gate_packed, gate_scale, up_packed, up_scale,
                                               down_packed, down_scale):  # fmt: skip
        blocks = torch.cuda.get_device_properties(x.device).multi_processor_count
        kernel, smem = compiled["token_bulk"], _token_bulk_bytes(defines, blocks)
        _allow_shared_memory(kernel, smem)
        kernel(grid=(blocks, 1, 1), block=(LANES * 2 * defines["CHUNKS"], 1, 1), shared_mem=smem,
               args=[x, ids, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, act, out,
                     _grid_counters(x.device), gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0),
                     gate_scale.stride(1), down_packed.stride(0), down_scale.stride(0)])  # fmt: skip
        return
    if gate_form == "bulk":
        gate_form = "split"  # what the one-launch form cannot take (`token_bulk_fits`): the two launches
    if gate_form == "mma":  # the tensor-core pair of launches
        compiled["gate_up_mma"](
            grid=(top_k * width // 8, 1, 1), block=(LANES * defines["KSPLIT"], 1, 1), args=gate_args
        )
        compiled["down_mma"](grid=(hidden // 16, 1, 1), block=(LANES * top_k, 1, 1),
                             args=[act, ids, weights, down_packed, down_scale, out, down_packed.stride(0),
                                   down_packed.stride(1), down_scale.stride(0), down_scale.stride(1)])  # fmt: skip
        return
    if gate_form != "split":
        raise ValueError(f"gate_form: expected 'bulk', 'split' or 'mma', got {gate_form!r}")
    compiled["gate_up_split"](grid=(top_k * width // defines["RPB"], 1, 1), block=(LANES * defines["CHUNKS"], 1, 1),
                              args=gate_args)  # fmt: skip
    rows = defines["WARPS"] * defines["ROWS"]
    compiled["down"](grid=(-(-hidden // rows), 1, 1), block=(LANES * defines["WARPS"], 1, 1),
                     args=[act, ids, weights, down_packed, down_scale, out, down_packed.stride(0),
                           down_packed.stride(1), down_scale.stride(0), down_scale.stride(1)])  # fmt: skip


def _token_bulk_bytes(defines: dict, blocks: int) -> int:
    """`token_bulk`'s shared memory with `blocks` blocks: a block's mbarriers and chunk sums (to 128 bytes), its row
    pairs' words and scales, and down's rows of every chosen expert."""
    pairs = -(-defines["TOP_K"] * defines["WIDTH"] // blocks)
    rows = -(-defines["HIDDEN"] // blocks)
    head = (8 * (pairs + 1) + pairs * defines["CHUNKS"] * 8 + 127) // 128 * 128
    pair_bytes = 2 * defines["WORDS_IN"] * 4 + 2 * (defines["HIDDEN"] // defines["GROUP"]) * 2
    row_bytes = defines["WORDS_W"] * 4 + (defines["WIDTH"] // defines["GROUP"]) * 2
    return head + pairs * pair_bytes + defines["TOP_K"] * rows * row_bytes


def token_bulk_fits(defines: dict, device: torch.device, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                    down_scale) -> bool:  # fmt: skip
    """Whether `token_bulk` runs here: bulk copies (sm_90 and later) of 16-byte aligned rows (`_bulk_fits`; down's
    rows contiguous, an expert's run of them one copy), a lane's down words in one group (`ONE_GROUP`) and nibbles'
    groups at constant offsets (`WORDS_IN` a multiple of the group), and a block's share in the shared memory a block
    may have, one block an SM."""
    if torch.cuda.get_device_capability(device) < (9, 0) or not defines["ONE_GROUP"]:
        return False
    if defines["WORDS_IN"] % defines["GROUP"] or not _bulk_fits(defines["HIDDEN"], defines["GROUP"], gate_packed,
                                                                 up_packed, gate_scale, up_scale):  # fmt: skip
        return False
    if not _bulk_fits(defines["WIDTH"], defines["GROUP"], down_packed, down_scale):
        return False
    if down_packed.stride(1) != defines["WORDS_W"] or down_scale.stride(1) != defines["WIDTH"] // defines["GROUP"]:
        return False
    blocks = torch.cuda.get_device_properties(device).multi_processor_count
    return _token_bulk_bytes(defines, blocks) <= _shared_memory_limit(device)


_COUNTERS: dict = {}  # device index -> `token_bulk`'s two grid counters (zero between calls)


def _grid_counters(device: torch.device) -> torch.Tensor:
    """`token_bulk`'s arrival and departure counters on `device`: made once (zeros), each call leaves them at zero.
    Calls on one device run one after another (one stream's order), as the forwards make them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("token_bulk's counters are made by a call before any CUDA graph captures one")
        _COUNTERS[index] = torch.zeros(2, dtype=torch.int32, device=device)
    return _COUNTERS[index]


def int4_moe_token(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                   down_scale, group_size: int) -> torch.Tensor:  # fmt: skip
    """`reference.int4_moe` for one bfloat16 token on a CUDA device, the words in the "rows" layout: [1, hidden]."""
    tokens, hidden = x.shape
    width, top_k = gate_packed.shape[1], expert_ids.shape[-1]
    if tokens != 1 or x.dtype != torch.bfloat16 or not fits(hidden, width, group_size, top_k):
        raise ValueError(f"the CUDA token kernels take one bfloat16 token at dimensions `fits` accepts: got x "
                         f"{tuple(x.shape)} {x.dtype}, width {width}, group {group_size}, k {top_k}")  # fmt: skip
    _check_experts(gate_packed, up_packed, down_packed, gate_scale, up_scale, down_scale)
    ids = expert_ids.reshape(-1)
    ids = ids if ids.dtype in (torch.int32, torch.int64) and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    weights = expert_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((top_k, width), dtype=torch.bfloat16, device=x.device)
    out = torch.empty_like(x)
    launch(x.contiguous(), ids, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, act,
           out, group_size)  # fmt: skip
    return out


def block_form() -> dict:
    """What a block of tokens runs now: its gate/up and down forms and their launch constants, and one token's form
    (for a benchmark's record)."""
    names = ("STAGES", "PARTS", "CHUNK", "BALANCE", "DOWN_CHUNK", "DOWN_STAGES", "DOWN_WARPS", "DOWN_BLOCKS")
    return {"gate": BLOCK_GATE, "down": BLOCK_DOWN, **{name: globals()[name] for name in names}, "token": GATE_FORM}


def block_fits(hidden: int, width: int, group_size: int, top_k: int) -> bool:
    """The block form's shapes: the tensor-core forms' 16-word steps, 8-row gate/up and 16-row down tiles
    (`mma_fits`, without its bound on shared memory: x and act come straight from global memory)."""
    return _mma_shapes(hidden, width, group_size) and top_k >= 1


def launch_block(x, order, token, start, count, slot_expert, active, weights, gate_packed, gate_scale, up_packed,
                 up_scale, down_packed, down_scale, act, routed, out, group_size, gate: str = BLOCK_GATE,
                 down: str = BLOCK_DOWN, **overrides) -> None:  # fmt: skip
    """The block form's three launches: gate/up into `act` [pairs, width] (sorted order), down into `routed`
    [T x k, hidden] float32, their sum into `out` [T, hidden]; the routing as `kernel.route` makes it (`active`: the
    number of experts chosen, on the device). `overrides`: KSPLIT (gate/up warps a block), WARPS (`down_mma_tokens`'
    warps a block), STAGES, PARTS, DSTAGES, DWARPS, DBLOCKS (the persistent forms'); `gate`: `BLOCK_GATE`'s forms
    (`block_forms` says which run on this device and these tensors)."""
    tokens, hidden = x.shape
    width, slots = gate_packed.shape[1], slot_expert.numel()
    top_k = order.numel() // tokens
    # two 16-word steps a gate/up warp (Kimi K2.x: 28 warps, 72 registers a thread): measured faster than four, in
    # both gate/up forms (BENCHMARKS.md, section 8)
    shape = {"KSPLIT": mma_ksplit(hidden, group_size, most=32), **overrides}
    defines, compiled = kernels(x.device, hidden, width, group_size, top_k, torch.int32, BLOCK_KERNELS, **shape)
    gate, down = block_forms(defines, gate, down, torch.cuda.get_device_capability(x.device),
                             _shared_memory_limit(x.device), gate_packed, up_packed, gate_scale, up_scale,
                             down_scale)  # fmt: skip
    gate_args = [x, token, slot_expert, start, count, gate_packed, gate_scale, up_packed, up_scale, act,
                 gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1)]  # fmt: skip
    tasks, threads = slots * (width // 8), LANES * defines["KSPLIT"]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    queues = torch.zeros(2, dtype=torch.int32, device=x.device)  # the persistent forms' task queues
    if gate == "bulk":
        kernel, smem = compiled["gate_up_mma_bulk"], _bulk_bytes(defines)
        _allow_shared_memory(kernel, smem)
        kernel(grid=(min(tasks, sms), 1, 1), block=(threads, 1, 1), args=[*gate_args, active, queues[0:1]],
               shared_mem=smem)  # fmt: skip
    elif gate == "stream":
        kernel, smem = compiled["gate_up_mma_stream"], _stream_bytes(defines)
        _allow_shared_memory(kernel, smem)
        kernel(grid=(min(tasks, sms), 1, 1), block=(threads, 1, 1), args=[*gate_args, active], shared_mem=smem)
    else:
        compiled["gate_up_mma_tokens"](grid=(tasks, 1, 1), block=(threads, 1, 1), args=gate_args)
    down_args = [act, order, weights, slot_expert, start, count, down_packed, down_scale, routed,
                 down_packed.stride(0), down_packed.stride(1), down_scale.stride(0), down_scale.stride(1)]  # fmt: skip
    if down == "stream":
        kernel, smem = compiled["down_mma_stream"], _down_stream_bytes(defines)
        _allow_shared_memory(kernel, smem)
        warps = slots * (hidden // 16)  # the most tasks there can be: a warp each at least
        blocks = min(sms * defines["DBLOCKS"], -(-warps // defines["DWARPS"]))
        kernel(grid=(blocks, 1, 1), block=(LANES * defines["DWARPS"], 1, 1), args=[*down_args, active, queues[1:2]],
               shared_mem=smem)  # fmt: skip
    else:
        tiles = -(-hidden // (16 * defines["WARPS"]))
        compiled["down_mma_tokens"](grid=(slots * tiles, 1, 1), block=(LANES * defines["WARPS"], 1, 1),
                                    args=down_args)  # fmt: skip
    elements = tokens * hidden
    compiled["sum_pairs"](grid=(-(-elements // 256), 1, 1), block=(256, 1, 1), args=[routed, out, elements])


def block_forms(defines: dict, gate: str, down: str, capability: tuple[int, int], shared_memory: int, gate_packed,
                up_packed, gate_scale, up_scale, down_scale) -> tuple[str, str]:  # fmt: skip
    """The gate/up and down forms `launch_block` runs when asked for `gate` and `down`: each where the GPU
    (`capability`; bulk copies from sm_90), the tensors' alignment and the shared memory a block may have
    (`shared_memory` bytes) allow it, else the next one that fits: "bulk", "stream", "tiles" for gate/up, "stream",
    "tiles" for down."""
    if gate not in ("bulk", "stream", "tiles") or down not in ("stream", "tiles"):
        raise ValueError(f"gate: expected 'bulk', 'stream' or 'tiles', down: 'stream' or 'tiles'; got {gate!r} and "
                         f"{down!r}")  # fmt: skip
    hidden, width, group = defines["HIDDEN"], defines["WIDTH"], defines["GROUP"]
    bulk = _bulk_fits(hidden, group, gate_packed, up_packed, gate_scale, up_scale)
    if gate == "bulk" and not (capability >= (9, 0) and _bulk_bytes(defines) <= shared_memory and bulk):
        gate = "stream"
    if gate == "stream" and not (_stream_bytes(defines) <= shared_memory and _stream_fits(gate_scale, up_scale)):
        gate = "tiles"
    if down == "stream" and not (_down_stream_bytes(defines) <= shared_memory
                                 and _down_stream_fits(width, group, down_scale)):  # fmt: skip
        down = "tiles"
    return gate, down


_SHARED_MEMORY: dict = {}  # device -> the shared memory a block may opt in to


def _shared_memory_limit(device: torch.device) -> int:
    """The bytes of shared memory a block may opt in to on `device` (the driver's answer, asked once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        if not limit:
            import ctypes

            driver = torch.cuda._utils._get_gpu_runtime_library()
            value = ctypes.c_int()
            max_shared_memory_per_block_optin = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            if driver.cuDeviceGetAttribute(ctypes.byref(value), max_shared_memory_per_block_optin, index) != 0:
                raise RuntimeError(f"could not ask the driver for device {index}'s shared memory a block")
            limit = value.value
        _SHARED_MEMORY[index] = limit
    return _SHARED_MEMORY[index]


def _allow_shared_memory(kernel, size: int) -> None:
    """Let `kernel` launch with `size` bytes of dynamic shared memory (past 48 KB it must opt in)."""
    if getattr(kernel, "_max_shared_mem_bytes", 0) >= size:
        return
    if hasattr(kernel, "set_shared_memory_config"):
        kernel.set_shared_memory_config(size)
        return
    import ctypes

    driver = torch.cuda._utils._get_gpu_runtime_library()
    max_dynamic_shared_size_bytes = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if driver.cuFuncSetAttribute(kernel.func, max_dynamic_shared_size_bytes, ctypes.c_int(size)) != 0:
        raise RuntimeError(f"could not allow {size} bytes of shared memory for a block")
    kernel._max_shared_mem_bytes = size  # allowed once: later launches skip the driver call


def _stream_bytes(defines: dict) -> int:
    """`gate_up_mma_stream`'s shared memory: STAGES stages of words (16 bytes a lane a step, gate and up) and of
    scale words (4 bytes a value, 16 values a row a group), and PARTS passes' column sums of every warp."""
    ksplit, stages = defines["KSPLIT"], defines["STAGES"]
    steps = defines["WORDS_IN"] // 16 // ksplit
    groups = -(-steps // max(1, defines["GROUP"] // 16))
    return (
        stages * (ksplit * steps * 2 * LANES * 16 + ksplit * 8 * 16 * groups * 4)
        + defines["PARTS"] * ksplit * 2 * 8 * 8 * 4
    )


def _bulk_bytes(defines: dict) -> int:
    """`gate_up_mma_bulk`'s shared memory: its mbarriers (128 bytes), STAGES stages of 8 rows of gate's and of up's
    words and scales (each row padded: 64 bytes a row of words, 16 a row of scales), PARTS passes' column sums."""
    stage = 16 * (defines["WORDS_IN"] * 4 + 64) + 16 * (defines["HIDDEN"] // defines["GROUP"] * 2 + 16)
    return 128 + defines["STAGES"] * stage + defines["PARTS"] * defines["KSPLIT"] * 2 * 8 * 8 * 4


def _bulk_fits(hidden: int, group_size: int, *experts: torch.Tensor) -> bool:
    """Bulk copies move 16-byte aligned multiples of 16 bytes: every expert's and row's words and scales start at a
    16-byte boundary, and a row's scales are a multiple of 16 bytes."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                  and t.stride(1) * t.element_size() % 16 == 0 for t in experts)  # fmt: skip
    return aligned and (hidden // group_size) % 8 == 0


def _down_stream_bytes(defines: dict) -> int:
    """`down_mma_stream`'s shared memory: DSTAGES stages a warp, each its words (16 bytes a lane a step, rows g and
    g + 8), its 16 rows' scales and its task."""
    stage = 2 * (defines["WORDS_W"] // 16) * LANES * 16 + 16 * (defines["WIDTH"] // defines["GROUP"]) * 2
    return defines["DWARPS"] * defines["DSTAGES"] * (stage + 4)


def _stream_fits(*scales: torch.Tensor) -> bool:
    """`gate_up_mma_stream` copies a scale as the 4-byte word that holds it: every expert's and row's scales start
    at an even index of a 4-byte aligned tensor."""
    return all(t.data_ptr() % 4 == 0 and t.stride(0) % 2 == 0 and t.stride(1) % 2 == 0 for t in scales)


def _down_stream_fits(width: int, group_size: int, down_scale: torch.Tensor) -> bool:
    """`down_mma_stream` copies a row's scales 16 bytes at a time: 8 | width / group, and every expert's and row's
    scales 16-byte aligned."""
    aligned = down_scale.data_ptr() % 16 == 0 and down_scale.stride(0) % 8 == 0 and down_scale.stride(1) % 8 == 0
    return (width // group_size) % 8 == 0 and aligned


def int4_moe_block(x, routing, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                   group_size: int, gate: str = BLOCK_GATE, down: str = BLOCK_DOWN,
                   **overrides) -> torch.Tensor:  # fmt: skip
    """`reference.int4_moe` for T bfloat16 tokens on a CUDA device, the words in the "rows" layout, `routing` the
    (order, token, start, count, slot -> expert, experts chosen) of `kernel.route`: [T, hidden]. `overrides`:
    `launch_block`'s."""
    order, token, start, count, slot_expert, active = routing
    tokens, hidden = x.shape
    width, pairs = gate_packed.shape[1], order.numel()
    if x.dtype != torch.bfloat16 or pairs % tokens or not block_fits(hidden, width, group_size, pairs // tokens):
        raise ValueError(f"the CUDA block kernels take bfloat16 tokens at dimensions `block_fits` accepts: got x "
                         f"{tuple(x.shape)} {x.dtype}, width {width}, group {group_size}, {pairs} pairs")  # fmt: skip
    _check_experts(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    if order.dtype != torch.int64 or any(t.dtype != torch.int32 for t in (token, start, count, slot_expert, active)):
        raise ValueError("the CUDA block kernels read the routing as `kernel.route` makes it: int64 order, int32 rest")
    weights = expert_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((pairs, width), dtype=torch.bfloat16, device=x.device)
    routed = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    launch_block(x.contiguous(), order.contiguous(), token.contiguous(), start, count, slot_expert.contiguous(),
                 active, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, act, routed,
                 out, group_size, gate, down, **overrides)  # fmt: skip
    return out


def _check_experts(*tensors) -> None:
    for t in tensors:
        if t.stride(-1) != 1 or t.dtype not in (torch.int32, torch.bfloat16):
            raise ValueError(f"the CUDA kernels need rows of contiguous int32 words and bfloat16 scales: got "
                             f"{t.dtype} with strides {t.stride()}")  # fmt: skip


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., 4] int32 words -> [..., 8 nibbles j, 4 words] float32 (value - 8), as `nibble_dot_biased` sums them."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (((words.unsqueeze(-2) >> shifts[:, None]) & 0xF) - 8).to(torch.float32)


def _butterfly(values: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension (32 lanes) in `warp_sum`'s order: every lane ends with the same total."""
    lanes = torch.arange(LANES)
    for m in (16, 8, 4, 2, 1):
        values = values + values[..., lanes ^ m]
    return values[..., 0]


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def algorithm(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
              group_size: int) -> torch.Tensor:  # fmt: skip
    """The split form's computation in torch, lane by lane (CPU; float32 sums, bfloat16 act and output): gate and up
    summed over each chunk's lanes, then the chunks in order."""
    hidden, width, top_k = x.shape[1], gate_packed.shape[1], expert_ids.shape[-1]
    words_in, words_w = hidden // 8, width // 8
    ids, weights = expert_ids.reshape(-1).long(), expert_weights.reshape(-1).float()
    xs = x[0].float()
    lanes, chunks = torch.arange(LANES), words_in // (4 * LANES)
    act = torch.empty(top_k, width, dtype=torch.bfloat16)
    for pair in range(top_k):
        e = int(ids[pair])
        sums = []
        for packed, scale in ((gate_packed, gate_scale), (up_packed, up_scale)):
            total = torch.zeros(width)
            for c in range(chunks):  # warp c, then the warps' sums in chunk order
                acc = torch.zeros(width, LANES)
                w = 4 * (lanes + LANES * c)  # [lanes]: each lane's first word of chunk c
                words = packed[e][:, w[:, None] + torch.arange(4)]  # [rows, lanes, 4]
                for j in range(8):
                    inputs = j * words_in + w[:, None] + torch.arange(4)  # [lanes, 4]
                    dot = (_nibbles(words)[:, :, j] * xs[inputs]).sum(-1)  # [rows, lanes]
                    acc = acc + scale[e][:, (j * words_in + w) // group_size].float() * dot
                total = total + _butterfly(acc)
            sums.append(total)
        g, u = sums
        act[pair] = _to_bf16(g / (1.0 + torch.exp(-g)) * u)
    per_pair = LANES // top_k
    per_lane = words_w // per_pair
    acc = torch.zeros(hidden, LANES)
    for lane in range(LANES):
        pair, part = divmod(lane, per_pair)
        e, w0 = int(ids[pair]), part * per_lane
        lane_acc = torch.zeros(hidden)
        for c in range(per_lane // 4):
            words = down_packed[e][:, w0 + 4 * c : w0 + 4 * c + 4]  # [hidden, 4]
            for j in range(8):
                inputs = j * words_w + w0 + 4 * c + torch.arange(4)
                dot = (_nibbles(words)[:, j] * act[pair, inputs].float()).sum(-1)
                lane_acc = lane_acc + down_scale[e][:, (j * words_w + w0 + 4 * c) // group_size].float() * dot
        acc[:, lane] = lane_acc * weights[pair]
    return _to_bf16(_butterfly(acc))[None]


# ---- the tensor-core forms (`gate_up_mma`, `down_mma`) ------------------------------------------------------------


def mma_ksplit(hidden: int, group_size: int, most: int = 16) -> int:
    """Warps a `gate_up_mma` block splits its rows' 16-word steps over: the most, up to `most`, that divide them into
    whole groups a warp (Kimi K2.x: 56 steps of 2 a group, 14 warps of 4; up to 32, `gate_up_mma_tokens`'s: 28 of
    2)."""
    steps, per_group = hidden // 8 // 16, max(1, group_size // 16)
    return max([d for d in range(1, most + 1) if steps % d == 0 and (steps // d) % per_group == 0] or [1])


def _mma_shapes(hidden: int, width: int, group_size: int) -> bool:
    """16-word steps (each inside one group, whole groups a warp), 8-row tiles of gate and up, 16-row tiles of down."""
    words_in, words_w = hidden // 8, width // 8
    steps_per_warp = words_in // 16 // mma_ksplit(hidden, group_size) if words_in % 16 == 0 else 0
    return (hidden % 16 == 0 and width % 16 == 0 and words_in % 16 == 0 and words_w % 16 == 0
            and steps_per_warp * 16 % group_size == 0
            and group_size % 16 == 0 and words_in % group_size == 0 and words_w % group_size == 0)  # fmt: skip


def mma_fits(hidden: int, width: int, group_size: int, top_k: int) -> bool:
    """The tensor-core token forms' shapes (`_mma_shapes`), a warp a pair in down, x and act paired in 48 KB of
    shared memory."""
    words_in, words_w = hidden // 8, width // 8
    return (_mma_shapes(hidden, width, group_size) and 1 <= top_k <= 32 and 16 * words_in <= 48 * 1024
            and top_k * 16 * words_w <= 48 * 1024)  # fmt: skip


def _fragment_maps():
    """The m16n8k16 fragments' element positions (PTX ISA, `mma.m16n8k16` with .bf16): lane (g = lane / 4, t = lane
    % 4), register r, half h of A -> (row g + 8 (r % 2), k 2t + h + 8 (r / 2)); of B -> (k 2t + h + 8 r, column g);
    C element i -> (row g + 8 (i / 2), column 2t + i % 2)."""
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    reg, half = torch.arange(4)[None, :, None], torch.arange(2)[None, None, :]
    a_row = (g[:, None, None] + 8 * (reg % 2)).expand(LANES, 4, 2)
    a_k = 2 * t[:, None, None] + half + 8 * (reg // 2)
    b_k = (2 * t[:, None, None] + half + 8 * torch.arange(2)[None, :, None]).expand(LANES, 2, 2)
    b_n = g[:, None, None].expand(LANES, 2, 2)
    c_row = g[:, None] + 8 * (torch.arange(4)[None, :] // 2)
    c_col = 2 * t[:, None] + torch.arange(4)[None, :] % 2
    return a_row, a_k, b_k, b_n, c_row, c_col


def _mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One warp's m16n8k16 MMA from its fragments: a [..., 32, 4, 2], b [..., 32, 2, 2], c [..., 32, 4] float32."""
    a_row, a_k, b_k, b_n, c_row, c_col = _fragment_maps()
    lead = a.shape[:-3]
    matrix_a = torch.zeros(*lead, 16, 16)
    matrix_a[..., a_row, a_k] = a
    matrix_b = torch.zeros(*b.shape[:-3], 16, 8)
    matrix_b[..., b_k, b_n] = b
    return c + (matrix_a @ matrix_b)[..., c_row, c_col]


def _scaled_pairs(words: torch.Tensor, j: int, scale_lo: torch.Tensor, scale_hi: torch.Tensor) -> torch.Tensor:
    """`scaled_pair` of words >> 4j: [..., 2] bfloat16 values (n_J - 8) * s_lo, (n_(J+4) - 8) * s_hi, as float32."""
    lo = (((words >> (4 * j)) & 0xF) - 8).float() * scale_lo
    hi = (((words >> (4 * j + 16)) & 0xF) - 8).float() * scale_hi
    return torch.stack([lo, hi], dim=-1).to(torch.bfloat16).float()


def _mma_rows(lo_words, hi_words, lo_scales, hi_scales, values, step: int, words: int, group_size: int,
              c: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`mma_step` for a batch of warps: lo/hi_words [..., 8 rows g, words] (rows g and g + 8 of each warp's tile),
    their scales [..., 8 rows, groups], values the B side: [8 * words] (one row for every column, paired as `xp`)
    or [8 columns, 8 * words] (column g its own row: `RowPairs`), c [..., 32, 4]."""
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    base = 16 * step
    far = 4 * words // group_size
    w4 = base + 4 * t[:, None] + torch.arange(4)  # [32, 4]: the thread's four words
    lo_w = lo_words[..., g[:, None], w4]  # [..., 32, 4]
    hi_w = hi_words[..., g[:, None], w4]
    for j in range(4):
        group = (j * words + base) // group_size
        s_lo = lo_scales[..., g, group].float(), lo_scales[..., g, group + far].float()
        s_hi = hi_scales[..., g, group].float(), hi_scales[..., g, group + far].float()
        for q in range(2):
            a = torch.stack([
                _scaled_pairs(lo_w[..., 2 * q], j, *s_lo), _scaled_pairs(hi_w[..., 2 * q], j, *s_hi),
                _scaled_pairs(lo_w[..., 2 * q + 1], j, *s_lo), _scaled_pairs(hi_w[..., 2 * q + 1], j, *s_hi),
            ], dim=-2)  # fmt: skip
            w = base + 4 * t + 2 * q  # [32]
            pair = [torch.stack([_column(values, g, j * words + v), _column(values, g, (j + 4) * words + v)], -1)
                    for v in (w, w + 1)]  # fmt: skip
            b = torch.stack(pair, -2)  # [32, register, half]
            c = _mma(a, b, c)
    return c


def _column(values: torch.Tensor, g: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The B values lane (g, t) reads at `inputs` [32]: one row for every column, or column g's own."""
    return values[inputs] if values.dim() == 1 else values[g, inputs]


def algorithm_mma(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                  down_scale, group_size: int, ksplit: int | None = None) -> torch.Tensor:  # fmt: skip
    """`gate_up_mma` and `down_mma` in torch, fragment by fragment (CPU): each warp's A and B fragments made as the
    kernels make them, multiplied by the MMA's layout (`_fragment_maps`), float32 sums, bfloat16 act and output."""
    hidden, width, top_k = x.shape[1], gate_packed.shape[1], expert_ids.shape[-1]
    words_in, words_w = hidden // 8, width // 8
    ksplit = ksplit or mma_ksplit(hidden, group_size)
    per_warp = words_in // 16 // ksplit
    ids, weights = expert_ids.reshape(-1).long(), expert_weights.reshape(-1).float()
    xs = x[0].to(torch.bfloat16).float()
    tiles = width // 8
    gate_w = gate_packed[ids].reshape(top_k, tiles, 8, words_in)  # [pair, tile, row g, words]
    up_w = up_packed[ids].reshape(top_k, tiles, 8, words_in)
    gate_sc = gate_scale[ids].reshape(top_k, tiles, 8, -1)
    up_sc = up_scale[ids].reshape(top_k, tiles, 8, -1)
    sums = torch.zeros(top_k, tiles, 8, 2)
    for warp in range(ksplit):  # the block's warps, then their sums in warp order
        c = torch.zeros(top_k, tiles, LANES, 4)
        for i in range(per_warp):
            c = _mma_rows(gate_w, up_w, gate_sc, up_sc, xs, warp * per_warp + i, words_in, group_size, c)
        sums = sums + torch.stack([c[..., 0::4, 0], c[..., 0::4, 2]], dim=-1)  # lanes t = 0: column 0
    gate, up = sums[..., 0].reshape(top_k, width), sums[..., 1].reshape(top_k, width)
    act = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16).float()
    row_tiles = hidden // 16
    out = torch.zeros(row_tiles, 16)
    for p in range(top_k):  # warp p of every block, then the pairs in order
        rows_w = down_packed[ids[p]].reshape(row_tiles, 2, 8, words_w)  # [tile, rows g / g + 8, g, words]
        rows_s = down_scale[ids[p]].reshape(row_tiles, 2, 8, -1)
        c = torch.zeros(row_tiles, LANES, 4)
        for step in range(words_w // 16):
            c = _mma_rows(rows_w[:, 0], rows_w[:, 1], rows_s[:, 0], rows_s[:, 1], act[p], step, words_w, group_size,
                          c)  # fmt: skip
        out = out + torch.cat([c[:, 0::4, 0], c[:, 0::4, 2]], dim=-1) * weights[p]
    return out.reshape(1, hidden).to(torch.bfloat16)


def algorithm_mma_block(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                        down_scale, group_size: int, ksplit: int | None = None) -> torch.Tensor:  # fmt: skip
    """`gate_up_mma_tokens`, `down_mma_tokens` and `sum_pairs` in torch, fragment by fragment (CPU), for T tokens:
    the pairs sorted by expert, each chosen expert's tiles multiplied by up to 8 of its pairs at a time (the MMA's
    columns, the last pair's row past its end), the C fragments' columns written to their pairs' rows."""
    tokens, hidden = x.shape
    width, top_k = gate_packed.shape[1], expert_ids.shape[-1]
    words_in, words_w = hidden // 8, width // 8
    ksplit = ksplit or mma_ksplit(hidden, group_size)
    per_warp = words_in // 16 // ksplit
    ids, weights = expert_ids.reshape(-1).long(), expert_weights.reshape(-1).float()
    order = ids.argsort(stable=True)  # `kernel.route`'s order: by expert, then pair
    token, counts = order // top_k, torch.bincount(ids, minlength=gate_packed.shape[0])
    starts = counts.cumsum(0) - counts
    xs = x.to(torch.bfloat16).float()
    lane = torch.arange(LANES)
    g, t = lane // 4, lane % 4
    act = torch.zeros(ids.numel(), width)  # sorted order, bfloat16 values
    tiles, row_tiles = width // 8, hidden // 16

    def columns(first: int, count: int, m0: int) -> torch.Tensor:
        return first + torch.clamp(m0 + torch.arange(8), max=count - 1)

    chosen = [(int(e), int(starts[e]), int(counts[e])) for e in counts.nonzero().flatten()]
    for e, first, count in chosen:
        gate_w, up_w = gate_packed[e].reshape(tiles, 8, words_in), up_packed[e].reshape(tiles, 8, words_in)
        gate_sc, up_sc = gate_scale[e].reshape(tiles, 8, -1), up_scale[e].reshape(tiles, 8, -1)
        for m0 in range(0, count, 8):
            values = xs[token[columns(first, count, m0)]]  # [8 columns, hidden]
            sums = torch.zeros(tiles, 2, 8, 8)  # gate / up, row g, column
            for warp in range(ksplit):  # the block's warps, then their sums in warp order
                c = torch.zeros(tiles, LANES, 4)
                for i in range(per_warp):
                    c = _mma_rows(gate_w, up_w, gate_sc, up_sc, values, warp * per_warp + i, words_in, group_size, c)
                part = torch.zeros(tiles, 2, 8, 8)
                for r in range(4):  # c[r]: row g (gate) or g + 8 (up), column 2t + r % 2
                    part[:, r // 2, g, 2 * t + r % 2] = c[:, :, r]
                sums = sums + part
            gate, up = sums[:, 0], sums[:, 1]  # [tile, row, column]
            values = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16).float()
            for n in range(min(8, count - m0)):
                act[first + m0 + n] = values[:, :, n].reshape(width)
    routed = torch.zeros(ids.numel(), hidden)
    for e, first, count in chosen:
        rows_w = down_packed[e].reshape(row_tiles, 2, 8, words_w)  # [tile, rows g / g + 8, g, words]
        rows_s = down_scale[e].reshape(row_tiles, 2, 8, -1)
        for m0 in range(0, count, 8):
            values = act[columns(first, count, m0)]
            c = torch.zeros(row_tiles, LANES, 4)
            for step in range(words_w // 16):
                c = _mma_rows(rows_w[:, 0], rows_w[:, 1], rows_s[:, 0], rows_s[:, 1], values, step, words_w,
                              group_size, c)  # fmt: skip
            for h in range(2):
                for lane_t in range(4):
                    n = m0 + 2 * lane_t + h
                    if n >= count:
                        continue
                    source = int(order[first + n])
                    lanes = lane[t == lane_t]  # g = 0 .. 7
                    rows = torch.arange(row_tiles)[:, None] * 16 + g[lanes][None, :]
                    routed[source, rows] = c[:, lanes, h] * weights[source]
                    routed[source, rows + 8] = c[:, lanes, 2 + h] * weights[source]
    out = torch.zeros(tokens, hidden)
    for k in range(top_k):  # `sum_pairs`: the pairs in order
        out = out + routed.view(tokens, top_k, hidden)[:, k]
    return out.to(torch.bfloat16)
