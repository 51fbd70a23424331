"""A CUDA C++ W4A16 MoE probe for decode-sized batches, measured against the Triton kernel on one H200.

    PYTHONPATH=. TORCH_CUDA_ARCH_LIST=9.0a python3 benchmarks/w4a16_cuda_probe.py   (writes $OUT/w4a16_cuda.json)

Gate+up: a warp a weight row of gate and of up, a lane one group (16-byte loads, every load of the row issued
before the arithmetic), the activations staged once a block in padded shared memory; down: eight lanes a row,
four rows a thread. Measured (BENCHMARKS.md, section 8): down 11.1 us at T = 1 (the Triton kernel's ~27), gate+up
122 us (255 registers and local-memory spills): slower as a whole; kept in the history as the next start."""
# ruff: noqa: E501

import json
import os
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, ".")
from benchmarks.common import graph_time_us, measure_ceilings
from benchmarks.int4_moe_gpu import GROUP, make_weights, rank_config, routing
from plugins.int4_moe import kernel as K
from plugins.int4_moe.reference import int4_moe

CUDA = r"""
#include <cuda_bf16.h>
#include <stdint.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__device__ __forceinline__ float dot32(uint4 w, const float* xv) {
  uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < 4; q++) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
      uint32_t nib = ((words[q] >> (4 * j)) & 0xFu) | 0x4B000000u;
      s = fmaf(__uint_as_float(nib) - 8388616.0f, xv[q * 8 + j], s);
    }
  }
  return s;
}

__device__ __forceinline__ void dot32x2(uint4 a, uint4 b, const float* xv, float& sa, float& sb) {
  uint32_t wa[4] = {a.x, a.y, a.z, a.w};
  uint32_t wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int q = 0; q < 4; q++) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const float xj = xv[q * 8 + j];
      sa = fmaf(__uint_as_float(((wa[q] >> (4 * j)) & 0xFu) | 0x4B000000u) - 8388616.0f, xj, sa);
      sb = fmaf(__uint_as_float(((wb[q] >> (4 * j)) & 0xFu) | 0x4B000000u) - 8388616.0f, xj, sb);
    }
  }
}

template <int KW4>
__global__ void __launch_bounds__(256, 2) gate_up_kernel(const __nv_bfloat16* __restrict__ x, const int* __restrict__ token,
    const int* __restrict__ slot_expert, const int* __restrict__ start, const int* __restrict__ count,
    const uint4* __restrict__ gate_p, const __nv_bfloat16* __restrict__ gate_s, const uint4* __restrict__ up_p,
    const __nv_bfloat16* __restrict__ up_s, __nv_bfloat16* __restrict__ act, int width) {
  constexpr int PER_LANE = (KW4 + 31) / 32;
  constexpr int HIDDEN = KW4 * 32;
  __shared__ float xs[KW4 * 33];
  const int expert = slot_expert[blockIdx.x];
  if (expert < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.y * (blockDim.x / 32) + warp;
  const bool row_ok = row < width;
  const long rbase = ((long)expert * width + (row_ok ? row : 0)) * KW4;
  uint4 g[PER_LANE], u[PER_LANE];
  float gs[PER_LANE], us[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    const int c = lane + 32 * i;
    if (row_ok && c < KW4) {
      g[i] = gate_p[rbase + c]; u[i] = up_p[rbase + c];
      gs[i] = __bfloat162float(gate_s[rbase + c]); us[i] = __bfloat162float(up_s[rbase + c]);
    } else {
      g[i] = make_uint4(0, 0, 0, 0); u[i] = g[i]; gs[i] = 0.f; us[i] = 0.f;
    }
  }
  const int s0 = start[expert], n = count[expert];
  for (int m = 0; m < n; m++) {
    const long tok = token[s0 + m];
    __syncthreads();
    for (int k = threadIdx.x; k < HIDDEN; k += blockDim.x) xs[(k >> 5) * 33 + (k & 31)] = __bfloat162float(x[tok * HIDDEN + k]);
    __syncthreads();
    float ag = 0.f, au = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
      const int c = lane + 32 * i;
      if (c < KW4) {
        float pg = 0.f, pu = 0.f;
        dot32x2(g[i], u[i], xs + c * 33, pg, pu);
        ag = fmaf(gs[i], pg, ag);
        au = fmaf(us[i], pu, au);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) { ag += __shfl_xor_sync(0xffffffffu, ag, o); au += __shfl_xor_sync(0xffffffffu, au, o); }
    if (lane == 0 && row_ok) act[(long)(s0 + m) * width + row] = __float2bfloat16(ag / (1.f + __expf(-ag)) * au);
  }
}

template <int KW4, int PASSES>
__global__ void __launch_bounds__(256, 3) down_kernel(const __nv_bfloat16* __restrict__ act, const int64_t* __restrict__ order,
    const float* __restrict__ pair_weight, const int* __restrict__ slot_expert, const int* __restrict__ start,
    const int* __restrict__ count, const uint4* __restrict__ down_p, const __nv_bfloat16* __restrict__ down_s,
    float* __restrict__ out, int hidden) {
  constexpr int TPR = KW4;           // threads a row: one group each
  constexpr int RPP = 256 / TPR;     // rows a pass
  constexpr int WIDTH = KW4 * 32;
  __shared__ float as[KW4 * 33];
  const int expert = slot_expert[blockIdx.x];
  if (expert < 0) return;
  const int gi = threadIdx.x % TPR, r0 = threadIdx.x / TPR;
  const int row_base = blockIdx.y * RPP * PASSES;
  uint4 w[PASSES]; float s[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    const int row = row_base + r0 + p * RPP;
    if (row < hidden) {
      const long o = ((long)expert * hidden + row) * KW4 + gi;
      w[p] = down_p[o]; s[p] = __bfloat162float(down_s[o]);
    } else { w[p] = make_uint4(0, 0, 0, 0); s[p] = 0.f; }
  }
  const int s0 = start[expert], n = count[expert];
  for (int m = 0; m < n; m++) {
    __syncthreads();
    for (int k = threadIdx.x; k < WIDTH; k += blockDim.x) as[(k >> 5) * 33 + (k & 31)] = __bfloat162float(act[(long)(s0 + m) * WIDTH + k]);
    __syncthreads();
    const long src = order[s0 + m];
    const float pw = pair_weight[src];
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
      float v = s[p] * dot32(w[p], as + gi * 33);
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      const int row = row_base + r0 + p * RPP;
      if (gi == 0 && row < hidden) out[src * hidden + row] = v * pw;
    }
  }
}

void moe(torch::Tensor x, torch::Tensor token, torch::Tensor slot_expert, torch::Tensor start, torch::Tensor count,
         torch::Tensor order, torch::Tensor pair_weight, torch::Tensor gate_p, torch::Tensor gate_s, torch::Tensor up_p,
         torch::Tensor up_s, torch::Tensor down_p, torch::Tensor down_s, torch::Tensor act, torch::Tensor routed) {
  const int slots = slot_expert.numel();
  const int width = gate_p.size(1), hidden = x.size(1);
  TORCH_CHECK(hidden == 7168 && width == 256, "probe: Kimi per-rank dims only");
  auto stream = at::cuda::getCurrentCUDAStream();
  gate_up_kernel<224><<<dim3(slots, width / 8), 256, 0, stream>>>(
      (const __nv_bfloat16*)x.data_ptr(), token.data_ptr<int>(), slot_expert.data_ptr<int>(), start.data_ptr<int>(),
      count.data_ptr<int>(), (const uint4*)gate_p.data_ptr(), (const __nv_bfloat16*)gate_s.data_ptr(),
      (const uint4*)up_p.data_ptr(), (const __nv_bfloat16*)up_s.data_ptr(), (__nv_bfloat16*)act.data_ptr(), width);
  down_kernel<8, 4><<<dim3(slots, (hidden + 127) / 128), 256, 0, stream>>>(
      (const __nv_bfloat16*)act.data_ptr(), order.data_ptr<int64_t>(), pair_weight.data_ptr<float>(),
      slot_expert.data_ptr<int>(), start.data_ptr<int>(), count.data_ptr<int>(), (const uint4*)down_p.data_ptr(),
      (const __nv_bfloat16*)down_s.data_ptr(), routed.data_ptr<float>(), hidden);
}
"""
CPP = "void moe(torch::Tensor x, torch::Tensor token, torch::Tensor slot_expert, torch::Tensor start, torch::Tensor count, torch::Tensor order, torch::Tensor pair_weight, torch::Tensor gate_p, torch::Tensor gate_s, torch::Tensor up_p, torch::Tensor up_s, torch::Tensor down_p, torch::Tensor down_s, torch::Tensor act, torch::Tensor routed);"
ext = load_inline(
    "w4a16_probe",
    cpp_sources=CPP,
    cuda_sources=CUDA,
    functions=["moe"],
    extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v"],
    verbose=False,
)

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
config = rank_config(False)
tensors, shared, router, width = make_weights(config, dev, torch.bfloat16, gen)
E, H, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok


def cuda_moe(x, ids, w):
    order, token, start, count, slot_expert = K.route(ids, E)
    pairs = ids.numel()
    act = torch.empty((pairs, width), dtype=x.dtype, device=dev)
    routed = torch.empty((pairs, H), dtype=torch.float32, device=dev)
    ext.moe(x, token, slot_expert, start, count, order, w.reshape(-1).float().contiguous(), *tensors, act, routed)
    return routed.view(x.shape[0], -1, H).sum(1).to(x.dtype)


if os.environ.get("PROBE_NCU"):
    ids, w = routing("random", 1, E, k, gen)
    ids, w = ids.to(dev), w.to(dev)
    x = torch.randn(1, H, generator=gen).to(dev, torch.bfloat16)
    cuda_moe(x, ids, w)
    torch.cuda.synchronize()
    sys.exit(0)
ceil = measure_ceilings(False)
expert_bytes = 3 * H * width // 2 + 3 * H * width // GROUP * 2
rows = []
for kind in ("random", "skewed"):
    for T in (1, 8, 16, 33):
        ids, w = routing(kind, T, E, k, gen)
        ids, w = ids.to(dev), w.to(dev)
        x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
        want = int4_moe(x.float(), ids, w, *[t if t.dtype == torch.int32 else t.float() for t in tensors], GROUP)
        got = cuda_moe(x, ids, w).float()
        err = float((got - want).norm() / want.norm())
        tri = float((K.int4_moe_cuda(x, ids, w, *tensors, GROUP).float() - want).norm() / want.norm())
        t_cuda = statistics.median(
            graph_time_us(lambda x=x, ids=ids, w=w: cuda_moe(x, ids, w), dev, False) for _ in range(3)
        )
        t_tri = statistics.median(
            graph_time_us(lambda x=x, ids=ids, w=w: K.int4_moe_cuda(x, ids, w, *tensors, GROUP), dev, False)
            for _ in range(3)
        )
        distinct = int(ids.unique().numel())
        floor = distinct * expert_bytes / ceil["copy_Bps"] * 1e6  # routed experts only
        row = dict(
            routing=kind,
            T=T,
            distinct=distinct,
            routed_floor_us=floor,
            cuda_us=t_cuda,
            triton_us=t_tri,
            cuda_err=err,
            triton_err=tri,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump({"ceilings": ceil, "rows": rows}, open(os.environ["OUT"] + "/w4a16_cuda.json", "w"), indent=1)
