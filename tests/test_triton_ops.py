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
    forward's concatenations and einsums, at one token and at a tree of several."""
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
        mla.prepare_weights()
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
            assert got.shape == want.shape and got_kv.shape == want_kv.shape
            for a, b in ((got, want), (got_kv, want_kv)):
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
