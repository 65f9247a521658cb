"""PackKV's C++ CPU kernel against float64 math on the codes it was given, its dispatch, and the
reference path it falls back to when it cannot be built."""

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from compress.decoder.kv import KVLayout, make_cache
from compress.errors import CompressError
from compress.kernels import native, packkv_cpu, packkv_pv, packkv_qk, packkv_ref


def packed(n_chunks, seed, d=64, bh=3, spare=32):
    """A ``Packed`` filled in chunks of 16 to 64 tokens with random codes of random ranges (bit
    widths 0 to 8), room for ``spare`` more slots, and its exact float64 ``x_hat [BH, n, D]``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [16 * (1 + (i + seed) % 4) for i in range(n_chunks)]
    p = packkv_ref.Packed.empty(bh, sum(sizes) + spare, d, cmax=packkv_ref.MAX_CODE)
    rows = []
    for T in sizes:
        hi = torch.randint(0, packkv_ref.MAX_CODE + 1, (bh, T // 16, 1, d), generator=g)
        codes = (torch.rand(bh, T // 16, 16, d, generator=g) * (hi + 1)).long().view(bh, T, d)
        codes[:, :16, :3] = 7  # constant packs: width 0
        codes[:, :2, 5] = torch.tensor([0, packkv_ref.MAX_CODE])  # a full-width pack: width 8
        tmin = (torch.randn(bh, T, generator=g) * 2).half()
        lstep = torch.randint(-80, 0, (bh, T), generator=g, dtype=torch.int8)  # steps 2^-10 .. 1
        p.append(codes, tmin, lstep)
        rows.append(
            tmin.double()[..., None] + 2.0 ** (lstep.double()[..., None] / 8) * codes.double()
        )
    return p, torch.cat(rows, 1)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all() and ref.abs().max() > 0
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def kernel():
    """The compiled kernels (built here on first use); these tests need a C++ compiler."""
    if native.library() is None:
        pytest.fail("the PackKV CPU kernel did not build on this machine (see the warning)")
    return packkv_cpu


SHAPES = [  # chunks, queries M (tiles of 4 and a remainder), head_dim, threads
    (1, 1, 64, 1),
    (3, 3, 64, 2),
    (5, 9, 64, 2),
    (4, 6, 32, 1),
    (9, 3, 32, 2),
    (2, 2, 48, 2),
]


@pytest.mark.parametrize("n_chunks, M, d, threads", SHAPES)
def test_qk_matches_float64(kernel, n_chunks, M, d, threads):
    torch.set_num_threads(threads)
    p, x = packed(n_chunks, seed=n_chunks + d, d=d)
    q = torch.randn(p.tmin.shape[0], M, d, generator=torch.Generator().manual_seed(M))
    out = torch.full((q.shape[0], M, p.n), math.nan)  # poisoned: every element must be written
    assert kernel.qk(q, p, out=out) is out
    assert rel(out, q.double() @ x.transpose(1, 2)) < 1e-6


@pytest.mark.parametrize("n_chunks, M, d, threads", SHAPES)
def test_pv_matches_float64(kernel, n_chunks, M, d, threads):
    torch.set_num_threads(threads)
    p, x = packed(n_chunks, seed=20 + n_chunks + d, d=d)
    w = torch.rand(p.tmin.shape[0], M, p.n, generator=torch.Generator().manual_seed(M)).softmax(-1)
    out = torch.full((w.shape[0], M, d), math.nan)
    assert kernel.pv(w, p, out=out) is out
    assert rel(out, w.double() @ x) < 1e-6


def test_long_history_and_strided_out(kernel):
    """8,000 tokens of real quantized K (every pack ends near the stream's end once), both
    products into a non-contiguous ``out``."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8000, 64, generator=g) * 3
    codes, tmin, lstep = packkv_ref.quantize_tokens(x, 0.04)
    p = packkv_ref.Packed.empty(3, 8000, 64, packkv_ref.max_code(0.04))
    p.append(codes, tmin, lstep)
    x_hat = tmin.double()[..., None] + 2.0 ** (lstep.double()[..., None] / 8) * codes.double()
    q = torch.randn(3, 3, 64, generator=g)
    out = torch.full((3, 8000, 3), math.nan).transpose(1, 2)
    assert kernel.qk(q, p, out=out) is out
    assert rel(out, q.double() @ x_hat.transpose(1, 2)) < 1e-6
    w = torch.rand(3, 3, 8000, generator=g).softmax(-1)
    assert rel(kernel.pv(w, p), w.double() @ x_hat) < 1e-6


def test_empty_history(kernel):
    p = packkv_ref.Packed.empty(2, 64, 64)
    assert kernel.qk(torch.randn(2, 3, 64), p).shape == (2, 3, 0)
    out = torch.full((2, 3, 64), math.nan)
    assert torch.equal(kernel.pv(torch.rand(2, 3, 0), p, out=out), torch.zeros(2, 3, 64))


ISAS = ("DEFAULT", "AVX2", "AVX512")  # portable C++, then each wider decoder
NARROWER = [("DEFAULT", 0), ("AVX2", 256)]


def use_narrower_build(isa: str, bits: int, monkeypatch) -> None:
    """Load the library as a CPU without the wider instructions builds it (skip the ISA this
    CPU runs in every other test, or cannot run)."""
    cpu = torch.backends.cpu.get_cpu_capability()
    if ISAS.index(isa) >= ISAS.index(cpu if cpu in ISAS else "DEFAULT"):
        pytest.skip(f"this CPU ({cpu}) runs the {isa} build in every other test, or cannot run it")
    lib = native._build(isa)
    assert lib.cpu_simd_bits() == bits
    monkeypatch.setattr(native, "_LIB", {"lib": lib})


@pytest.mark.parametrize("isa, bits", NARROWER)
def test_narrower_builds_match_float64(kernel, isa, bits, monkeypatch):
    """The decoders this CPU does not pick by default (scalar shifts; AVX2 on an AVX-512 CPU)."""
    use_narrower_build(isa, bits, monkeypatch)
    p, x = packed(4, seed=3)
    q = torch.randn(3, 5, 64)
    w = torch.rand(3, 5, p.n).softmax(-1)
    assert rel(packkv_cpu.qk(q, p), q.double() @ x.transpose(1, 2)) < 1e-6
    assert rel(packkv_cpu.pv(w, p), w.double() @ x) < 1e-6


def test_a_second_process_reuses_the_build(kernel):
    """Built once into torch's extension directory: a new process loads it without compiling."""
    lib = Path(native.library()._name)
    before = lib.stat().st_mtime_ns
    code = (
        "import sys; from compress.kernels import native; "
        "sys.exit(native.library() is None or native.library()._name != sys.argv[1])"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert lib.stat().st_mtime_ns == before


def test_shape_mismatch_is_refused_before_the_kernel(kernel):
    p, _ = packed(2, seed=1)
    with pytest.raises(CompressError, match="expected a CPU tensor"):
        kernel.pv(torch.rand(3, 2, p.n + 16), p)  # more probabilities than slots
    with pytest.raises(CompressError, match="expected a CPU tensor"):
        kernel.qk(torch.randn(2, 2, 64), p)  # fewer rows


def test_dispatch_runs_the_kernel_unless_ref_or_eager(kernel, monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    calls = []
    for name in ("qk", "pv"):
        fn = getattr(packkv_cpu, name)
        monkeypatch.setattr(
            packkv_cpu, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw)
        )
    p, x = packed(3, seed=7)
    q, w = torch.randn(3, 3, 64), torch.rand(3, 3, p.n).softmax(-1)
    for mode, expected in ((None, ["qk", "pv"]), ("ref", []), ("eager", [])):
        if mode:
            monkeypatch.setenv("COMPRESS_KERNELS", mode)
        calls.clear()
        assert rel(packkv_qk(q, p), q.double() @ x.transpose(1, 2)) < 1e-6
        assert rel(packkv_pv(w, p), w.double() @ x) < 1e-6
        assert calls == expected
    monkeypatch.delenv("COMPRESS_KERNELS")
    q.requires_grad_(True)  # the kernel has no backward: the reference runs, and its gradient
    packkv_qk(q, p).sum().backward()
    assert calls == [] and rel(q.grad, x.sum(1).unsqueeze(1).expand(-1, 3, -1)) < 1e-6


def test_cache_attends_the_same_through_the_kernel(kernel, monkeypatch):
    g = torch.Generator().manual_seed(0)
    B, HKV, L, D = 2, 3, 300, 64
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    q = torch.randn(B, 3 * HKV, 1, D, generator=g)
    outs = []
    for mode in ("ref", None):
        monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
        if mode:
            monkeypatch.setenv("COMPRESS_KERNELS", mode)
        cache = make_cache("packkv", KVLayout(1, HKV, D), B, L, residual=32, block=32)
        cache.append(0, k[:, :, :200], v[:, :, :200])
        for t in range(200, L):
            cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert cache.k[0].n == 256  # 8 blocks of 32 packed, the rest staged or in the window
        outs.append(cache.attend(0, q, start=torch.tensor([0, 21])))
    assert rel(outs[1], outs[0].double()) < 1e-5


def test_no_compiler_warns_once_and_runs_the_reference(monkeypatch):
    """A machine without a C++ compiler: one warning naming it, then the reference's results."""
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    monkeypatch.setattr(native, "_LIB", {})
    monkeypatch.setenv("CXX", "no-such-c++")
    p, x = packed(2, seed=11)
    q, w = torch.randn(3, 2, 64), torch.rand(3, 2, p.n).softmax(-1)
    with pytest.warns(RuntimeWarning, match="no C.. compiler: 'no-such-c..' is not on PATH"):
        scores = packkv_qk(q, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        mixed = packkv_pv(w, p)
    assert native._LIB == {"lib": None}
    assert torch.equal(scores, packkv_ref.qk(q, p)) and torch.equal(mixed, packkv_ref.pv(w, p))
    assert rel(scores, q.double() @ x.transpose(1, 2)) < 1e-6


def test_compile_error_warns_and_runs_the_reference(monkeypatch):
    """Any build failure (here: the compiler rejects the source) falls back the same way."""
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    monkeypatch.setattr(native, "_LIB", {})

    def fails(*args, **kwargs):
        raise RuntimeError("Error building extension 'compress_packkv_cpu': error: expected ';'")

    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    monkeypatch.setattr("torch.utils.cpp_extension.load", fails)
    p, _ = packed(1, seed=12)
    q = torch.randn(3, 1, 64)
    with pytest.warns(RuntimeWarning, match="could not be built .*expected ';'.* PyTorch path"):
        scores = packkv_qk(q, p)
    assert torch.equal(scores, packkv_ref.qk(q, p))
