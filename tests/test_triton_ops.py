"""The fused GPU kernels (models/triton_ops.py) equal the torch expressions they replace (layers.RMSNorm,
rope.apply_rotary), run here under the Triton interpreter: strided rows, 2-D and 3-D inputs, float32 and float16
(whose per-operation rounding they reproduce)."""

from tests.interpreter import run_interpreted


def test_fused_norm_and_rotary_equal_the_torch_expressions():
    done = run_interpreted("""
        import torch
        from models.layers import RMSNorm
        from models.rope import apply_rotary
        from models.triton_ops import rms_norm, rotary, rotary_supported
        gen = torch.Generator().manual_seed(0)
        worst = {}
        for dtype in (torch.float32, torch.float16):
            for rows, width in ((1, 24), (5, 64), (33, 576)):
                base = (torch.randn(rows, width + 7, generator=gen) * 3).to(dtype)
                x = base[:, 3 : 3 + width]  # strided rows, as kv[:, :kv_lora]
                norm = RMSNorm(width, 1e-6).to(dtype)
                norm.weight.data = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
                got, want = rms_norm(x, norm.weight, 1e-6), norm(x)
                assert got.dtype == want.dtype and got.shape == want.shape
                wide = torch.full((rows, width + 9), 7.0, dtype=dtype)  # into columns 4.. of a wider buffer
                assert torch.equal(rms_norm(x, norm.weight, 1e-6, out=wide[:, 4 : 4 + width]), got)
                assert torch.equal(wide[:, 4 : 4 + width], got)
                assert (wide[:, :4] == 7).all() and (wide[:, 4 + width :] == 7).all()
                worst[("norm", dtype)] = max(worst.get(("norm", dtype), 0), float((got - want).abs().max()))
            for shape in ((7, 16), (33, 8, 64), (1, 3, 8)):
                base = torch.randn(*shape[:-1], shape[-1] + 5, generator=gen).to(dtype)
                x = base[..., 5:]  # the rope part of a wider row, as q[..., nope:]
                angle = torch.randn(shape[0], shape[-1] // 2, generator=gen)
                cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
                sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
                assert rotary_supported(x, cos)
                got, want = rotary(x, cos, sin), apply_rotary(x, cos, sin)
                assert got.dtype == want.dtype and got.shape == want.shape
                wide = torch.full((*shape[:-1], shape[-1] + 6), 7.0, dtype=dtype)  # into the last columns
                assert torch.equal(rotary(x, cos, sin, out=wide[..., 6:]), got)
                assert torch.equal(wide[..., 6:], got) and (wide[..., :6] == 7).all()
                worst[("rotary", dtype)] = max(worst.get(("rotary", dtype), 0), float((got - want).abs().max()))
        for bad in (torch.empty(2, 24), torch.empty(1, 24, dtype=torch.float16)):
            try:
                rms_norm(torch.ones(1, 24), torch.ones(24), 1e-6, out=bad)
            except ValueError as err:
                assert "rms_norm out must be" in str(err), err
            else:
                raise AssertionError("a wrong out was accepted")
        print(worst)
        assert worst[("norm", torch.float32)] < 2e-6 and worst[("rotary", torch.float32)] < 2e-6, worst
        # float16: products and sums rounded like torch's; a norm may differ by one rounding of its inverse
        assert worst[("rotary", torch.float16)] == 0, worst
        assert worst[("norm", torch.float16)] <= 4e-3, worst
    """)
    assert done.returncode == 0, done.stderr[-3000:]


def test_in_place_absorbed_attention_equals_the_plain_expressions():
    """InPlaceAbsorbedMLA (the GPU form: results written into column ranges and the o_proj layout) equals
    forward's concatenations and einsums, at one token and at a tree of several; so does it with q_a and kv_a
    stacked into one GEMM (fused projections); up to 64 rows its absorbed products run in one launch for every head
    (`head_matmul`)."""
    done = run_interpreted("""
        import torch
        from models.mla import AbsorbedMLA, InPlaceAbsorbedMLA
        from models.ops import ModelOps
        from models.parallel import SingleRank
        from models.presets import preset
        from models.rope import Rotary
        from plugins.tree_attention.kernel import tree_attention_cuda
        target = preset("kimi-rank", smoke=True).target
        gen = torch.Generator().manual_seed(0)
        mla = AbsorbedMLA(target, 0, ModelOps(tree_attention_cuda, SingleRank()))
        with torch.no_grad():
            for p in mla.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 + (1 if p.dim() == 1 else 0))
        state = {name: value.clone() for name, value in mla.state_dict().items()}
        mla.prepare_weights()
        # the GPU's fused projections: q_a and kv_a one GEMM over one stacked weight
        fused = InPlaceAbsorbedMLA(target, 0, ModelOps(tree_attention_cuda, SingleRank(), fused_projections=True))
        fused.load_state_dict(state)
        fused.prepare_weights()
        assert fused.q_kv_a.shape == (target.q_lora_rank + target.latent_dim, target.hidden_size)
        rotary = Rotary(target.rope, target.qk_rope_head_dim)
        worst = 0.0
        for tokens in (1, 6):
            x = torch.randn(tokens, target.hidden_size, generator=gen)
            cos, sin = rotary(torch.arange(17, 17 + tokens), x.dtype)
            cache = torch.randn(40, target.latent_dim, generator=gen)
            mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            mask[-1, 1:-1] = False  # a branch
            args = (x, cos, sin, mask, cache, torch.tensor([23]))
            with torch.no_grad():
                (want, want_kv), (got, got_kv) = mla(*args), InPlaceAbsorbedMLA.forward(mla, *args)
                stacked, stacked_kv = fused(*args)
            assert got.shape == want.shape and got_kv.shape == want_kv.shape
            for a, b in ((got, want), (got_kv, want_kv), (stacked, want), (stacked_kv, want_kv)):
                worst = max(worst, float((a - b).norm() / b.norm()))
        print("worst", worst)
        assert worst < 1e-5, worst
    """)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fused_residual_add_and_norm_equal_the_add_then_the_norm():
    """add_rms_norm (the residual add fused into the next RMSNorm, `FusedRMSNorm.add_norm`) gives the sum torch's add
    gives, bit for bit, and the norm `rms_norm` gives of that sum; a delta of another shape is refused."""
    done = run_interpreted("""
        import torch
        from models.layers import RMSNorm
        from models.triton_ops import add_rms_norm, rms_norm
        gen = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.float16):
            for shape in ((1, 64), (33, 576), (2, 3, 40)):
                x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
                delta = torch.randn(*shape, generator=gen).to(dtype)
                weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
                total, normed = add_rms_norm(x, delta, weight, 1e-6)
                want_total, want_normed = RMSNorm(shape[-1], 1e-6).to(dtype).add_norm(x, delta)
                assert torch.equal(total, x + delta) and total.shape == x.shape
                assert torch.equal(normed, rms_norm(x + delta, weight, 1e-6)), (dtype, shape)
                assert normed.shape == want_normed.shape and normed.dtype == want_normed.dtype
        try:
            add_rms_norm(torch.ones(2, 8), torch.ones(1, 8), torch.ones(8), 1e-6)
        except ValueError as err:
            assert "delta must be" in str(err)
        else:
            raise AssertionError("a delta of another shape was accepted")
        print("OK")
    """)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_fused_router_chooses_what_the_router_chooses():
    """route_top_k (FusedRouter's two kernels) gives Router's experts, in its order, and its weights: Kimi's routing
    (384 experts, top 8, one group) and DeepSeek-V3's (groups: the best 4 of 8 by their best two), a top-k that is not
    a power of two, float32 weights and bf16 ones, 1 to 130 rows (a batch's verify: logits in token blocks of 64, the
    last one partial; its rows' choices and weights bit for bit those of the same rows routed alone), rows outside a
    narrow step. FusedRouter keeps
    bf16-valued weights in bf16 and float32 ones as they are. (bf16 operands take the kernel's float32 form here: the
    interpreter's bf16 dot is not exact; the tensor-core form is checked on the GPU, benchmarks/router_gpu.py.)"""
    done = run_interpreted("""
        import torch
        from dataclasses import replace
        from models.moe import FusedRouter, Router
        from models.presets import preset
        from models.triton_ops import route_top_k
        base = preset("kimi-rank", smoke=True).target
        gen = torch.Generator().manual_seed(0)
        cases = [dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, hidden_size=256),
                 dict(n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, hidden_size=192,
                      norm_topk_prob=False)]
        checked = 0
        for fields in cases:
            config = replace(base, **fields)
            for dtype in (torch.float32, torch.bfloat16):
                router = Router(config)
                weight = torch.randn(router.weight.shape, generator=gen) * config.hidden_size ** -0.5
                router.weight.data = weight.to(dtype).float()
                router.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts, generator=gen) * 0.1)
                fused = FusedRouter(config)
                fused.load_state_dict(router.state_dict())
                fused.prepare_weights()
                assert fused.weight.dtype == dtype, (fused.weight.dtype, dtype)
                for tokens in (1, 33) if dtype == torch.float32 else (5, 64, 130):
                    x = torch.randn(tokens, config.hidden_size, generator=gen).to(dtype)
                    active = torch.rand(tokens, generator=gen) < 0.6
                    for row_active in (None, active) if tokens > 1 else (None,):
                        router.row_active = row_active
                        want_ids, want_w = router(x)
                        ids, w = route_top_k(x, fused.weight, fused.e_score_correction_bias, fused.top_k,
                                             fused.n_group, fused.topk_group, fused.norm_topk_prob, fused.scaling,
                                             row_active)
                        assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == want_ids.shape
                        assert torch.equal(ids, want_ids), (fields, dtype, tokens, ids, want_ids)
                        assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6), (w - want_w).abs().max()
                        if tokens > 64:  # a row routed in a batch's blocks is routed as alone, bit for bit
                            few = route_top_k(x[:5], fused.weight, fused.e_score_correction_bias, fused.top_k,
                                              fused.n_group, fused.topk_group, fused.norm_topk_prob, fused.scaling,
                                              None if row_active is None else row_active[:5])
                            assert torch.equal(few[0], ids[:5]) and torch.equal(few[1], w[:5])
                        checked += 1
        print("checked", checked)
        assert checked == 18, checked
    """)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fused_gated_mlp_equals_the_plain_mlp():
    """FusedGatedMLP (gate and up one GEMM, silu(gate) * up one kernel) equals GatedMLP: float32 at its tolerance,
    float16 rounded as torch rounds the silu and the product (within one rounding: the exponentials may differ)."""
    done = run_interpreted("""
        import torch
        from models.layers import FusedGatedMLP, GatedMLP
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            for tokens, hidden, width in ((1, 64, 96), (33, 48, 1200)):
                plain, fused = GatedMLP(hidden, width).to(dtype), FusedGatedMLP(hidden, width).to(dtype)
                with torch.no_grad():
                    for p in plain.parameters():
                        p.copy_((torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).to(dtype))
                fused.load_state_dict(plain.state_dict())
                fused.prepare_weights()
                x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                with torch.no_grad():
                    want, got = plain(x), fused(x)
                    act_want = torch.nn.functional.silu(plain.gate_proj(x)) * plain.up_proj(x)
                    from models.triton_ops import silu_mul
                    act = silu_mul(torch.nn.functional.linear(x, fused.gate_up))
                assert got.shape == want.shape and got.dtype == dtype
                rel = float((got.float() - want.float()).norm() / want.float().norm())
                act_rel = float(((act.float() - act_want.float()).abs() / act_want.float().abs().clamp_min(1e-3)).max())
                print(dtype, tokens, rel, act_rel)
                assert rel < (1e-6 if dtype == torch.float32 else 1e-3), rel
                assert act_rel < (1e-5 if dtype == torch.float32 else 2e-3), act_rel
    """)
    assert done.returncode == 0, done.stderr[-3000:]
