"""Group quantizer against a float64 reference of the formulas in quantizer.py."""

import pytest
import torch

from compress.errors import CompressError
from compress.formats.quantizer import auto_group_size, check_divides, fake_quantize, quantize


def reference_fake_quant(w, bits, g, symmetric):
    """float64, written from the equations, one group at a time."""
    w = w.double()
    out = torch.empty_like(w)
    qmax = 2**bits - 1
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], g):
            x = w[r, c : c + g]
            if symmetric:
                s = float(
                    torch.tensor(max(x.abs().max().item(), 1e-5) / (2 ** (bits - 1) - 1)).half()
                )
                z = 2 ** (bits - 1)
            else:
                s = float(torch.tensor(max((x.max() - x.min()).item(), 1e-5) / qmax).half())
                z = min(max(round(-x.min().item() / s), 0), qmax)
            q = torch.clamp(torch.round(x / s) + z, 0, qmax)
            out[r, c : c + g] = (q - z) * s
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quant_matches_float64_reference(bits, symmetric):
    torch.manual_seed(bits * 7 + symmetric)
    w = torch.randn(6, 128) * torch.rand(6, 1) * 3
    got = fake_quantize(w, bits, 32, symmetric)
    ref = reference_fake_quant(w, bits, 32, symmetric)
    # identical except for rare exact-.5 ties between float32 and float64 rounding
    mismatch = ((got.double() - ref).abs() > 1e-6).float().mean().item()
    assert mismatch < 1e-3
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-3


def test_codes_in_range_and_error_bounded():
    torch.manual_seed(1)
    w = torch.randn(16, 256)
    for bits in (2, 3, 4, 8):
        qw = quantize(w, bits, 64)
        assert qw.q.min() >= 0 and qw.q.max() <= 2**bits - 1
        err = (qw.dequantize() - w).abs()
        step = qw.scales.float().repeat_interleave(64, 1)
        # half a step from rounding, at most half a step more from rounding the zero point
        assert (err <= step + 1e-6).all()
        assert err.mean() < 0.3 * step.mean()


def test_clip_bounds_weights():
    torch.manual_seed(2)
    w = torch.randn(4, 64)
    c = w.abs().reshape(4, 1, 64).amax(-1) * 0.5
    wq = fake_quantize(w, 8, 64, clip_max=c)
    assert (wq.abs() <= c + 1e-2).all()


def test_auto_group_size():
    assert auto_group_size([4096, 11008]) == 128
    assert auto_group_size([576, 1536]) == 64
    assert auto_group_size([96, 160]) == 32
    with pytest.raises(CompressError, match="no group size"):
        auto_group_size([100])


def test_group_size_error_names_layer():
    with pytest.raises(CompressError, match="model.layers.0.mlp.down_proj.*in_features=1536"):
        check_divides("model.layers.0.mlp.down_proj", 1536, 100)


@pytest.mark.parametrize("bits", [3, 8])
def test_per_row_group_matches_float64_reference(bits):
    """group_size=-1: one scale and zero per output row, over all in_features."""
    torch.manual_seed(bits)
    w = torch.randn(5, 96) * torch.rand(5, 1) * 2
    qw = quantize(w, bits, -1)
    assert qw.group_size == 96 and qw.scales.shape == (5, 1)
    ref = reference_fake_quant(w, bits, 96, False)
    got = qw.dequantize(torch.float64)
    assert ((got - ref).abs() > 1e-6).float().mean().item() < 1e-3
    check_divides("any", 96, -1)  # -1 is valid for every layer
