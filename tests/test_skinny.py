"""The skinny fp32 matmul (``kernels/skinny_cpu``): every path this machine runs against float64 on
fresh random inputs into poisoned outputs; the operator against the ctypes call; which products
``compress.kernels.linear`` sends to it; the decoder's fp32 linears through it."""

import math

import pytest
import torch
import torch.nn.functional as F

from compress import kernels
from compress.errors import CompressError
from compress.kernels import native, skinny_cpu

C_PATHS = [p for p in ("avx512", "avx2", "portable") if p in skinny_cpu.available()]
needs_c = pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(M: int, K: int, N: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * (1 + 3 * torch.rand(M, K, generator=gen))
    w = torch.randn(N, K, generator=gen) * 0.05
    b = torch.randn(N, generator=gen) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    return x, w, b, ref


@needs_c
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("shape", [(576, 96), (40, 7), (1000, 50), (33, 130)])
def test_kernel_matches_float64(path, shape):
    """M = 1..8 and 11 (a chunk of 8, then 3), K with and without a vector tail, N not a whole
    number of passes; with and without bias; into NaN-poisoned outputs."""
    K, N = shape
    lib = native.library()
    for M in (*range(1, 9), 11):
        for bias in (False, True):
            x, w, b, ref = inputs(M, K, N, seed=M * 31 + K + bias, bias=bias)
            y = torch.full((M, N), math.nan)
            lib.skinny_linear(
                x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                M, K, N, skinny_cpu.PATHS[path], 2,
            )  # fmt: skip
            assert torch.isfinite(y).all(), (M, bias)
            assert rel(y, ref) < 2e-6, (M, bias, rel(y, ref))


@needs_c
@pytest.mark.parametrize("path", C_PATHS)
def test_operator_matches_float64_and_the_ctypes_call(path):
    """``compress::skinny_linear`` on any leading shape: float64 accuracy, and bit for bit what
    the ctypes call computes."""
    for M, bias in ((2, True), (5, False), (8, True)):
        x, w, b, ref = inputs(M, 192, 72, seed=M + 100, bias=bias)
        y = skinny_cpu.linear(x.reshape(M, 1, 192), w, b, path)
        assert y.shape == (M, 1, 72) and y.dtype == torch.float32
        assert rel(y.reshape(M, 72), ref) < 2e-6
        via_ctypes = skinny_cpu._ctypes_op(x.reshape(M, 1, 192), w, b, skinny_cpu.PATHS[path])
        assert torch.equal(y, via_ctypes)


def test_dispatch(monkeypatch):
    """fp32 CPU products of 2..8 rows go through the kernel; one row, more than 8, bf16,
    autograd and ``COMPRESS_KERNELS=ref`` stay with ``F.linear``; an unknown path is refused."""
    calls = []
    real = skinny_cpu.linear
    monkeypatch.setattr(
        skinny_cpu, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    w, b = torch.randn(64, 32), torch.randn(64)
    for M in (1, 2, 8, 9):
        x = torch.randn(1, M, 32)
        assert rel(kernels.linear(x, w, b), F.linear(x.double(), w.double(), b.double())) < 2e-6
    expected = [(1, 2, 32), (1, 8, 32)] if C_PATHS[:1] in (["avx512"], ["avx2"]) else []
    assert calls == expected
    calls.clear()
    kernels.linear(torch.randn(4, 32).bfloat16(), w.bfloat16())
    x = torch.randn(4, 32, requires_grad=True)
    kernels.linear(x, w).sum().backward()  # autograd: F.linear, which has a backward
    assert rel(x.grad, w.double().sum(0).expand(4, 32)) < 1e-6
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    kernels.linear(torch.randn(4, 32), w)
    assert calls == []
    monkeypatch.delenv("COMPRESS_KERNELS")
    monkeypatch.setenv("COMPRESS_SKINNY", "sse9")
    with pytest.raises(CompressError, match="COMPRESS_SKINNY=sse9"):
        kernels.linear(torch.randn(4, 32), w)


@needs_c
def test_decoder_fp32_linears_use_it(tiny_dir):
    """``load`` makes the fp32 model's linears ``Linear``: a verification-sized forward (6
    tokens) through the kernel gives the logits of the same forward through ``F.linear``, and a
    compiled module traces the op-free ``F.linear`` path."""
    from compress.decoder.kv import new_cache
    from compress.decoder.model import Linear, load

    model, _ = load(tiny_dir)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Linear for m in linears)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=gen)

    def logits():
        cache = new_cache(model, "fp16", 1, 16)
        return model(ids, cache)

    with torch.no_grad():
        ours = logits()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("COMPRESS_SKINNY", "ref")
            plain = logits()
    assert rel(ours, plain) < 1e-5
    lin = linears[0]
    compiled = torch.compile(lin, fullgraph=True)
    x = torch.randn(3, lin.in_features)
    bias = None if lin.bias is None else lin.bias.double()
    assert rel(compiled(x), F.linear(x.double(), lin.weight.double(), bias)) < 2e-6


def test_no_compiler_keeps_f_linear(monkeypatch):
    """A machine where the kernels do not build: one warning (from ``native``) and ``F.linear``."""
    monkeypatch.setattr(native, "_LIB", {})
    monkeypatch.setenv("CXX", "no-such-c++")
    w, x = torch.randn(16, 32), torch.randn(4, 32)
    with pytest.warns(RuntimeWarning, match="no C.. compiler") as caught:
        y = kernels.linear(x, w)
        kernels.linear(x, w)
    assert len(caught) == 1 and skinny_cpu.available() == ["ref"]
    assert rel(y, x.double() @ w.double().t()) < 2e-6
