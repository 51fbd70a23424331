import pytest
import torch

from builder import int4


def test_pack_unpack_round_trip_all_values():
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(5, 4)  # every int4 value, [5, 64]
    packed = int4.pack(values)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert torch.equal(int4.unpack(packed, values.shape), values)


def test_pack_matches_compressed_tensors_bit_layout():
    # compressed-tensors: value v stored as v + 8, the j-th of eight values in bits [4j, 4j + 4).
    values = torch.tensor([[1, 2, -8, 7, 0, -1, 3, -5]], dtype=torch.int8)
    expected = sum((int(v) + 8) << (4 * j) for j, v in enumerate(values[0]))
    expected = expected - 2**32 if expected >= 2**31 else expected
    assert int4.pack(values).item() == expected


def test_quantize_dequantize_against_float_reference():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=gen)
    values, scale = int4.quantize(weight, group_size=32)
    restored = int4.dequantize(int4.pack(values), scale, weight.shape, group_size=32)
    # symmetric minmax: scale = absmax / 7.5, so the rounding error is at most scale / 2 per group
    bound = scale.repeat_interleave(32, dim=1) / 2 + 1e-6
    assert torch.all((restored - weight).abs() <= bound)
    assert torch.equal(restored, values.float() * scale.repeat_interleave(32, dim=1))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_size=32 must divide the input width 40"):
        int4.quantize(torch.randn(4, 40), 32)
    with pytest.raises(ValueError, match="weight_packed must be int32"):
        int4.unpack(torch.zeros(2, 2, dtype=torch.int64), (2, 16))
    with pytest.raises(ValueError, match="weight_scale shape"):
        int4.dequantize(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 3), (4, 64), 32)
