"""Int4MoE (routed experts kept INT4 from the checkpoint to the kernel): the torch reference against the gathered MoE
on dequantized weights, the ONNX Runtime op and the exported graph against the reference, the W4A16 Triton kernel
under the Triton interpreter, convert keeping experts packed, and packed vs dequantized checkpoints end to end.

Tolerances: float32 1e-5 relative; the reference on packed weights equals the dequantized checkpoint's forward
exactly (the same float32 weights, the same operations).
"""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from builder import int4
from builder.convert import convert
from builder.hf_checkpoint import TargetCheckpoint
from models.checkpoint import load_rank_weights
from models.layout import hf_expert_name, packed_expert_names, stacked_expert_name
from plugins.int4_moe.reference import dequantize_experts, int4_moe
from tests.conftest import cpu_ranks, mpirun
from tests.interpreter import run_interpreted

TOLERANCE = 1e-5
TOKENS = (1, 8, 16, 33, 128, 2048)  # decode, draft block, tree budgets, a prefill chunk, a long prefill


def random_experts(experts: int, hidden: int, width: int, group: int, seed: int):
    """(gate_p, gate_s, up_p, up_s, down_p, down_s) in compressed-tensors' packing, scales bf16 as Kimi ships them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for out_features, in_features in ((width, hidden), (width, hidden), (hidden, width)):
        packed, scales = [], []
        for _ in range(experts):
            values, scale = int4.quantize(torch.randn(out_features, in_features, generator=gen) * 0.1, group)
            packed.append(int4.pack(values))
            scales.append(scale.to(torch.bfloat16))
        tensors += [torch.stack(packed), torch.stack(scales).float()]
    return tensors


def random_routing(tokens: int, experts: int, k: int, seed: int, everyone: int | None = None):
    """Distinct experts per token (top-k of random scores), normalised weights; `everyone`: an expert every token
    chooses."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if everyone is not None:
        scores[:, everyone] = 2.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def bf16_experts(count: int, hidden: int, width: int, group: int):
    """`random_experts` with bfloat16 scales, as Kimi K2.x ships them, and the op's arguments as the GPU kernel runs
    them (`Int4MoEKernel.prepared`: the rows layout's words): (experts, prepared)."""
    from plugins.int4_moe.kernel import Int4MoEKernel

    experts = [
        t.to(torch.bfloat16) if t.is_floating_point() else t for t in random_experts(count, hidden, width, group, 0)
    ]
    ready, layout = Int4MoEKernel.prepared(experts, group)
    assert layout == "rows"
    return experts, ready


def float32_reference(x, ids, weights, experts, group: int) -> torch.Tensor:
    """The reference in float32 on the same (bfloat16-exact) token and experts."""
    return int4_moe(x.float(), ids, weights, *(t.float() if t.is_floating_point() else t for t in experts), group)


def rel(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a)).double(), torch.as_tensor(np.asarray(b)).double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_dequantize_matches_compressed_tensors_definition():
    weight = torch.randn(6, 64)
    values, scale = int4.quantize(weight, 16)
    packed = int4.pack(values)
    expected = int4.dequantize(packed, scale, weight.shape, 16)
    assert torch.equal(dequantize_experts(packed[None], scale[None], 16)[0], expected)


def test_reference_equals_the_gathered_moe_on_dequantized_weights():
    """The same numbers as `models.moe.MoE` run on the dequantized experts: a packed checkpoint is lossless."""
    experts, hidden, width, k = 12, 64, 32, 4
    tensors = random_experts(experts, hidden, width, 8, seed=1)
    dense = [dequantize_experts(tensors[i], tensors[i + 1], 8) for i in (0, 2, 4)]
    x = torch.randn(9, hidden)
    ids, weights = random_routing(9, experts, k, seed=2)
    gate, up, down = (w.index_select(0, ids.reshape(-1)).view(9, k, *w.shape[1:]) for w in dense)
    act = torch.nn.functional.silu(torch.einsum("th,tkwh->tkw", x, gate)) * torch.einsum("th,tkwh->tkw", x, up)
    expected = (torch.einsum("tkw,tkhw->tkh", act, down) * weights[..., None]).sum(1)
    assert torch.equal(int4_moe(x, ids, weights, *tensors, 8), expected)


@pytest.mark.parametrize("tokens", [1, 8, 33, 128])
def test_onnx_runtime_op_matches_reference(tokens):
    from plugins.int4_moe.ort_op import int4_moe_numpy

    tensors = random_experts(16, 64, 32, 8, seed=tokens)
    x = torch.randn(tokens, 64)
    ids, weights = random_routing(tokens, 16, 4, seed=tokens, everyone=5 if tokens > 8 else None)
    expected = int4_moe(x.double(), ids, weights.double(), *[t if t.dtype == torch.int32 else t.double()
                                                             for t in tensors], 8)  # fmt: skip
    got = int4_moe_numpy(x.numpy(), ids.numpy(), weights.numpy(), *[t.numpy() for t in tensors], 8)
    assert got.dtype == np.float32 and rel(got, expected) < TOLERANCE


@pytest.mark.parametrize("layout", ["compressed-tensors", "rows"])
def test_exported_graph_carries_packed_weights_and_runs_under_onnx_runtime(tmp_path, layout):
    """`ddtree::Int4MoE` in the graph with the packed experts as int32 initializers (the checkpoint's words, or the
    rows layout `ExportInt4MoE.prepare_experts` chose, as a load before an export does: attribute rows = 1), run by
    ONNX Runtime with the ddtree ops registered: the reference's output on the checkpoint's words."""
    import onnx
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    import plugins.int4_moe.ort_op  # noqa: F401
    from plugins.int4_moe.onnx_op import export_int4_moe

    hidden, width, group = (64, 32, 8) if layout == "compressed-tensors" else (128, 128, 16)
    tensors = random_experts(8, hidden, width, group, seed=4)
    graph_tensors = [t.clone() for t in tensors]
    words, chosen = export_int4_moe.prepare_experts(*graph_tensors[0::2], group)  # in place
    assert chosen == layout and all(w is t for w, t in zip(words, graph_tensors[0::2]))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for i, tensor in enumerate(graph_tensors):
                self.register_buffer(f"t{i}", tensor)

        def forward(self, x, ids, weights):
            return export_int4_moe(x, ids, weights, *[getattr(self, f"t{i}") for i in range(6)], group, layout=layout)

    path = tmp_path / "moe.onnx"
    x, (ids, weights) = torch.randn(5, hidden), random_routing(5, 8, 2, seed=5)
    torch.onnx.export(Layer(), (x, ids, weights), str(path), dynamo=False, opset_version=18,
                      input_names=["x", "ids", "weights"], dynamic_axes={"x": {0: "t"}, "ids": {0: "t"},
                      "weights": {0: "t"}}, custom_opsets={"ddtree": 1})  # fmt: skip
    graph = onnx.load(str(path)).graph
    (node,) = [n for n in graph.node if n.domain == "ddtree"]
    assert node.op_type == "Int4MoE"
    assert {a.name: a.i for a in node.attribute} == {"group_size": group, "rows": int(layout == "rows")}
    assert sorted(i.data_type for i in graph.initializer) == [onnx.TensorProto.FLOAT] * 3 + [onnx.TensorProto.INT32] * 3
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for tokens in (1, 33):
        x, (ids, weights) = torch.randn(tokens, hidden), random_routing(tokens, 8, 2, seed=tokens)
        (got,) = session.run(None, {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy()})
        assert rel(got, int4_moe(x, ids, weights, *tensors, group)) < TOLERANCE


def test_reference_reads_both_layouts():
    """The reference and the numpy op on the rows layout's words (`repack_rows`) give what they give on the
    checkpoint's words; an unknown layout is an error that names it."""
    from plugins.int4_moe.kernel import repack_rows
    from plugins.int4_moe.ort_op import int4_moe_numpy

    tensors = random_experts(6, 128, 128, 32, seed=7)
    rows = [repack_rows(t) if t.dtype == torch.int32 else t for t in tensors]
    assert not torch.equal(rows[0], tensors[0])
    x, (ids, weights) = torch.randn(9, 128, dtype=torch.float64), random_routing(9, 6, 3, seed=9)
    wide = [t if t.dtype == torch.int32 else t.double() for t in tensors]
    want = int4_moe(x, ids, weights.double(), *wide, 32)
    got = int4_moe(x, ids, weights.double(), *[t if t.dtype == torch.int32 else t.double() for t in rows], 32,
                   layout="rows")  # fmt: skip
    assert torch.equal(got, want)
    numpy = int4_moe_numpy(x.float().numpy(), ids.numpy(), weights.numpy(), *[t.numpy() for t in rows], 32, True)
    assert rel(numpy, want) < TOLERANCE
    with pytest.raises(ValueError, match="layout must be one of .*'columns'"):
        int4_moe(x, ids, weights.double(), *wide, 32, layout="columns")


def test_w4a16_kernel_matches_reference_under_the_interpreter():
    """The GPU kernel (Triton, run on the CPU by the interpreter) at T in {1, 8, 16, 33, 128, 2048}: random routing
    with experts no token chose, one expert every token chose, group sizes 8 and 32, K split or not, two launch
    shapes; the one-program routing == the torch routing."""
    script = f"""
        import torch
        from plugins.int4_moe import kernel
        from plugins.int4_moe.kernel import int4_moe_cuda, route
        from plugins.int4_moe.reference import int4_moe
        from tests.test_int4_moe import random_experts, random_routing, rel
        ids = torch.tensor([[3, 1], [3, 0], [3, 1]])
        order, token, start, count, slot_expert, active = route(ids, 6)
        assert count.tolist() == [1, 2, 0, 3, 0, 0] and start.tolist() == [0, 1, 3, 3, 6, 6] and active.tolist() == [3]
        assert slot_expert.tolist() == [0, 1, 3, -1, -1, -1] and token.tolist() == [1, 0, 2, 0, 1, 2]
        # blocks of up to 2 sorted pairs of one expert: expert 0 [0], 1 [1, 2], 3 [3, 4] [5]; the rest unused (-1)
        order, token, block_expert, block_first, block_pairs = kernel.route_blocks(ids, 6, 2)
        assert block_expert.numel() == kernel.block_count(6, 6, 2) == 6 and token.tolist() == [1, 0, 2, 0, 1, 2]
        assert block_expert.tolist() == [0, 1, 3, 3, -1, -1]
        assert block_first.tolist()[:4] == [0, 1, 3, 5] and block_pairs.tolist()[:4] == [1, 2, 2, 1]
        for tokens, experts in ((1, 384), (33, 384), (128, 16)):
            ids, _ = random_routing(tokens, experts, 8 if experts > 16 else 4, seed=tokens)
            fast, slow = route(ids, experts), kernel._route_torch(ids, experts)
            assert all(torch.equal(a.long(), b.long()) for a, b in zip(fast, slow)), tokens
        worst = 0.0
        for i, tokens in enumerate({TOKENS!r}):
            group, hidden = (8, 64) if i % 2 else (32, 128)
            experts = 24 if tokens > 1 else 64  # at T = 1 most experts go unchosen
            tensors = random_experts(experts, hidden, 32, group, seed=i)
            x = torch.randn(tokens, hidden)
            ids, weights = random_routing(tokens, experts, 4, seed=i, everyone=7 if tokens >= 8 else None)
            for split, tuning in ((1, kernel.DEFAULT_TUNING), (2, kernel.Tuning(32, 128, 2, 8, 8))):
                kernel._split_k = lambda programs, hidden, block_k, device, per_sm, cap=8, s=split: s
                out = torch.full((tokens, hidden), float("nan"))
                int4_moe_cuda(x, ids, weights, *tensors, group, out=out, tuning=tuning)
                assert not out.isnan().any(), tokens
                worst = max(worst, rel(out, int4_moe(x, ids, weights, *tensors, group)))
        print("worst", worst)
    """
    done = run_interpreted(script, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE


def test_rows_layout_is_a_reordering_of_the_same_words():
    """`repack_rows`: nibble j of word w holds input j * words + w; `prepare_experts` reorders where the kernel's
    rows layout fits and leaves other dimensions in the checkpoint's order."""
    from plugins.int4_moe.kernel import Int4MoEKernel, repack_rows

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5, 32), dtype=torch.int32)
    values = ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(3, 5, 256)  # input 8 w + j
    repacked = (repack_rows(words, chunk=2).unsqueeze(-1) >> shifts) & 0xF  # [3, 5, w, j]
    assert torch.equal(repacked.transpose(-1, -2).reshape(3, 5, 256), values)
    gate = torch.randint(-(2**31), 2**31 - 1, (2, 128, 16), dtype=torch.int32)
    down = torch.zeros(2, 128, 16, dtype=torch.int32)
    before = gate.clone()
    ready, layout = Int4MoEKernel.prepare_experts(gate, gate.clone(), down, 32)
    assert layout == "rows" and ready[0] is gate and torch.equal(gate, repack_rows(before))  # in place
    small = torch.zeros(2, 32, 16, dtype=torch.int32)  # width 32: a nibble's 16-word step would span groups
    kept, layout = Int4MoEKernel.prepare_experts(small, small, torch.zeros(2, 128, 4, dtype=torch.int32), 32)
    assert layout == "compressed-tensors" and kept[0] is small


def test_w4a16_rows_layout_matches_reference_under_the_interpreter():
    """The rows-layout kernels (what the GPU torch backend runs at Kimi K2.x's dimensions) on experts reordered by
    `prepare_experts`, at T in {1, 33, 128}: unchosen experts, one expert every token chose, K split or not."""
    script = """
        import torch
        from plugins.int4_moe import kernel
        from plugins.int4_moe.kernel import Int4MoEKernel
        from plugins.int4_moe.reference import int4_moe
        from tests.test_int4_moe import random_experts, random_routing, rel
        worst = 0.0
        for i, tokens in enumerate((1, 33, 128)):
            experts = 64 if tokens == 1 else 24
            tensors = random_experts(experts, 128, 128, 32, seed=i)
            ready, layout = Int4MoEKernel.prepared(tensors, 32)
            assert layout == "rows"
            x = torch.randn(tokens, 128)
            ids, weights = random_routing(tokens, experts, 4, seed=i, everyone=7 if tokens >= 8 else None)
            kernel._split_k = lambda programs, hidden, block_k, device, per_sm, cap=8, s=1 + i % 2: s
            out = torch.full((tokens, 128), float("nan"))
            Int4MoEKernel()(x, ids, weights, *ready, 32, out=out, tuning=kernel.Tuning(gate_n=32, down_n=32),
                            layout=layout)
            assert not out.isnan().any(), tokens
            worst = max(worst, rel(out, int4_moe(x, ids, weights, *tensors, 32)))
        print("worst", worst)
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE


def test_convert_keeps_int4_experts_packed(demo_hf, tmp_path):
    """Each rank holds its slice of the packed words and scales as the checkpoint ships them (gate/up by row,
    down by whole groups of columns), and the checkpoint's config records the quantization."""
    source = TargetCheckpoint(demo_hf / "kimi-k2-tiny-int4")
    config = convert(demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "c", 2)
    group = config.target.quantization.group_size
    saved = json.loads((tmp_path / "c" / "config.json").read_text())
    assert saved["quantization"]["quant_algo"] == "W4A16" and saved["quantization"]["group_size"] == group
    assert saved["source_quantization"] == "int4-pack-quantized"
    ranks = [load_rank_weights(tmp_path / "c", r)[1] for r in range(2)]
    for proj, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
        packed_name, scale_name = packed_expert_names(1, proj)
        assert stacked_expert_name(1, proj) not in ranks[0]
        packed = torch.cat([r[packed_name] for r in ranks], dim=dim)
        scale = torch.cat([r[scale_name] for r in ranks], dim=dim)
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
        for e in range(config.target.n_routed_experts):
            want_packed, want_scale = source.get_int4(hf_expert_name(1, e, proj))
            assert torch.equal(packed[e], want_packed) and torch.equal(scale[e], want_scale)
    dequantized = convert(
        demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "d", 2, dequantize_experts=True
    )
    assert dequantized.target.quantization is None
    experts = [
        sum(t.numel() * t.element_size() for n, t in load_file(str(root / "target/rank0.safetensors")).items()
            if ".mlp.experts." in n)
        for root in (tmp_path / "c", tmp_path / "d")
    ]  # fmt: skip
    # float32 experts: 32 bits a weight against 4 bits + a bf16 scale per group of 8 (6 bits a weight)
    assert experts[0] * 5 < experts[1]


def test_a_split_off_group_boundaries_is_refused(demo_hf, tmp_path):
    with pytest.raises(ValueError, match=r"down_proj's per-rank input width moe_intermediate_size / tp_size = 32 / "
                       r"8 = 4 must be a multiple of the group size 8 .* --dequantize_experts"):  # fmt: skip
        convert(demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "c", 8)
    assert not (tmp_path / "c").exists()


def test_packed_and_dequantized_checkpoints_generate_the_same_tokens(demo_hf, tmp_path):
    """The torch reference ranks built from a packed TP-2 checkpoint (PackedMoE through ops.int4_moe) against the
    same checkpoint dequantized: the same greedy tokens, speculative and autoregressive."""
    from engines.spec import BuildConfig, SpecConfig
    from runner.generator import Generator

    packed = convert(demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "p", 2)
    convert(demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "d", 2, dequantize_experts=True)
    assert packed.target.quantization is not None
    spec, build = SpecConfig(8, 32), BuildConfig(max_input_len=64, max_seq_len=256)
    outputs = {}
    for name in ("p", "d"):
        ranks = cpu_ranks(tmp_path / name, spec, build)
        if name == "p":
            assert "INT4 experts by int4_moe" in ranks.lead.description
        generator = Generator(ranks)
        outputs[name] = [generator.generate([5, 9, 200, 31], 24).tokens for _ in range(1)]
        ranks.close()
    assert outputs["p"] == outputs["d"]


def test_packed_engine_runs_under_mpirun_on_every_backend(demo_hf, tmp_path):
    """A packed INT4 TP-2 checkpoint through build-engine (ONNX with ddtree::Int4MoE, TensorRT-RTX engines with the
    Int4MoE plugin) and `mpirun -np 2 python -m runner`: ONNX Runtime equals the torch backend token for token, and
    check_onnx finds ONNX Runtime and torch within tolerance at every profile shape."""
    from builder.cli import main as build_main
    from builder.export import custom_ops

    engine, hf = tmp_path / "engine", demo_hf
    args = ["--model_dir", str(hf / "kimi-k2-tiny-int4"), "--draft_model_dir", str(hf / "kimi-k2-tiny-dflash"),
            "--tp_size", "2", "--output_dir", str(engine), "--max_input_len", "64", "--max_seq_len", "256"]  # fmt: skip
    assert build_main(args) == 0
    assert [op for _, op, attrs in custom_ops(engine / "rank0" / "target.onnx") if op == "Int4MoE"] == ["Int4MoE"] * 3
    plan = json.loads((engine / "config.json").read_text())
    assert plan["pretrained_config"]["quantization"]["quant_algo"] == "W4A16"
    tokens = {}
    for backend in ("ort", "torch"):
        result = tmp_path / f"{backend}.json"
        done = mpirun(2, "-m", "runner", "--engine_dir", str(engine), "--backend", backend, "--input_text",
                      "Hello world", "--max_output_len", "20", "--output_json", str(result))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        tokens[backend] = json.loads(result.read_text())
    assert tokens["ort"]["results"][0]["output_ids"] == tokens["torch"]["results"][0]["output_ids"]
    done = mpirun(2, "-m", "runner.check_onnx", str(engine))
    assert done.returncode == 0 and "OK:" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_w4a16_cuda_core_form_matches_reference_under_the_interpreter():
    """The rows layout's CUDA-core form (what decodes and verify blocks run at Kimi K2.x's dimensions): gate + up
    streamed a group at a time, the act fused by the last K split, down for all of a token's experts at once (one
    token) or a block of one expert's pairs at once (more). At T = 1 with one K split; at T = 5 with top-6 and two K
    splits whose counters are left at zero again; at T = 7 with an expert every token chose (blocks of 4 and 3
    pairs) and bfloat16 scales (the fma form of `_weights`); at T = 3, top-2, two K splits (blocks of one and two
    pairs). The weights are exact in float32, so the float32 tolerance holds."""
    script = """
        import torch
        from plugins.int4_moe import kernel
        from plugins.int4_moe.kernel import Int4MoEKernel, Tuning
        from plugins.int4_moe.reference import int4_moe
        from tests.test_int4_moe import random_experts, random_routing, rel
        worst, calls = 0.0, []
        class Recorded:  # the gate/up launches' grids and whether they were routed
            def __getitem__(self, grid, jit=kernel._gate_up_cc_kernel):
                def launch(*args, **kwargs):
                    calls.append((grid[2], kwargs["ROUTED"], kwargs["BLOCK_M"]))
                    return jit[grid](*args, **kwargs)
                return launch
        kernel._gate_up_cc_kernel = Recorded()
        cases = ((1, 4, 256, 256, 32, None, torch.float32), (5, 6, 256, 128, 16, 3, torch.float32),
                 (7, 4, 128, 128, 16, 5, torch.bfloat16), (3, 2, 256, 128, 16, None, torch.bfloat16))
        for i, (tokens, k, hidden, width, group, everyone, scale_dtype) in enumerate(cases):
            tensors = [t.to(scale_dtype) if t.is_floating_point() else t
                       for t in random_experts(16, hidden, width, group, seed=i)]
            ready, layout = Int4MoEKernel.prepared(tensors, group)
            assert layout == "rows" and kernel.gemv_fits(hidden, width, group)
            x = torch.randn(tokens, hidden)
            ids, weights = random_routing(tokens, 16, k, seed=i, everyone=everyone)
            out = torch.full((tokens, hidden), float("nan"))
            Int4MoEKernel()(x, ids, weights, *ready, group, out=out, layout=layout,
                            tuning=Tuning(gemv_tokens=tokens, gemv_n=16, gemv_down_n=16, cuda_core_block=4,
                                          cuda_core_down_n=32))
            assert not out.isnan().any(), tokens
            worst = max(worst, rel(out, int4_moe(x, ids, weights, *tensors, group)))
        # K splits one then two (the last one's reduction); one token unrouted, more in blocks of up to 4 pairs
        assert calls == [(1, False, 1), (2, True, 4), (1, True, 4), (2, True, 4)], calls
        assert not kernel._SPLIT_COUNTERS[torch.device("cpu")].any()
        print("worst", worst)
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < TOLERANCE


@pytest.mark.parametrize("k, width", [(8, 128), (4, 256)])
def test_cuda_token_kernels_algorithm_matches_reference(k, width):
    """The CUDA token kernels' computation (`token_cuda.algorithm`: the same 16-byte chunks a lane reads, the same
    nibbles, groups, act and butterfly, in torch) against the reference on the rows layout's words, bfloat16 token
    and scales as Kimi K2.x runs them; two lanes a pair (k = 8: four; k = 4: eight lanes, one chunk each). The
    compiled kernels are checked against the same reference on a GPU (`test_cuda_token_kernels_on_a_gpu`)."""
    from plugins.int4_moe import token_cuda

    hidden, group = 1024, 32
    assert token_cuda.fits(hidden, width, group, k) and not token_cuda.fits(hidden + 32, width, group, k)
    tensors, ready = bf16_experts(12, hidden, width, group)
    x = torch.randn(1, hidden).to(torch.bfloat16)
    ids, weights = random_routing(1, 12, k, seed=3)
    want = float32_reference(x, ids, weights, tensors, group)
    got = token_cuda.algorithm(x, ids, weights, *ready, group)
    assert got.dtype == torch.bfloat16 and got.shape == (1, hidden)
    assert rel(got.float(), want) < 1e-2  # bfloat16 act and output (8 bits): about 4e-3
    # a mistaken chunk, nibble or group in the algorithm shows: the same words read in the checkpoint's order
    assert rel(token_cuda.algorithm(x, ids, weights, tensors[0], tensors[1], tensors[2], tensors[3], tensors[4],
                                    tensors[5], group).float(), want) > 0.5  # fmt: skip


def test_cuda_token_tensor_core_algorithm_matches_reference():
    """The tensor-core token kernels' computation (`token_cuda.algorithm_mma`: each warp's A and B fragments made as
    `gate_up_mma` and `down_mma` make them, multiplied by the m16n8k16 layout) against the reference: one 16-word
    step a warp in gate/up (8 warps a block at hidden 1024), two in down. A fragment wrongly placed shows: the
    same words read in the checkpoint's order miss by far."""
    from plugins.int4_moe import token_cuda

    hidden, width, group, k = 1024, 256, 32, 8
    assert token_cuda.mma_fits(hidden, width, group, k) and not token_cuda.mma_fits(hidden, width, 8, k)
    tensors, ready = bf16_experts(12, hidden, width, group)
    x = torch.randn(1, hidden).to(torch.bfloat16)
    ids, weights = random_routing(1, 12, k, seed=3)
    want = float32_reference(x, ids, weights, tensors, group)
    for ksplit in (None, 2):
        got = token_cuda.algorithm_mma(x, ids, weights, *ready, group, ksplit=ksplit)
        assert got.dtype == torch.bfloat16 and got.shape == (1, hidden)
        assert rel(got.float(), want) < 1e-2, ksplit
    checkpoint_order = token_cuda.algorithm_mma(x, ids, weights, *tensors, group)
    assert rel(checkpoint_order.float(), want) > 0.5


def test_cuda_block_algorithm_matches_reference():
    """The block kernels' computation (`token_cuda.algorithm_mma_block`: the pairs sorted by expert, each chosen
    expert's tiles times up to 8 of its pairs a pass, the MMA's C columns written to their pairs' rows) against the
    reference, with experts no token chose and one chosen by every token (19 pairs: three passes of 8 columns, the
    last one past its end). Each token's output equals the one-token tensor-core form's bit for bit (the same sums in
    the same order), and the words in the checkpoint's order miss by far."""
    from plugins.int4_moe import token_cuda

    hidden, width, group, k, experts = 1024, 256, 32, 4, 64
    assert token_cuda.block_fits(hidden, width, group, k) and not token_cuda.block_fits(hidden, width, 8, k)
    tensors, ready = bf16_experts(experts, hidden, width, group)
    for tokens, everyone in ((2, None), (19, 7)):
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        ids, weights = random_routing(tokens, experts, k, seed=tokens, everyone=everyone)
        assert ids.unique().numel() < experts  # experts no token chose
        want = float32_reference(x, ids, weights, tensors, group)
        got = token_cuda.algorithm_mma_block(x, ids, weights, *ready, group)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
        assert rel(got.float(), want) < 1e-2, tokens
        alone = [token_cuda.algorithm_mma(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], *ready, group)
                 for i in range(tokens)]  # fmt: skip
        assert torch.equal(torch.cat(alone), got)
    assert rel(token_cuda.algorithm_mma_block(x, ids, weights, *tensors, group).float(), want) > 0.5


def test_cuda_block_kernels_reject_what_they_cannot_take():
    """The block form's entry names what it was given and what it takes (checked before any launch): float32 tokens,
    a group that splits a 16-word step, routing not in `kernel.route`'s dtypes."""
    from plugins.int4_moe import token_cuda
    from plugins.int4_moe.kernel import _route_torch

    hidden, width, group, k = 1024, 256, 32, 4
    tensors, ready = bf16_experts(8, hidden, width, group)
    ids, weights = random_routing(3, 8, k, seed=1)
    routing = _route_torch(ids, 8)
    x = torch.randn(3, hidden)
    with pytest.raises(ValueError, match="bfloat16 tokens.*torch.float32"):
        token_cuda.int4_moe_block(x, routing, weights, *ready, group)
    with pytest.raises(ValueError, match="group 8"):
        token_cuda.int4_moe_block(x.to(torch.bfloat16), routing, weights, *ready, 8)
    wrong = (routing[0].int(), *routing[1:])
    with pytest.raises(ValueError, match="int64 order"):
        token_cuda.int4_moe_block(x.to(torch.bfloat16), wrong, weights, *ready, group)


def test_cuda_token_bulk_share_fits_a_block_of_shared_memory():
    """The one-launch token form's shared memory at Kimi K2.x per-rank TP-8 dimensions: a block's row pairs (16 of
    the 2048 on 132 SMs) and its down rows of the 8 chosen experts (55 of 7168), under the 227 KB a Hopper block may
    have, on the H100 SXM and H200 (132 SMs) and the H100 PCIe (114)."""
    from plugins.int4_moe import token_cuda

    defines = token_cuda._defines(7168, 256, 32, 8, torch.int32)
    pair, row = 2 * 896 * 4 + 2 * 224 * 2, 32 * 4 + 8 * 2
    assert token_cuda._token_bulk_bytes(defines, 132) == 1152 + 16 * pair + 8 * 55 * row == 193_536
    assert token_cuda._token_bulk_bytes(defines, 114) <= 227 * 1024 < token_cuda._token_bulk_bytes(defines, 96)


def test_cuda_block_forms_fall_back_to_what_the_gpu_and_tensors_allow():
    """`block_forms` (what `launch_block` runs): bulk copies on sm_90 and later only; each persistent form only where
    its shared memory fits a block and the tensors' alignment allows its copies, else the next form; names it does
    not know are an error that lists the forms."""
    from plugins.int4_moe import token_cuda

    hidden, width, group, k = 7168, 256, 32, 8
    _, ready = bf16_experts(2, hidden, width, group)
    gate_packed, gate_scale, up_packed, up_scale, _, down_scale = ready
    defines = {**token_cuda._defines(hidden, width, group, k, torch.int32),
               "KSPLIT": token_cuda.mma_ksplit(hidden, group, most=32)}  # fmt: skip

    def forms(gate="bulk", down="stream", capability=(9, 0), shared=232448, g_scale=gate_scale, d_scale=down_scale):
        return token_cuda.block_forms(defines, gate, down, capability, shared, gate_packed, up_packed, g_scale,
                                      up_scale, d_scale)  # fmt: skip

    assert forms() == ("bulk", "stream")  # Kimi K2.x on an H100 or H200
    assert forms(capability=(8, 0)) == ("stream", "stream")  # no bulk copies before sm_90
    assert forms(gate="tiles", down="tiles") == ("tiles", "tiles")
    assert token_cuda._bulk_bytes(defines) > 150_000 > token_cuda._down_stream_bytes(defines)
    assert forms(shared=150_000) == ("tiles", "stream")  # neither gate/up stage pair fits; down's does
    assert forms(shared=100_000) == ("tiles", "tiles")
    # scales two bytes off a 4-byte boundary: no 16-byte bulk copies, no 4-byte cp.async copies of scale pairs
    odd = torch.empty(gate_scale.numel() + 1, dtype=torch.bfloat16)[1:].view(gate_scale.shape)
    assert forms(g_scale=odd) == ("tiles", "stream")
    odd_down = torch.empty(down_scale.numel() + 1, dtype=torch.bfloat16)[1:].view(down_scale.shape)
    assert forms(d_scale=odd_down) == ("bulk", "tiles")
    with pytest.raises(ValueError, match="'bulk', 'stream' or 'tiles'.*'dma'"):
        forms(gate="dma")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NVRTC compiles the kernels)")
def test_cuda_block_kernels_on_a_gpu():
    """The compiled block kernels (through `int4_moe_cuda`, as the rank runs them) at Kimi K2.x's per-rank TP-8
    dimensions against the reference and their algorithm, T in {2, 8, 33, 64}, random routing and one expert every
    token chooses (33 and 64 pairs of one expert: five and eight passes of 8 columns), int64 and int32 expert ids;
    every gate/up and down form ("bulk", "stream", "tiles"; at other stage counts, sums a pass, warps a block, tasks
    taken from the queue at a time; the bulk form's tiles shared out by work and from a queue), which add the same
    products in the same order: the same bits; each token's output against the one-token tensor-core form's; the same
    bits twice."""
    from plugins.int4_moe import kernel, token_cuda
    from plugins.int4_moe.kernel import DEFAULT_TUNING, Int4MoEKernel

    assert DEFAULT_TUNING.block_kernel == "cuda" and DEFAULT_TUNING.block_tokens >= 64
    hidden, width, group, experts = 7168, 256, 32, 48
    tensors, ready = bf16_experts(experts, hidden, width, group)
    gpu = [t.cuda() for t in ready]
    act = torch.empty(8, width, dtype=torch.bfloat16, device="cuda")
    for tokens, everyone, id_dtype in ((2, None, torch.int64), (8, None, torch.int32), (33, 5, torch.int64),
                                       (64, 9, torch.int32), (33, None, torch.int32)):  # fmt: skip
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        ids, weights = random_routing(tokens, experts, 8, seed=tokens, everyone=everyone)
        want = float32_reference(x, ids, weights, tensors, group)
        args = (x.cuda(), ids.to(id_dtype).cuda(), weights.cuda(), *gpu, group)
        got = Int4MoEKernel()(*args, layout="rows").cpu()
        assert rel(got.float(), want) < 1e-2, (tokens, everyone)
        assert torch.equal(Int4MoEKernel()(*args, layout="rows").cpu(), got)
        if tokens == 2:  # the CPU algorithm is slow at Kimi's dimensions; the MMA's own order of its 16 products
            ksplit = token_cuda.mma_ksplit(hidden, group, most=32)  # the block form's gate/up warps
            want_algorithm = token_cuda.algorithm_mma_block(x, ids, weights, *ready, group, ksplit=ksplit).float()
            assert rel(got.float(), want_algorithm) < 1e-3, tokens
        routing = kernel.route(ids.to(id_dtype).cuda(), experts)
        for gate, down, shape in (("tiles", "tiles", {}), ("stream", "stream", {"STAGES": 3, "PARTS": 1, "DSTAGES": 2}),
                                  ("bulk", "stream", {"DWARPS": 1, "DBLOCKS": 1, "CHUNK": 1, "DCHUNK": 3,
                                                      "BALANCE": 0}),
                                  ("bulk", "tiles", {"STAGES": 3, "CHUNK": 7, "BALANCE": 0}),
                                  ("bulk", "stream", {"PARTS": 1, "STAGES": 3})):  # fmt: skip
            other = token_cuda.int4_moe_block(x.cuda(), routing, weights.cuda(), *gpu, group, gate=gate, down=down,
                                              **shape).cpu()  # fmt: skip
            assert torch.equal(other, got), (tokens, gate, down, shape)
        for i in (0, tokens - 1):  # a token alone through the one-token tensor-core form
            out = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
            token_cuda.launch(x[i : i + 1].cuda(), ids[i].to(id_dtype).cuda(), weights[i].float().cuda(), *gpu, act,
                              out, group, gate_form="mma")  # fmt: skip
            assert rel(out.cpu().float(), got[i : i + 1].float()) < 1e-3, (tokens, i)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NVRTC compiles the kernels)")
def test_cuda_token_kernels_on_a_gpu():
    """The compiled kernels against the reference and against their algorithm, at Kimi K2.x's per-rank TP-8
    dimensions (hidden 7168, width 256, top-8 of 384 experts, groups of 32) and int64 and int32 expert ids: each
    input twice through the default form (the same bits), and through every form ("split", "mma", and "bulk", one
    launch, which gives the split form's bits)."""
    from plugins.int4_moe import token_cuda

    hidden, width, group, experts = 7168, 256, 32, 24
    tensors, ready = bf16_experts(experts, hidden, width, group)
    for seed, id_dtype in ((1, torch.int64), (2, torch.int32)):
        x = torch.randn(1, hidden).to(torch.bfloat16)
        ids, weights = random_routing(1, experts, 8, seed=seed)
        want = float32_reference(x, ids, weights, tensors, group)
        got = token_cuda.int4_moe_token(x.cuda(), ids.to(id_dtype).cuda(), weights.cuda(),
                                        *(t.cuda() for t in ready), group).cpu()  # fmt: skip
        assert rel(got.float(), want) < 1e-2
        assert rel(got.float(), token_cuda.algorithm(x, ids, weights, *ready, group).float()) < 1e-2
        again = token_cuda.int4_moe_token(x.cuda(), ids.to(id_dtype).cuda(), weights.cuda(), *(t.cuda() for t in ready),
                                          group).cpu()  # fmt: skip
        assert torch.equal(again, got)  # the same sums in the same order
        # the tensor-core form too
        act = torch.empty(8, width, dtype=torch.bfloat16, device="cuda")
        assert token_cuda.mma_fits(hidden, width, group, 8)
        defines, _ = token_cuda.kernels(torch.device("cuda"), hidden, width, group, 8, id_dtype)
        if torch.cuda.get_device_capability() >= (9, 0):  # the one-launch form runs (else `launch` falls back)
            assert token_cuda.token_bulk_fits(defines, torch.device("cuda"), *(t.cuda() for t in ready))
        outs = {}
        for form in ("split", "mma", "bulk"):
            out = torch.full((1, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            token_cuda.launch(x.cuda(), ids.reshape(-1).to(id_dtype).cuda(), weights.reshape(-1).float().cuda(),
                              *(t.cuda() for t in ready), act, out, group, gate_form=form)  # fmt: skip
            assert rel(out.cpu().float(), want) < 1e-2, form
            outs[form] = out.cpu()
        # the one-launch form adds the split form's products in its order: the same bits (twice: its grid counters
        # are back at zero after a call)
        assert torch.equal(outs["bulk"], outs["split"])
