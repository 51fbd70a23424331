"""The operator forms a rank's modules are built with.

Every choice that depends on the hardware is one field here: which tree attention (the reference, the ONNX op, the
GPU kernel), which collectives, which MoE (gathered experts or a grouped GEMM; for INT4 experts, which Int4MoE),
which MLA form, the MoE router's and the SwiGLU MLPs' forms, a layer's independent branches on a second stream,
fused or plain RMSNorm and rotary, the drafter's attention, fused projections. The rank factory
(`runner/factory.py`) makes the choices once; modules read them in `__init__`, so no `forward` branches on the
device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.dflash import DraftAttention
from models.layers import GatedMLP, RMSNorm
from models.mla import AbsorbedMLA
from models.moe import MoE, Router
from models.rope import apply_rotary
from plugins.int4_moe.reference import int4_moe


@dataclass(frozen=True)
class ModelOps:
    tree_attention: Callable  # MLA attention of tree rows over the latent cache (plugins/tree_attention)
    collectives: object  # all_reduce / all_gather (models/parallel.py)
    moe: type = MoE  # MoE (gathered experts: export, CPUs, float32) or GroupedMoE (grouped GEMM, bf16 GPUs)
    mla: type = AbsorbedMLA  # AbsorbedMLA, InPlaceAbsorbedMLA (GPUs), ExpandedMLA (the prefill-form reference)
    norm: type = RMSNorm  # RMSNorm or FusedRMSNorm (one Triton kernel)
    rotary: Callable = apply_rotary  # rope.apply_rotary or triton_ops.fused_rotary
    draft_attention: type = DraftAttention  # DraftAttention (concatenation + key bias) or KernelDraftAttention (GPUs)
    fused_projections: bool = False  # q/k/v and gate/up as one GEMM each (stacked weights)
    int4_moe: Callable = int4_moe  # routed experts kept INT4 (plugins/int4_moe): reference, ONNX op or GPU kernel
    router: type = Router  # the MoE router: Router (torch operators) or FusedRouter (two Triton launches, GPUs)
    gated_mlp: type = GatedMLP  # SwiGLU MLPs: GatedMLP, or FusedGatedMLP (gate/up one GEMM, the act one kernel)
    side_stream: bool = False  # GPUs: independent branches on a second stream (the MoE's shared expert, MLA's latent)
