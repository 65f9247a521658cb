"""One dispatch rule for every kernel family: ref when forced, Triton on CUDA, the CPU path.

Each entry point of ``compress.kernels`` is checked against float64 math on fresh random
inputs; the CUDA tests run where a GPU is present.
"""

import math

import pytest
import torch

from compress import kernels
from compress.kernels import int8_cpu, int8_matmul, packkv_pv, packkv_qk, packkv_ref, quant_matmul
from compress.layers import QuantLinear

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all() and ref.abs().max() > 0
    return ((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()


def int8_problem(m, k, n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ra, rb = torch.rand(m, generator=g) * 8 + 0.1, torch.rand(n, generator=g) * 0.2 + 0.01
    bias = torch.randn(n, generator=g)
    exact = (a.double() @ b.double().t()) * ra.double()[:, None] * rb.double() / 127**2 + bias
    return [t.to(device) for t in (a, b, ra, rb, bias)], exact


def packkv_problem(n, seed, bh=4, d=64, device="cpu"):
    """A PackKV-packed tensor of ``n`` random tokens, and its float64 ``x_hat [BH, n, D]``
    computed from the codes, minima and steps (``x_hat = tmin + 2^(lstep/8) * code``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bh, n, d, generator=g) * 3
    codes, tmin, lstep = packkv_ref.quantize_tokens(x, 0.05)
    p = packkv_ref.Packed.empty(bh, n, d, packkv_ref.max_code(0.05), device)
    p.append(codes.to(device), tmin.to(device), lstep.to(device))
    return p, tmin.double()[..., None] + 2.0 ** (lstep.double()[..., None] / 8) * codes.double()


def quant_problem(bits, m, k, n, g, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 2**bits, (n, k // g), generator=gen, dtype=torch.int32)
    s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half()

    class Codes:  # what a quantizer hands to QuantLinear.from_quantized
        pass

    qw = Codes()
    qw.q, qw.zeros, qw.scales, qw.bits, qw.group_size = q, z, s, bits, g
    w_hat = (q - z.repeat_interleave(g, 1)).double() * s.double().repeat_interleave(g, 1)
    x = torch.randn(m, k, generator=gen)
    return QuantLinear.from_quantized(qw).to(device), x.to(device), x.double() @ w_hat.t()


def test_backend_rule(monkeypatch):
    x = torch.randn(2, 3)
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    assert kernels.backend(x) == "cpu"
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")  # the CPU paths, uncompiled
    assert kernels.backend(x) == "cpu"
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    assert kernels.backend(x) == "ref"


@pytest.mark.parametrize("m,k,n", [(1, 64, 128), (19, 200, 72)])
def test_int8_matmul_cpu_path_and_forced_reference(m, k, n, monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    args, exact = int8_problem(m, k, n, seed=m + k)
    assert rel(int8_matmul(*args), exact) < 1e-6
    assert int8_matmul(*args, out_dtype=torch.float16).dtype == torch.float16

    def cpu_path_must_not_run(*a):
        raise AssertionError("COMPRESS_KERNELS=ref ran the CPU path")

    monkeypatch.setattr(int8_cpu, "int8_matmul_dequant_cpu", cpu_path_must_not_run)
    with pytest.raises(AssertionError, match="ran the CPU path"):
        int8_matmul(*args)  # without the override, the CPU path is what runs
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    assert torch.equal(int8_matmul(*args), exact.float())  # float64 math, rounded once


@pytest.mark.parametrize("n,M", [(16, 1), (160, 3)])
def test_packkv_products_cpu_path(n, M, monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    p, x_hat = packkv_problem(n, seed=n + M)
    g = torch.Generator().manual_seed(M)
    q = torch.randn(p.tmin.shape[0], M, p.dim, generator=g)
    assert rel(packkv_qk(q, p), q.double() @ x_hat.transpose(1, 2)) < 1e-6
    w = torch.rand(p.tmin.shape[0], M, p.n, generator=g).softmax(-1)
    out = torch.full((w.shape[0], M, p.dim), math.nan)
    assert packkv_pv(w, p, out=out) is out
    assert rel(out, w.double() @ x_hat) < 1e-6


@CUDA
def test_cuda_runs_triton_and_ref_on_request(monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    from compress.kernels import dequant_matmul, int8_triton, packkv

    calls = []
    for mod, name in (
        (dequant_matmul, "triton_quant_matmul"),
        (packkv, "qk"),
        (packkv, "pv"),
        (int8_triton, "int8_matmul_dequant_triton"),
    ):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw)
        )
    layer, x, ref = quant_problem(4, 5, 256, 128, 64, seed=1, device="cuda")
    args, exact = int8_problem(33, 256, 128, seed=2, device="cuda")
    p, x_hat = packkv_problem(128, seed=3, device="cuda")
    q = torch.randn(p.tmin.shape[0], 2, p.dim, device="cuda")
    w = torch.rand(p.tmin.shape[0], 2, p.n, device="cuda").softmax(-1)
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("COMPRESS_KERNELS", "ref")
            calls.clear()
        assert rel(quant_matmul(x, layer), ref) < 1e-5
        assert rel(int8_matmul(*args), exact) < 1e-6
        assert rel(packkv_qk(q, p), q.double().cpu() @ x_hat.transpose(1, 2)) < 1e-5
        assert rel(packkv_pv(w, p), w.double().cpu() @ x_hat) < 1e-5
        expected = (
            [] if forced else ["triton_quant_matmul", "int8_matmul_dequant_triton", "qk", "pv"]
        )
        assert calls == expected
