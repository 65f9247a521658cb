"""The decoder's RMSNorm as a C++ operator (``compress::rms_norm``): float64 on fresh random
inputs in every dtype and both weight conventions, a row's bits independent of the other rows,
and the PyTorch reference under autograd and ``COMPRESS_KERNELS=eager``."""

import pytest
import torch

from compress import kernels
from compress.kernels import native
from compress.kernels.rms_norm_ref import rms_norm as reference

needs_ops = pytest.mark.skipif(not native.ops(), reason="the C++ operators did not build")
TOL = {torch.float32: 1e-6, torch.bfloat16: 6e-3, torch.float16: 8e-4}


def float64(x, w, eps, offset):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (offset + w.double())


@needs_ops
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("D", [576, 70, 5])
def test_operator_matches_float64(dtype, offset, D):
    gen = torch.Generator().manual_seed(D + int(offset))
    x = torch.randn(3, 7, D, generator=gen) * (1 + 4 * torch.rand(3, 7, D, generator=gen))
    x = x.to(dtype)
    w = (torch.randn(D, generator=gen) * 0.3 + (0 if offset else 1)).to(dtype)
    y = torch.ops.compress.rms_norm(x, w, 1e-6, offset)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()
    ref = float64(x, w, 1e-6, offset)
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    assert ((reference(x, w, 1e-6, offset).double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    assert torch.equal(kernels.rms_norm(x, w, 1e-6, offset), y)  # the entry point takes it


@needs_ops
def test_a_row_is_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 576, generator=gen).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()
    batch = kernels.rms_norm(x, w, 1e-5)
    for b in (0, 7, 15):
        assert torch.equal(kernels.rms_norm(x[b : b + 1], w, 1e-5), batch[b : b + 1])


def test_reference_under_autograd_and_eager(monkeypatch):
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.rand(32) + 0.5
    kernels.rms_norm(x, w, 1e-5).sum().backward()  # the operator has no backward
    assert x.grad is not None and torch.isfinite(x.grad).all()
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    x = torch.randn(4, 32)
    assert torch.equal(kernels.rms_norm(x, w, 1e-5), reference(x, w, 1e-5))
