"""The fused GPU kernels (models/triton_ops.py) equal the torch expressions they replace (layers.RMSNorm,
rope.apply_rotary), run here under the Triton interpreter: strided rows, 2-D and 3-D inputs, float32 and float16
(whose per-operation rounding they reproduce)."""

import pytest

from tests.interpreter import run_interpreted


def test_fused_norm_and_rotary_equal_the_torch_expressions():
    pytest.importorskip("triton")
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
                worst[("rotary", dtype)] = max(worst.get(("rotary", dtype), 0), float((got - want).abs().max()))
        print(worst)
        assert worst[("norm", torch.float32)] < 2e-6 and worst[("rotary", torch.float32)] < 2e-6, worst
        # float16: products and sums rounded like torch's; a norm may differ by one rounding of its inverse
        assert worst[("rotary", torch.float16)] == 0, worst
        assert worst[("norm", torch.float16)] <= 4e-3, worst
    """)
    assert done.returncode == 0, done.stderr[-3000:]
