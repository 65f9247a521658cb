"""KV caches (fp16, KIVI, PackKV) against exact float64 attention and independent byte counts.

Tolerances come from the quantization error bounds. With per-element error bounds dk, dv on
K and V, each score moves by at most eps_j = |q| . dk_j / sqrt(D), so every softmax weight moves
by a factor within [e^-2eps, e^2eps] (eps = max over visible keys), and for each query

    |out - ref| <= (e^2eps - 1) sum_j p_j |v_j| + e^2eps sum_j p_j |dv_j|.

dk, dv: fp16 storage costs |x| 2^-11; KIVI adds scale/2 (scale = group range / (2^bits - 1));
PackKV adds step/2 (step = rel * token range). The bounds are computed here from the inputs.
"""

import math

import pytest
import torch

from compress.decoder.kv import KVLayout, make_cache
from compress.errors import CompressError
from compress.eval.kv_quality import run, run_parallel
from compress.kernels import packkv_ref


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is faster, and steady on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


B, HKV, G, D = 2, 2, 2, 64  # GQA: 4 query heads over 2 KV heads
FP16_EPS = 2.0**-11


def data(L, seed=0, B=B):
    """q [B, HKV*G, L, D]; k, v [B, HKV, L, D] with per-channel offsets and scales, like real K."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(HKV, 1, D, generator=g) * 2
    scale = torch.rand(HKV, 1, D, generator=g) * 2 + 0.2
    k = torch.randn(B, HKV, L, D, generator=g) * scale + offset
    v = torch.randn(B, HKV, L, D, generator=g)
    q = torch.randn(B, HKV * G, L, D, generator=g)
    return q, k, v


def reference(q, k, v, start=None, dk=None, dv=None):
    """Exact float64 attention of ``q [B, H, Tq, D]`` (the last Tq positions) and, given per-element
    error bounds ``dk``, ``dv`` of K and V, the bound on ``|out - ref|`` per query ``[B, H, Tq]``."""
    q, k, v = q.double(), k.double(), v.double()
    g, (_, _, Tq, Dq), L = q.shape[1] // k.shape[1], q.shape, k.shape[2]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    pos, qpos = torch.arange(L), torch.arange(L - Tq, L)
    visible = (pos[None, :] <= qpos[:, None])[None, None]
    if start is not None:
        visible = visible & (pos >= start[:, None])[:, None, None, :]
    s = (q @ k.transpose(-1, -2) / math.sqrt(Dq)).masked_fill(~visible, -math.inf)
    p = s.softmax(-1)
    out = p @ v
    if dk is None:
        return out
    dk, dv = dk.double().repeat_interleave(g, 1), dv.double().repeat_interleave(g, 1)
    eps = ((q.abs() @ dk.transpose(-1, -2)) / math.sqrt(Dq)).masked_fill(~visible, 0).amax(-1)
    grow = torch.expm1(2 * eps)
    bound = (
        grow * (p @ v.norm(dim=-1, keepdim=True))[..., 0]
        + (grow + 1) * (p @ dv.norm(dim=-1, keepdim=True))[..., 0]
    )
    return out, bound


def fp16_error(x):
    return x.abs() * FP16_EPS


def packkv_error(x, rel):
    """|x - x_hat| bound: fp16 rounding, then half a step of rel * (token range)."""
    rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    return fp16_error(x) + 0.5 * rel * rng * (1 + 2.0**-9) + 1e-6


def group_range(x, dim, size=32):
    """max - min over consecutive groups of ``size`` along ``dim``, broadcast back to ``x``'s shape."""
    return torch.cat(
        [
            (c.amax(dim, keepdim=True) - c.amin(dim, keepdim=True)).expand_as(c)
            for c in x.split(size, dim)
        ],
        dim,
    )


def kivi_error(k, v, bits):
    """K per (32-token group, channel), V per (token, 32-channel group)."""
    n = 2**bits - 1
    return (
        fp16_error(k) + 0.5 * group_range(k, 2) / n * (1 + 2.0**-9) + 1e-6,
        fp16_error(v) + 0.5 * group_range(v, 3) / n * (1 + 2.0**-9) + 1e-6,
    )


def decode(cache, q, k, v, prefill, checks, start=None):
    """Prefill, then one token at a time; ``{t: attend output}`` right after appending position t
    (t = prefill - 1 is the prefill itself, all prefill queries)."""
    outs = {}
    cache.append(0, k[:, :, :prefill], v[:, :, :prefill])
    out = cache.attend(0, q[:, :, :prefill], start=start)
    outs[prefill - 1] = out
    for t in range(prefill, k.shape[2]):
        cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = cache.attend(0, q[:, :, t : t + 1], start=start)
        if t in checks:
            outs[t] = out
    return outs


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_bounded(cache, bounds, L=260, prefill=70, start=None, seed=0):
    """Attend after prefill and at decode steps stays within the error bound ``bounds(k, v) -> (dk, dv)``
    (queries in a row's left padding have nothing to attend to and are skipped); returns the last
    relative error."""
    q, k, v = data(L, seed)
    dk, dv = bounds(k, v)
    checks = {prefill + 40, L - 1}
    for t, out in decode(cache, q, k, v, prefill, checks, start).items():
        tq = prefill if t == prefill - 1 else 1
        args = (q[:, :, t + 1 - tq : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], start)
        ref, bound = reference(*args, dk[:, :, : t + 1], dv[:, :, : t + 1])
        err = (out.double() - ref).norm(dim=-1)
        padding = torch.arange(t + 1 - tq, t + 1) < (0 if start is None else start[:, None, None])
        assert torch.isfinite(out).all()
        assert ((err <= bound + 1e-5 * ref.norm(dim=-1)) | padding).all(), (
            f"t={t}: error {err.max():.3g} > bound"
        )
    return rel_err(out, ref)


def test_fp16_cache_matches_exact_attention():
    cache = make_cache("fp16", KVLayout(1, HKV, D), B, 300)
    err = check_bounded(cache, lambda k, v: (fp16_error(k), fp16_error(v)))
    assert err < 1e-3
    assert cache.length == 260


def test_long_prompt_attends_in_query_blocks():
    """A prompt longer than ``QUERY_BLOCK`` attends block by block (each block's own query slots,
    left padding kept) and gives float64 attention's output; a later decode step reads the same
    cache."""
    q, k, v = data(200, seed=3)
    start = torch.tensor([0, 37])
    cache = make_cache("full", KVLayout(1, HKV, D), B, 201)
    cache.QUERY_BLOCK = 48
    calls = []
    weights = cache.weights
    cache.weights = lambda *a, **kw: calls.append(a[1].shape[2]) or weights(*a, **kw)
    cache.append(0, k, v)
    out = cache.attend(0, q, start=start)
    assert calls == [48, 48, 48, 48, 8]
    ref = reference(q, k, v, start)
    real = torch.arange(200) >= start[:, None, None]  # queries in row 1's padding attend nothing
    mask = real.expand(-1, q.shape[1], -1)
    err, norm = (out.double() - ref).norm(dim=-1)[mask], ref.norm(dim=-1)[mask]
    assert (err <= 1e-5 * norm).all()
    q1, k1, v1 = data(201, seed=4)
    cache.append(0, k1[:, :, -1:], v1[:, :, -1:])
    k2, v2 = torch.cat([k, k1[:, :, -1:]], 2), torch.cat([v, v1[:, :, -1:]], 2)
    assert (
        rel_err(
            cache.attend(0, q1[:, :, -1:], start=start), reference(q1[:, :, -1:], k2, v2, start)
        )
        < 1e-6
    )


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_within_bound(bits):
    cache = make_cache("kivi", KVLayout(1, HKV, D), B, 300, bits=bits, residual=32)
    check_bounded(cache, lambda k, v: kivi_error(k, v, bits))
    assert cache.ncomp[0] == (259 - 32) // 32 * 32  # blocks wholly outside the newest 32 tokens


@pytest.mark.parametrize("order", ["greedy", "median", "none"])
def test_packkv_within_bound(order):
    cache = make_cache(
        "packkv", KVLayout(1, HKV, D), B, 300, k_rel=0.1, v_rel=0.2, residual=32, order=order
    )
    check_bounded(cache, lambda k, v: (packkv_error(k, 0.1), packkv_error(v, 0.2)))
    assert cache.ncomp[0] == 260 - 32  # every token outside the newest 32 is compressed
    assert (
        cache.k[0].n == 224 and cache.staged[0][0][0].shape[1] == 4
    )  # 14 packs; 4 tokens wait as uint8


def final_error(kind, L=200, prefill=60, **opts):
    """Relative error of the last decode step (history mostly compressed, residual 16)."""
    q, k, v = data(L, seed=1)
    cache = make_cache(kind, KVLayout(1, HKV, D), B, L, residual=16, **opts)
    out = decode(cache, q, k, v, prefill, {L - 1})[L - 1]
    return rel_err(out, reference(q[:, :, -1:], k, v))


def test_error_decreases_with_bits_and_rel():
    kivi = [final_error("kivi", bits=b) for b in (2, 4)]
    packkv = [final_error("packkv", k_rel=r, v_rel=r) for r in (0.2, 0.05, 0.0125)]
    assert kivi[0] > 2 * kivi[1]
    assert packkv[0] > 2 * packkv[1] > 4 * packkv[2]
    assert packkv[2] > 1e-3  # well above fp16 rounding: the history really is compressed


@pytest.mark.parametrize("rel", [0.3, 0.05, packkv_ref.MIN_REL])
def test_packkv_quantize_tokens_error_bound(rel):
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 1e-7 * torch.arange(64)  # a token of near-zero range: step raised to 2^-14
    codes, tmin, lstep = packkv_ref.quantize_tokens(x, rel)
    assert lstep.dtype == torch.int8
    tstep = 2.0 ** (lstep.double() / 8)
    x_hat = tmin.double()[..., None] + tstep[..., None] * codes.double()
    assert ((x.double() - x_hat).abs() <= tstep[..., None] / 2 + 1e-6 * x.abs()).all()
    step = rel * (x.amax(-1) - x.amin(-1)).double()
    wide = step > 2.0**-14
    assert (tstep[wide] <= step[wide]).all() and (tstep[wide] > step[wide] / 2 ** (1 / 8)).all()
    assert codes.min() == 0 and codes.max() <= packkv_ref.max_code(rel) <= packkv_ref.MAX_CODE


@pytest.mark.parametrize("hi", [1, 3, 17, 255])
def test_packkv_pack_unpack_round_trip(hi):
    g = torch.Generator().manual_seed(hi)
    BH, Dp = 3, 10
    chunks = [torch.randint(0, hi + 1, (BH, T, Dp), generator=g) for T in (16, 48, 64)]
    chunks[0][:, :, 0] = hi  # constant packs (width 0), also the first channel of a row
    chunks[2][:, :, -1] = 0  # ... and the last channel of the last row
    chunks[1][:, 0, 1], chunks[1][:, 1, 1] = 0, hi  # a full-range pack
    p = packkv_ref.Packed.empty(BH, 192, Dp, cmax=hi)
    for c in chunks:
        p.append(
            c, torch.zeros(BH, c.shape[1]), torch.zeros(BH, c.shape[1], dtype=torch.int8)
        )  # step 2^0
    codes = torch.cat(chunks, 1)
    assert torch.equal(packkv_ref.unpack_codes(p).long(), codes)
    assert torch.equal(packkv_ref.dequantize(p), codes.float())
    packs = codes.unflatten(1, (-1, 16))
    width = [int(r).bit_length() for r in (packs.amax(2) - packs.amin(2)).flatten()]
    assert p.data.numel() == sum(width) + 1  # fewest bits per pack, plus the guard word


def test_joint_permutation_invariance():
    q, k, v = data(260)
    perm = torch.randperm(260, generator=torch.Generator().manual_seed(3))
    ref = reference(q[:, :, -1:], k, v)
    assert torch.allclose(
        reference(q[:, :, -1:], k[:, :, perm], v[:, :, perm]), ref, rtol=1e-12, atol=1e-12
    )
    assert not torch.allclose(reference(q[:, :, -1:], k[:, :, perm], v), ref, rtol=1e-2, atol=1e-2)
    # repacked caches hold the same tokens in another order: same attention
    caches = {
        order: make_cache(
            "packkv", KVLayout(1, HKV, D), B, 260, residual=32, order=order, keep_perm=True
        )
        for order in ("none", "median", "greedy")
    }
    outs = {order: decode(c, q, k, v, 70, {259})[259] for order, c in caches.items()}
    for order in ("median", "greedy"):
        assert rel_err(outs[order], outs["none"].double()) < 1e-6
        n = caches[order].k[0].n  # 224: 3 repacked blocks, then 2 packs in arrival order
        slots = caches[order].perm[0, :, :n].long()
        assert not torch.equal(
            slots[:, :192], torch.arange(192).remainder(64).expand(B * HKV, -1)
        )  # tokens moved
        assert torch.equal(
            slots[:, 192:], torch.arange(192, n).remainder(64).expand(B * HKV, -1)
        )  # these not yet
        pos = torch.arange(n) // 64 * 64 + slots
        stored = packkv_ref.dequantize(caches[order].k[0])
        in_order = packkv_ref.dequantize(caches["none"].k[0])
        assert torch.equal(stored, in_order.gather(1, pos[..., None].expand_as(stored)))


def clustered(L, seed=0):
    """Tokens of two kinds, interleaved at random: packs in arrival order mix both kinds."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 2, (B, HKV, L), generator=g)
    k = (torch.randn(2, D, generator=g) * 3)[kind] + 0.05 * torch.randn(B, HKV, L, D, generator=g)
    v = (torch.randn(2, D, generator=g) * 3)[kind] + 0.05 * torch.randn(B, HKV, L, D, generator=g)
    return torch.randn(B, HKV * G, L, D, generator=g), k, v


def test_repacking_shrinks_packs():
    q, k, v = clustered(256)
    words = {}
    for order in ("none", "median", "greedy"):
        cache = make_cache(
            "packkv", KVLayout(1, HKV, D), B, 256, k_rel=0.02, v_rel=0.02, residual=0, order=order
        )
        cache.append(0, k, v)
        cache.append(0, k[:, :, :0], v[:, :, :0])  # the next append compresses the prefill
        assert cache.ncomp[0] == 256
        words[order] = cache.k[0].data.numel() + cache.v[0].data.numel()
    assert words["median"] < 0.7 * words["none"]
    assert words["greedy"] < 0.7 * words["none"]


def expected_window_bytes(L, C, layers):
    return layers * 2 * B * HKV * (L - C) * D * 2


def fill(cache, k, v, prefill=60):
    for layer in range(cache.n_layers):
        cache.append(layer, k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, k.shape[2]):
        for layer in range(cache.n_layers):
            cache.append(layer, k[:, :, t : t + 1], v[:, :, t : t + 1])


def test_nbytes_matches_independent_count():
    q, k, v = data(200)
    L, R, layers, BH = 200, 32, 2, B * HKV
    fp16 = make_cache("fp16", KVLayout(layers, HKV, D), B, 256)
    fill(fp16, k, v)
    assert fp16.nbytes() == layers * 2 * BH * L * D * 2 and fp16.length == L

    for bits in (2, 4):
        kivi = make_cache("kivi", KVLayout(layers, HKV, D), B, 256, bits=bits, residual=R)
        fill(kivi, k, v)
        C = (L - R) // 32 * 32
        codes = 2 * C * D * bits // 8  # K and V codes
        meta = (C // 32) * D * 2 * 2 + C * (
            D // 32
        ) * 2 * 2  # fp16 zero + scale: K per group x channel, V per token x group
        assert kivi.nbytes() == layers * BH * (codes + meta) + expected_window_bytes(L, C, layers)

    for keep_perm in (False, True):
        pk = make_cache(
            "packkv",
            KVLayout(layers, HKV, D),
            B,
            256,
            k_rel=0.1,
            v_rel=0.2,
            residual=R,
            keep_perm=keep_perm,
        )
        fill(pk, k, v)
        C, S = (
            (L - R) // 16 * 16,
            (L - R) % 16,
        )  # 160 packed (2 blocks repacked, 2 packs not yet), 8 staged
        total = expected_window_bytes(L, L - R, layers) + layers * 2 * BH * S * (
            D + 2 + 1
        )  # uint8 codes, min, step
        for layer in range(layers):
            for packed in (pk.k[layer], pk.v[layer]):
                packs = packkv_ref.unpack_codes(packed).unflatten(1, (-1, 16))  # [BH, C/16, 16, D]
                bits = (
                    sum(int(r).bit_length() for r in (packs.amax(2) - packs.amin(2)).flatten()) * 16
                )
                total += bits // 8 + 2  # bit stream (16 bits per pack per bit) + guard word
                total += BH * C * (2 + 1)  # fp16 minimum and int8 log-step per token
                mbits = packkv_ref.max_code(0.1 if packed is pk.k[layer] else 0.2).bit_length()
                fbits = mbits + mbits.bit_length()  # pack minimum and width, per channel
                total += (
                    BH * (C // 16) * (-(-D * fbits // 16) * 2 + 4)
                )  # 16-bit words per pack row; int32 offset
            total += BH * C * keep_perm  # uint8 permutation
        assert pk.nbytes() == total


@pytest.mark.parametrize(
    "kind, opts",
    [
        ("fp16", {}),
        ("kivi", {"bits": 4, "residual": 32}),
        ("packkv", {"k_rel": 0.05, "v_rel": 0.05, "residual": 32}),
    ],
)
def test_left_padding_start(kind, opts):
    start = torch.tensor([0, 37])  # row 1: 37 padding tokens, inside the first compressed block
    bounds = {
        "fp16": lambda k, v: (fp16_error(k), fp16_error(v)),
        "kivi": lambda k, v: kivi_error(k, v, 4),
        "packkv": lambda k, v: (packkv_error(k, 0.05), packkv_error(v, 0.05)),
    }[kind]
    check_bounded(make_cache(kind, KVLayout(1, HKV, D), B, 260, **opts), bounds, start=start)
    q, k, v = data(260)
    unmasked, masked = reference(q[:, :, -1:], k, v), reference(q[:, :, -1:], k, v, start)
    assert rel_err(unmasked[1], masked[1]) > 0.1  # the padding mask changes row 1's output


def test_kivi_left_padding_stays_out_of_k_groups():
    """Row 1's 37 padding keys are wild (x1000); the K group they share with real tokens must be
    quantized over the real tokens only: each real key stays within its group's bound without them."""
    q, k, v = data(260)
    start = torch.tensor([0, 37])
    k[1, :, :37] *= 1000
    cache = make_cache("kivi", KVLayout(1, HKV, D), B, 260, bits=4, residual=32)
    decode(cache, q, k, v, 70, set(), start)
    k_hat, _ = cache.history(0)
    C = k_hat.shape[2]
    k_real = k.clone()
    k_real[1, :, :37] = k[1, :, 37:38]  # what padding slots may hold without widening a group
    dk, _ = kivi_error(k_real, v, 4)
    real = (torch.arange(C) >= start[:, None])[:, None, :, None]
    assert C == 224 and (((k_hat - k[:, :, :C]).abs() <= dk[:, :, :C]) | ~real).all()


def test_packkv_without_permutation_refuses_padding_inside_a_block():
    q, k, v = data(260)
    cache = make_cache(
        "packkv", KVLayout(1, HKV, D), B, 260, k_rel=0.1, v_rel=0.2, residual=32, keep_perm=False
    )
    with pytest.raises(CompressError, match="keep_perm=True"):
        decode(cache, q, k, v, 70, set(), torch.tensor([0, 37]))
    cache.reset()
    assert cache.length == 0 and cache.nbytes() == 0
    # on a block edge, positions are known without the permutation
    check_bounded(
        cache,
        lambda k, v: (packkv_error(k, 0.1), packkv_error(v, 0.2)),
        start=torch.tensor([0, 64]),
    )


@pytest.mark.parametrize("kind", ["fp16", "kivi", "packkv"])
def test_gqa_equals_attention_over_repeated_kv_heads(kind):
    """Query head j reads KV head j // G: the same as MHA over each KV head repeated G times."""
    q, k, v = data(200)
    gqa = make_cache(
        kind, KVLayout(1, HKV, D), B, 200, **({} if kind == "fp16" else {"residual": 32})
    )
    mha = make_cache(
        kind, KVLayout(1, HKV * G, D), B, 200, **({} if kind == "fp16" else {"residual": 32})
    )
    out_gqa = decode(gqa, q, k, v, 60, {199})[199]
    out_mha = decode(mha, q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), 60, {199})[199]
    assert torch.allclose(out_gqa, out_mha, rtol=1e-5, atol=1e-6)
    guards = (
        2 * 2 if kind == "packkv" else 0
    )  # one 2-byte guard word ends each of K's and V's bit streams
    assert gqa.nbytes() * G == mha.nbytes() + (G - 1) * guards


def test_packkv_token_by_token_equals_all_at_once():
    """Staging, arrival-order packs and taking a block back to repack it store exactly what compressing
    the same tokens in one go stores; the window always holds the newest ``residual`` tokens."""
    q, k, v = data(261)
    one = make_cache("packkv", KVLayout(1, HKV, D), B, 261, residual=32, keep_perm=True)
    one.append(0, k[:, :, :70], v[:, :, :70])
    for t in range(70, 261):
        one.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert one.win_k[0].shape[2] == 32 and one.ncomp[0] == t + 1 - 32
    bulk = make_cache("packkv", KVLayout(1, HKV, D), B, 261, residual=32, keep_perm=True)
    bulk.append(0, k[:, :, :260], v[:, :, :260])
    bulk.append(0, k[:, :, 260:], v[:, :, 260:])  # compresses 229 tokens at once
    for a, b in (
        (one.k[0], bulk.k[0]),
        (one.v[0], bulk.v[0]),
    ):  # the streams' layouts differ, not their content
        assert a.n == b.n == 224 and a.data.numel() == b.data.numel()
        assert torch.equal(packkv_ref.unpack_codes(a), packkv_ref.unpack_codes(b))
        assert torch.equal(a.tmin[:, :224], b.tmin[:, :224]) and torch.equal(
            a.lstep[:, :224], b.lstep[:, :224]
        )
    assert torch.equal(one.perm[0, :, :224], bulk.perm[0, :, :224])
    for x, y in zip(one.staged[0], bulk.staged[0]):
        assert all(torch.equal(s, t) and s.shape[1] == 5 for s, t in zip(x, y))
    assert one.nbytes() == bulk.nbytes()
    assert torch.equal(one.attend(0, q[:, :, -1:]), bulk.attend(0, q[:, :, -1:]))


def test_user_errors_name_the_fix():
    with pytest.raises(CompressError, match="fp16"):
        make_cache("int3", KVLayout(1, 1, 64), 1, 8)
    with pytest.raises(CompressError, match="bits"):
        make_cache("kivi", KVLayout(1, 1, 64), 1, 8, bits=3)
    with pytest.raises(CompressError, match="k_rel"):
        make_cache("packkv", KVLayout(1, 1, 64), 1, 8, k_rel=0.001)
    with pytest.raises(CompressError, match="options"):
        make_cache("packkv", KVLayout(1, 1, 64), 1, 8, rel=0.1)
    cache = make_cache("fp16", KVLayout(1, 1, 64), 1, 8)
    with pytest.raises(CompressError, match="max_len"):
        cache.append(0, torch.zeros(1, 1, 9, 64), torch.zeros(1, 1, 9, 64))


def test_kv_quality_parallel_equals_token_by_token(tmp_path):
    """kv_quality --parallel (one pass per cache) gives the figures of feeding tokens one at a time."""
    from compress.decoder.model import load
    from tests.conftest import make_tiny_model

    make_tiny_model(seed=4).save_pretrained(tmp_path)  # head_dim 32
    model = load(tmp_path)[0]
    windows = torch.randint(0, 49152, (2, 150), generator=torch.Generator().manual_seed(5))
    cfgs = [
        ("fp16", "fp16", {}),
        ("kivi-2", "kivi", {"bits": 2, "residual": 16}),
        (
            "packkv",
            "packkv",
            {"k_rel": 0.2, "v_rel": 0.3, "residual": 16, "order": "greedy", "keep_perm": False},
        ),
    ]
    seq, par = run(model, windows, cfgs, 40), run_parallel(model, windows, cfgs, 40)
    for a, b in zip(
        seq, par
    ):  # projections of 1 and of 150 tokens round differently: a rare code flips
        assert math.isclose(a["bytes_per_token"], b["bytes_per_token"], rel_tol=1e-3), a["label"]
        assert math.isclose(a["ppl"], b["ppl"], rel_tol=5e-4), a["label"]
        assert math.isclose(a["kl"], b["kl"], rel_tol=2e-3, abs_tol=1e-9), a[
            "label"
        ]  # history one token off: 1-3%
    assert par[1]["kl"] > par[2]["kl"] > 1e-4  # the compressed caches did change the outputs


@pytest.mark.parametrize(
    "kind,opts",
    [
        ("packkv", {"residual": 32, "keep_perm": True}),
        ("packkv", {"residual": 0}),
        ("kivi", {"residual": 40, "bits": 4}),
        ("fp16", {}),
    ],
)
def test_settle_after_prefill_changes_nothing_but_when(kind, opts):
    """``settle()`` after the prefill compresses the prompt then, not in the first decode step:
    every later attend output, the bytes held and the compressed count are exactly those of a
    cache that was not settled (whose error the tests above bound)."""
    q, k, v = data(230, seed=4)
    lazy, eager = (make_cache(kind, KVLayout(1, HKV, D), B, 230, **opts) for _ in range(2))
    for c in (lazy, eager):
        c.append(0, k[:, :, :150], v[:, :, :150])
    eager.settle()
    if kind != "fp16":
        assert 0 < eager.ncomp[0] <= 150 and lazy.ncomp[0] == 0
    for t in range(150, 230):
        outs = []
        for c in (lazy, eager):
            c.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(c.attend(0, q[:, :, t : t + 1]))
        assert torch.equal(outs[0], outs[1]) and lazy.nbytes() == eager.nbytes()
        if kind != "fp16":
            assert lazy.ncomp == eager.ncomp


def test_packkv_quantizes_k_and_v_in_one_pass_as_apart():
    """``quantize_tokens`` of stacked K and V with a rel per entry (the cache's path) stores
    exactly what quantizing each with its own float rel stores."""
    g = torch.Generator().manual_seed(9)
    for k_rel, v_rel in ((0.04, 0.1), (packkv_ref.MIN_REL, 1.0), (0.3, 0.02)):
        k, v = torch.randn(3, 9, 64, generator=g) * 4, torch.randn(3, 9, 64, generator=g) * 0.01
        rel = torch.tensor([k_rel, v_rel]).view(2, 1, 1)
        cmax = torch.tensor([float(packkv_ref.max_code(r)) for r in (k_rel, v_rel)]).view(2, 1, 1)
        both = packkv_ref.quantize_tokens(torch.stack([k, v]), rel, cmax)
        for i, (x, r) in enumerate(((k, k_rel), (v, v_rel))):
            apart = packkv_ref.quantize_tokens(x, r)
            assert all(torch.equal(a[i], b) for a, b in zip(both, apart))


@pytest.mark.parametrize("kind,opts", [("packkv", {"residual": 16}), ("kivi", {"bits": 4})])
def test_compressed_caches_without_a_compiler(kind, opts, monkeypatch):
    """A machine without a C++ compiler: one warning, then the PyTorch path decodes the same
    cache (the same bytes; the same outputs up to fp32 summation order) as the C++ kernels."""
    import warnings

    from compress.kernels import native

    q, k, v = data(200, seed=5)
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    if native.library() is None:
        pytest.fail("the C++ CPU kernels did not build on this machine (see the warning)")
    built = make_cache(kind, KVLayout(1, HKV, D), B, 200, **opts)
    outs = decode(built, q, k, v, 100, {150, 199})
    monkeypatch.setattr(native, "_LIB", {})
    monkeypatch.setenv("CXX", "no-such-c++")
    bare = make_cache(kind, KVLayout(1, HKV, D), B, 200, **opts)
    with pytest.warns(RuntimeWarning, match="no C.. compiler") as caught:
        bare_outs = decode(bare, q, k, v, 100, {150, 199})
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert native._LIB == {"lib": None} and bare.nbytes() == built.nbytes()
    for t in (150, 199):
        assert rel_err(bare_outs[t], outs[t].double()) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert torch.equal(bare.attend(0, q[:, :, -1:]), bare_outs[199])


@pytest.mark.parametrize(
    "kind, opts",
    [("full", {}), ("fp16", {}), ("kivi", {"residual": 32}), ("packkv", {"residual": 32})],
)
def test_attention_sinks_in_every_cache(kind, opts):
    """gpt-oss's sinks (a logit z_h per query head for a key of value 0) in every kind: with them
    the output is the kind's own output without them times ``Z / (Z + e^z)`` per query and head
    (Z its own softmax denominator): one factor over the channels, and the factors of two sink
    values agree on one Z. The full cache equals float64 attention with the sink column."""
    q, k, v = data(200)
    z1 = torch.randn(HKV * G, generator=torch.Generator().manual_seed(4)) + 5
    z2 = z1 - 1.5
    outs = {}
    for name, z in (("none", None), ("z1", z1), ("z2", z2)):
        layout = KVLayout(1, HKV, D, sinks=None if z is None else z[None])
        outs[name] = decode(make_cache(kind, layout, B, 200, **opts), q, k, v, 60, {199})
    for t, o0 in outs["none"].items():
        tq = 60 if t == 59 else 1
        o0 = o0.double()
        factors = []
        for name, z in (("z1", z1), ("z2", z2)):
            oz = outs[name][t].double()
            r = (oz * o0).sum(-1) / (o0 * o0).sum(-1)  # [B, H, Tq]
            assert rel_err(r[..., None] * o0, oz) < 1e-5
            factors.append(r)
        r1, r2 = factors
        assert ((r1 > 0) & (r1 < 1)).all() and (1 - r1).mean() > 0.05  # the sink takes a share
        e1, e2 = z1.double().exp()[:, None], z2.double().exp()[:, None]
        Z = r1 * e1 / (1 - r1)
        assert ((Z / (Z + e2) - r2).abs() < 1e-4).all()
        if kind == "full":
            qq, kk, vv = q[:, :, t + 1 - tq : t + 1].double(), k[:, :, : t + 1].double(), v.double()
            kk, vv = kk.repeat_interleave(G, 1), vv[:, :, : t + 1].repeat_interleave(G, 1)
            s = qq @ kk.transpose(-1, -2) / math.sqrt(D)
            s = s.masked_fill(
                torch.arange(t + 1) > torch.arange(t + 1 - tq, t + 1)[:, None], -math.inf
            )
            s = torch.cat([s, z1.double().view(1, -1, 1, 1).expand(B, -1, tq, 1)], -1)
            ref = s.softmax(-1)[..., :-1] @ vv
            assert rel_err(outs["z1"][t], ref) < 1e-6
