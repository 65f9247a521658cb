"""Pack/unpack round trips, and the INT4 layout against an independent decoder of AutoAWQ's spec."""

import pytest
import torch

from compress.formats.awq_gemm import pack_awq, unpack_awq
from compress.formats.bitplanes import pack_planes, unpack_planes
from compress.formats.quantizer import quantize
from compress.layers import QuantLinear


def decode_awq_spec(packed: torch.Tensor) -> torch.Tensor:
    """Written from the spec, bit by bit: nibble i of word j is column 8*j + [0,2,4,6,1,3,5,7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, words = packed.shape
    out = torch.empty(rows, words * 8, dtype=torch.int64)
    for r in range(rows):
        for j in range(words):
            word = int(packed[r, j]) & 0xFFFFFFFF
            for i in range(8):
                out[r, 8 * j + order[i]] = (word >> (4 * i)) & 0xF
    return out


def test_awq_layout_matches_spec():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (5, 32), dtype=torch.int32)
    packed = pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 4)
    assert torch.equal(decode_awq_spec(packed), q.long())
    assert torch.equal(unpack_awq(packed), q)


def test_awq_known_word():
    # columns 0..7 = 1..8: nibbles in order [0,2,4,6,1,3,5,7] hold 1,3,5,7,2,4,6,8
    q = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)
    expected = sum(v << (4 * i) for i, v in enumerate([1, 3, 5, 7, 2, 4, 6, 8]))
    assert int(pack_awq(q)[0, 0]) & 0xFFFFFFFF == expected


@pytest.mark.parametrize("bits", range(1, 9))
def test_bitplane_round_trip(bits):
    torch.manual_seed(bits)
    q = torch.randint(0, 2**bits, (7, 64), dtype=torch.int32)
    planes = pack_planes(q, bits)
    assert sum(int(k[1:]) for k in planes) == bits
    assert (
        sum(t.numel() * 32 for t in planes.values()) == q.numel() * bits
    )  # exactly `bits` per code
    assert torch.equal(unpack_planes(planes, bits), q)


def test_int3_planes_spec():
    """INT3: plane w2 holds bits 0-1 of 16 codes per word, plane w1 bit 2 of 32 codes per word."""
    torch.manual_seed(3)
    q = torch.randint(0, 8, (2, 32), dtype=torch.int32)
    planes = pack_planes(q, 3)
    lo, hi = planes["w2"], planes["w1"]
    for r in range(2):
        for c in range(32):
            low = (int(lo[r, c // 16]) & 0xFFFFFFFF) >> (2 * (c % 16)) & 3
            high = (int(hi[r, 0]) & 0xFFFFFFFF) >> c & 1
            assert low | (high << 2) == int(q[r, c])


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_quantlinear_stores_exact_codes(bits):
    torch.manual_seed(bits)
    w = torch.randn(64, 128)
    qw = quantize(w, bits, 32)
    layer = QuantLinear.from_quantized(qw)
    assert torch.equal(layer.dequantize(), qw.dequantize())
    x = torch.randn(3, 128)
    ref = x.double() @ qw.dequantize().double().t()
    y = layer(x)
    assert ((y.double() - ref).norm() / ref.norm()) < 1e-5
