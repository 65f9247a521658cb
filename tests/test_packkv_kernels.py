"""PackKV Triton kernels (under the interpreter) against float64 math on the codes they were given."""

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from compress.decoder.kv import KVLayout, make_cache  # noqa: E402
from compress.kernels import packkv_ref, packkv_triton  # noqa: E402

D = 64


def packed(n_chunks, seed, bh=3, hi=20):
    """A ``Packed`` filled in chunks (16 to 64 tokens each), and its exact float64 ``x_hat [BH, n, D]``."""
    g = torch.Generator().manual_seed(seed)
    p = packkv_ref.Packed.empty(bh, 256, D, cmax=packkv_ref.MAX_CODE)
    rows = []
    for i in range(n_chunks):
        T = 16 * (1 + (i + seed) % 4)
        codes = torch.randint(0, hi + 1, (bh, T, D), generator=g)
        codes[:, :16, :3] = 7  # constant packs: width 0
        codes[:, :2, 5] = torch.tensor([0, packkv_ref.MAX_CODE])  # a full-width pack: width 8
        tmin = (torch.randn(bh, T, generator=g) * 2).half()
        lstep = torch.randint(-80, 0, (bh, T), generator=g, dtype=torch.int8)  # steps 2^-10 .. 1
        p.append(codes, tmin, lstep)
        rows.append(
            tmin.double()[..., None] + 2.0 ** (lstep.double()[..., None] / 8) * codes.double()
        )
    return p, torch.cat(rows, 1)


@pytest.mark.parametrize("n_chunks, M", [(1, 1), (3, 3), (4, 20)])
def test_qk_matches_float64(n_chunks, M):
    p, x = packed(n_chunks, seed=n_chunks)
    q = torch.randn(p.tmin.shape[0], M, D, generator=torch.Generator().manual_seed(M))
    out = torch.full((q.shape[0], M, p.n), math.nan)  # poisoned: every element must be written
    packkv_triton.qk(q, p, out=out)
    ref = q.double() @ x.transpose(1, 2)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("n_chunks, M, splits", [(1, 1, 1), (3, 3, 2), (5, 20, 3)])
def test_pv_matches_float64(n_chunks, M, splits):
    p, x = packed(n_chunks, seed=10 + n_chunks)
    w = torch.rand(p.tmin.shape[0], M, p.n, generator=torch.Generator().manual_seed(M)).softmax(-1)
    out = torch.full((w.shape[0], M, D), math.nan)
    packkv_triton.pv(w, p, out=out, splits=splits)
    ref = w.double() @ x
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_cache_attends_the_same_through_the_kernels():
    g = torch.Generator().manual_seed(0)
    B, HKV, L = 2, 2, 200
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    q = torch.randn(B, 2 * HKV, L, D, generator=g)
    outs = []
    for ops in (packkv_ref, packkv_triton):
        cache = make_cache("packkv", KVLayout(1, HKV, D), B, L, residual=32, block=32)
        cache.ops = ops
        cache.append(0, k[:, :, :100], v[:, :, :100])
        for t in range(100, L):
            cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert (
            cache.ncomp[0] == 168 and cache.k[0].n == 160
        )  # 5 blocks of 32 packed, 8 tokens staged
        outs.append(cache.attend(0, q[:, :, -1:], start=torch.tensor([0, 21])))
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 1e-6
