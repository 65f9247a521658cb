"""KIVI's C++ CPU kernel against float64 math on the codes it was given, its dispatch, and the
KIVI cache attending the same through it as through the reference."""

import pytest
import torch

from compress.decoder.kv import KVLayout, make_cache
from compress.errors import CompressError
from compress.formats.bitplanes import pack_planes
from compress.kernels import kivi_cpu, kivi_pv, kivi_qk, kivi_ref, native
from tests.test_packkv_cpu import NARROWER, use_narrower_build


def stored(bits, bh, cap, n, d, group, seed):
    """Random codes in KIVI's layout, K and V zero points and scales, and the exact float64
    ``K_hat``, ``V_hat [BH, n, D]``."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (bh, cap, d), dtype=torch.int32, generator=g)
    words = pack_planes(codes.reshape(bh * cap, d), bits)[f"w{bits}"].view(bh, cap, -1)
    kz, vz = (
        (torch.randn(bh, cap // group, d, generator=g) * 2).half(),
        (torch.randn(bh, cap, d // group, generator=g) * 2).half(),
    )
    ks, vs = (
        (torch.rand(bh, cap // group, d, generator=g) * 0.5).half(),
        (torch.rand(bh, cap, d // group, generator=g) * 0.5).half(),
    )
    c = codes[:, :n].double()
    k_hat = (
        kz.double().repeat_interleave(group, 1)[:, :n]
        + ks.double().repeat_interleave(group, 1)[:, :n] * c
    )
    v_hat = (
        vz.double().repeat_interleave(group, 2)[:, :n]
        + vs.double().repeat_interleave(group, 2)[:, :n] * c
    )
    return words, (kz, ks), (vz, vs), k_hat, v_hat


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all() and ref.abs().max() > 0
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def kernel():
    if native.library() is None:
        pytest.fail("the C++ CPU kernels did not build on this machine (see the warning)")
    return kivi_cpu


@pytest.mark.parametrize(
    "bits, bh, cap, n, d, group, M, threads",
    [
        (2, 3, 128, 96, 64, 32, 3, 1),
        (4, 3, 128, 96, 64, 32, 3, 2),
        (2, 2, 256, 256, 128, 32, 5, 2),
        (4, 3, 96, 64, 64, 16, 1, 2),
        (4, 1, 64, 0, 32, 32, 2, 1),
    ],
)
def test_products_match_float64(kernel, bits, bh, cap, n, d, group, M, threads):
    torch.set_num_threads(threads)
    words, k, v, k_hat, v_hat = stored(bits, bh, cap, n, d, group, seed=bits + n + d)
    q = torch.randn(bh, M, d)
    p = torch.rand(bh, M, n).softmax(-1)
    scores, mixed = kernel.qk(q, words, *k, n, bits), kernel.pv(p, words, *v, n, bits)
    assert scores.shape == (bh, M, n) and mixed.shape == (bh, M, d)
    if n:
        assert rel(scores, q.double() @ k_hat.transpose(1, 2)) < 1e-6
        assert rel(mixed, p.double() @ v_hat) < 1e-6
    else:
        assert torch.equal(mixed, torch.zeros(bh, M, d))


@pytest.mark.parametrize("isa, bits", NARROWER)
def test_narrower_builds_match_float64(kernel, isa, bits, monkeypatch):
    """The library as CPUs without the wider instructions build it."""
    use_narrower_build(isa, bits, monkeypatch)
    words, k, v, k_hat, v_hat = stored(2, 3, 128, 96, 64, 32, seed=4)
    q, p = torch.randn(3, 5, 64), torch.rand(3, 5, 96).softmax(-1)
    assert rel(kivi_cpu.qk(q, words, *k, 96, 2), q.double() @ k_hat.transpose(1, 2)) < 1e-6
    assert rel(kivi_cpu.pv(p, words, *v, 96, 2), p.double() @ v_hat) < 1e-6


def test_mismatched_inputs_are_refused_before_the_kernel(kernel):
    words, k, v, _, _ = stored(4, 2, 64, 64, 64, 32, seed=0)
    with pytest.raises(CompressError, match="do(es)? not fit"):
        kernel.pv(torch.rand(2, 3, 65), words, *v, 64, 4)  # more probabilities than tokens
    with pytest.raises(CompressError, match="whole groups"):
        kernel.qk(torch.randn(2, 3, 64), words, *k, 48, 4)  # half a K group


def test_dispatch(kernel, monkeypatch):
    """fp32 CPU inputs run the kernel unless COMPRESS_KERNELS is ref or eager; V groups of
    fewer than 8 channels, other dtypes and inputs that need a gradient run the reference."""
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    calls = []
    for name in ("qk", "pv"):
        fn = getattr(kivi_cpu, name)
        monkeypatch.setattr(kivi_cpu, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    words, k, v, k_hat, v_hat = stored(2, 2, 64, 64, 64, 32, seed=1)
    q, p = torch.randn(2, 3, 64), torch.rand(2, 3, 64).softmax(-1)
    for mode, expected in ((None, ["qk", "pv"]), ("ref", []), ("eager", [])):
        if mode:
            monkeypatch.setenv("COMPRESS_KERNELS", mode)
        calls.clear()
        assert rel(kivi_qk(q, words, *k, 64, 2), q.double() @ k_hat.transpose(1, 2)) < 1e-6
        assert rel(kivi_pv(p, words, *v, 64, 2), p.double() @ v_hat) < 1e-6
        assert calls == expected
    monkeypatch.delenv("COMPRESS_KERNELS")
    calls.clear()
    words4, k4, v4, _, v4_hat = stored(2, 2, 64, 64, 64, 4, seed=2)  # V groups of 4 channels
    assert rel(kivi_pv(p, words4, *v4, 64, 2), p.double() @ v4_hat) < 1e-6
    assert kivi_qk(q.double(), words, *k, 64, 2).dtype == torch.float64
    q.requires_grad_(True)
    kivi_qk(q, words, *k, 64, 2).sum().backward()
    assert rel(q.grad, k_hat.sum(1, keepdim=True).expand(-1, 3, -1)) < 1e-6
    assert calls == []


@pytest.mark.parametrize("bits", [2, 4])
def test_cache_attends_the_same_through_the_kernel(kernel, bits, monkeypatch):
    g = torch.Generator().manual_seed(bits)
    B, HKV, L, D = 2, 3, 300, 64
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    q = torch.randn(B, 3 * HKV, 1, D, generator=g)
    outs = []
    for mode in ("ref", None):
        monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
        if mode:
            monkeypatch.setenv("COMPRESS_KERNELS", mode)
        cache = make_cache("kivi", KVLayout(1, HKV, D), B, L, bits=bits, residual=32)
        cache.append(0, k[:, :, :200], v[:, :, :200])
        for t in range(200, L):
            cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert cache.ncomp[0] == 256
        outs.append(cache.attend(0, q, start=torch.tensor([0, 21])))
    assert rel(outs[1], outs[0].double()) < 1e-5
    history = cache.history(0)  # the dequantized history still comes from the reference layout
    assert torch.equal(
        history[0].view(B * HKV, -1, D), kivi_ref.k_hat(*cache.stored(0, "k"), 256, bits)
    )


def test_without_the_library_the_reference_runs(monkeypatch):
    """Where the C++ kernels could not be built (``native.library()`` is None): the reference."""
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    monkeypatch.setattr(native, "_LIB", {"lib": None})
    words, k, v, k_hat, v_hat = stored(4, 2, 64, 64, 64, 32, seed=3)
    q, p = torch.randn(2, 3, 64), torch.rand(2, 3, 64).softmax(-1)
    assert torch.equal(kivi_qk(q, words, *k, 64, 4), kivi_ref.qk(q, words, *k, 64, 4))
    assert rel(kivi_pv(p, words, *v, 64, 4), p.double() @ v_hat) < 1e-6
