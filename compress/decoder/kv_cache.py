"""KV caches for the built-in decoder: fp16, KIVI (2-/4-bit) and PackKV, behind one interface.

    cache = make_cache(kind, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, **opts)
    cache.append(layer, k, v)             k, v [B, Hkv, T, D], K after RoPE, stored at positions length..
    out = cache.attend(layer, q, start)   q [B, H, Tq, D] for the last Tq positions -> [B, H, Tq, D]
    cache.length, cache.nbytes(), cache.reset()

``attend`` returns ``softmax(q K^T / sqrt(D) + mask) V``; query head ``j`` reads KV head
``j // (H / Hkv)`` (GQA). The mask hides future positions and, per row ``b``, the left
padding ``positions < start[b]``. Scores and softmax run in ``dtype`` (fp32 by default);
the output comes back in ``q``'s dtype.

The compressed caches keep the most recent ``residual`` tokens in an fp16 window and
compress the older ones. KIVI compresses a 32-token group once it has wholly left the
window (K is quantized over the group's tokens), so up to 31 more tokens wait in fp16.
PackKV quantizes each token as it leaves, so its window holds exactly ``residual``
tokens; it bit-packs them 16 at a time and repacks each block of 64 when it fills. A
token is never compressed in the ``append`` that brought it, so a prefill attends over
exact fp16 keys (as KIVI does), and the compressed history is always older than every
query: the causal mask never cuts through it, only left padding can.

``nbytes()`` counts what is held for the tokens in the cache: codes, every scale, minimum,
bit width, offset and permutation, and the fp16 window (the fp16 cache's preallocated
buffer counts its ``length`` tokens, so bytes per token compare across kinds).
"""

import math

import torch

from compress.errors import CompressError
from compress.kernels import packkv_ref
from compress.formats.bitplanes import pack_planes, unpack_planes


def make_cache(kind: str, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
               dtype: torch.dtype = torch.float32, device="cpu", **opts):
    """A cache of ``kind`` in {"fp16", "kivi", "packkv"}; ``opts`` are that kind's options."""
    if kind not in CACHES:
        raise CompressError(f"unknown KV cache kind '{kind}'. Use one of {sorted(CACHES)}.")
    cls = CACHES[kind]
    unknown = set(opts) - set(cls.OPTIONS)
    if unknown:
        raise CompressError(f"KV cache '{kind}' has no option(s) {sorted(unknown)}; its options are "
                            f"{list(cls.OPTIONS) or 'none'}.")
    return cls(n_layers, batch, n_kv_heads, head_dim, max_len, dtype, torch.device(device), **opts)


def hidden(kpos: torch.Tensor, qpos: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Mask ``[B|1, Hkv|1, 1, Tq, Lk]``, True where key position ``kpos [B|1, Hkv|1, Lk]`` is in
    query position ``qpos [Tq]``'s future or in row b's left padding (``< start[b]``)."""
    m = kpos[:, :, None, None, :] > qpos[:, None]
    if start is not None:
        m = m | (kpos < start.view(-1, 1, 1))[:, :, None, None, :]
    return m


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, tq: int) -> torch.Tensor:
    """Softmax over keys of ``scores [B, Hkv, g*Tq, Lk]`` with ``mask`` from :func:`hidden`.

    A query whose keys are all hidden (a padding query) gets finite weights, not NaN.
    """
    B, H, M, L = scores.shape
    s = scores.view(B, H, M // tq, tq, L).masked_fill(mask, torch.finfo(scores.dtype).min)
    return s.softmax(-1).view(B, H, M, L)


class Cache:
    """Shape checks, GQA query layout and lengths, shared by every kind."""

    OPTIONS: tuple = ()  # keyword options of the kind, for make_cache's check

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device):
        self.n_layers, self.batch, self.n_kv_heads, self.head_dim = n_layers, batch, n_kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.lens = [0] * n_layers

    @property
    def length(self) -> int:
        """Tokens held; the last layer's count, so it is the step's start while a step runs."""
        return self.lens[-1]

    def check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        want = (self.batch, self.n_kv_heads, k.shape[2], self.head_dim)
        if k.dim() != 4 or tuple(k.shape) != want or k.shape != v.shape:
            raise CompressError(f"KV cache append: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                                f"[batch, kv_heads, T, head_dim] = {want}; build the cache with the "
                                f"model's batch, num_key_value_heads and head_dim.")
        if self.lens[layer] + k.shape[2] > self.max_len:
            raise CompressError(f"KV cache full: layer {layer} holds {self.lens[layer]} tokens and "
                                f"{k.shape[2]} more exceed max_len={self.max_len}. Create the cache "
                                f"with a larger max_len (prompt + new tokens).")
        return k.shape[2]

    def queries(self, q: torch.Tensor):
        """``q [B, H, Tq, D]`` -> ``(q/sqrt(D) [B, Hkv, g*Tq, D], qpos [Tq])`` for this layer."""
        B, H, Tq, D = q.shape
        if B != self.batch or D != self.head_dim or H % self.n_kv_heads:
            raise CompressError(f"KV cache attend: q {tuple(q.shape)} must be [batch={self.batch}, "
                                f"heads (a multiple of kv_heads={self.n_kv_heads}), Tq, {self.head_dim}].")
        return (q.to(self.dtype) * D ** -0.5).reshape(B, self.n_kv_heads, -1, D), Tq

    def qpos(self, layer: int, tq: int) -> torch.Tensor:
        return torch.arange(self.lens[layer] - tq, self.lens[layer], device=self.device)

    def heads(self, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, g*Tq, D]`` -> ``[B, H, Tq, D]`` in ``q``'s dtype."""
        return out.reshape(q.shape).to(q.dtype)


class FP16Cache(Cache):
    """The baseline: K and V in fp16, preallocated, one ``[B, Hkv, max_len, D]`` tensor each per layer.

    Separate tensors per layer, because the compiled decode step (``compress.decoder.static``)
    writes one slot of each in place, where for a slice of one big tensor inductor copied the whole.
    """

    storage = torch.float16

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device)
        self.k = [torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=self.storage, device=device)
                  for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def append(self, layer, k, v):
        T, L = self.check_append(layer, k, v), self.lens[layer]
        self.k[layer][:, :, L:L + T] = k
        self.v[layer][:, :, L:L + T] = v
        self.lens[layer] = L + T

    def attend(self, layer, q, start=None):
        q4, tq = self.queries(q)
        L = self.lens[layer]
        scores = q4 @ self.k[layer][:, :, :L].to(self.dtype).transpose(-1, -2)
        kpos = torch.arange(L, device=self.device)[None, None]
        p = masked_softmax(scores, hidden(kpos, self.qpos(layer, tq), start), tq)
        return self.heads(p @ self.v[layer][:, :, :L].to(self.dtype), q)

    def nbytes(self) -> int:
        return 2 * sum(self.lens) * self.batch * self.n_kv_heads * self.head_dim * self.k[0].element_size()

    def reset(self):
        self.lens = [0] * self.n_layers


class ResidualCache(Cache):
    """An fp16 window of recent tokens in front of a compressed history.

    Per layer: ``win_k, win_v`` fp16 ``[B, Hkv, w, D]`` hold positions ``ncomp .. length-1``;
    positions ``0 .. ncomp-1`` are compressed (``ncomp`` a multiple of ``block``). Subclasses
    store the history and give its scores ``q K_hat^T``, its mix ``p V_hat`` and its positions.
    """

    block = 64
    granule = None  # tokens leave the window in multiples of this; None: of ``block``

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, residual):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device)
        if residual < 0:
            raise CompressError(f"KV cache residual={residual} must be >= 0 (tokens kept in fp16).")
        self.residual = residual
        self.cap = max_len // self.block * self.block  # most tokens the history can hold
        self.reset()

    def reset(self):
        self.lens = [0] * self.n_layers
        self.ncomp = [0] * self.n_layers
        self.start = None  # rows' left padding, as last given to attend
        empty = torch.zeros(self.batch, self.n_kv_heads, 0, self.head_dim, dtype=torch.float16, device=self.device)
        self.win_k, self.win_v = [empty] * self.n_layers, [empty] * self.n_layers
        self.reset_history()

    def append(self, layer, k, v):
        T = self.check_append(layer, k, v)
        old = self.win_k[layer].shape[2]
        wk = torch.cat([self.win_k[layer], k.half()], 2)
        wv = torch.cat([self.win_v[layer], v.half()], 2)
        # tokens older than this chunk and outside the newest `residual`, in whole granules
        granule = self.granule or self.block
        n = max(0, min(old, old + T - self.residual)) // granule * granule
        if n:
            self.compress(layer, wk[:, :, :n].float(), wv[:, :, :n].float())
            self.ncomp[layer] += n
            wk, wv = wk[:, :, n:].clone(), wv[:, :, n:].clone()
        self.win_k[layer], self.win_v[layer] = wk, wv
        self.lens[layer] += T

    def attend(self, layer, q, start=None):
        self.start = start
        q4, tq = self.queries(q)
        C, qpos = self.ncomp[layer], self.qpos(layer, tq)
        wk, wv = self.win_k[layer].to(self.dtype), self.win_v[layer].to(self.dtype)
        scores = q4 @ wk.transpose(-1, -2)
        kpos = torch.arange(C, self.lens[layer], device=self.device)[None, None]
        if C:
            scores = torch.cat([self.history_scores(layer, q4).to(self.dtype), scores], -1)
            hpos = self.history_positions(layer, qpos, start)
            kpos = torch.cat([hpos, kpos.expand(*hpos.shape[:2], -1)], -1)
        p = masked_softmax(scores, hidden(kpos, qpos, start), tq)
        out = p[..., C:] @ wv
        if C:
            out = out + self.history_mix(layer, p[..., :C].contiguous()).to(self.dtype)
        return self.heads(out, q)

    def history_positions(self, layer, qpos, start) -> torch.Tensor:
        """Positions ``[B|1, Hkv|1, C]`` of the compressed slots; in order by default."""
        return torch.arange(self.ncomp[layer], device=self.device)[None, None]

    def window_nbytes(self) -> int:
        return sum(w.nbytes for w in self.win_k + self.win_v)


def minmax_quantize(x: torch.Tensor, bits: int, dim: int):
    """Asymmetric ``bits``-bit quantization of ``x`` over ``dim``: ``(codes, zero fp16, scale fp16)``.

    ``scale = (max - min) / (2^bits - 1)``, ``code = round((x - min) / scale)``, ``x_hat = min + scale * code``;
    the fp16 ``zero`` and ``scale`` are the ones used to round, so ``|x - x_hat| <= scale / 2``.
    """
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half()
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(min=2.0 ** -14).half()
    codes = torch.round((x - zero.float()) / scale.float()).clamp(0, 2 ** bits - 1)
    return codes.to(torch.int32), zero, scale


class KIVICache(ResidualCache):
    """KIVI (Liu et al. 2024): K per channel over 32-token groups, V per token over 32-channel groups.

    Left padding (the ``start`` last given to ``attend``) stays out of the K groups: padded slots
    copy their row's first token before a group is quantized, so they cannot widen its range.

    Layout per layer (``BH = B * Hkv``, ``cap`` tokens, ``G = group``, ``b = bits``)::

        kq, vq : int32 [BH, cap, D*b/32]   channel-axis codes in compress.formats.bitplanes planes
        kz, ks : fp16  [BH, cap/G, D]      K zero and scale per (token group, channel)
        vz, vs : fp16  [BH, cap, D/G]      V zero and scale per (token, channel group)
    """

    OPTIONS = ("bits", "group", "residual")

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device,
                 bits=2, group=32, residual=128):
        if bits not in (2, 4):
            raise CompressError(f"KIVI bits={bits} is not supported; use bits=2 or bits=4.")
        if group < 1 or head_dim % group or head_dim % 32:
            raise CompressError(f"KIVI needs head_dim ({head_dim}) to be a multiple of 32 and of "
                                f"group ({group}); use group=32 or another divisor of head_dim.")
        self.bits, self.block = bits, group
        super().__init__(n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, residual)

    def reset_history(self):
        BH, cap, D, G, dev = self.batch * self.n_kv_heads, self.cap, self.head_dim, self.block, self.device
        words = torch.zeros(self.n_layers, BH, cap, D * self.bits // 32, dtype=torch.int32, device=dev)
        self.kq, self.vq = words, words.clone()
        self.kz = torch.zeros(self.n_layers, BH, cap // G, D, dtype=torch.float16, device=dev)
        self.ks = self.kz.clone()
        self.vz = torch.zeros(self.n_layers, BH, cap, D // G, dtype=torch.float16, device=dev)
        self.vs = self.vz.clone()

    def compress(self, layer, k, v):
        BH, n, D, G, C = self.batch * self.n_kv_heads, k.shape[2], self.head_dim, self.block, self.ncomp[layer]
        if self.start is not None:  # left padding must not widen a K group: its slots copy the row's first token
            pad = torch.arange(C, C + n, device=k.device) < self.start.to(k.device)[:, None]    # [B, n]
            first = (self.start.to(k.device) - C).clamp(0, n - 1).view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, D)
            k = torch.where(pad[:, None, :, None], k.gather(2, first), k)
        kc, kz, ks = minmax_quantize(k.reshape(BH, n // G, G, D), self.bits, dim=2)
        vc, vz, vs = minmax_quantize(v.reshape(BH, n, D // G, G), self.bits, dim=3)
        plane = f"w{self.bits}"
        self.kq[layer, :, C:C + n] = pack_planes(kc.reshape(BH * n, D), self.bits)[plane].view(BH, n, -1)
        self.vq[layer, :, C:C + n] = pack_planes(vc.reshape(BH * n, D), self.bits)[plane].view(BH, n, -1)
        self.kz[layer, :, C // G:(C + n) // G], self.ks[layer, :, C // G:(C + n) // G] = kz[:, :, 0], ks[:, :, 0]
        self.vz[layer, :, C:C + n], self.vs[layer, :, C:C + n] = vz[..., 0], vs[..., 0]

    def dequantize(self, layer, which: str) -> torch.Tensor:
        """``K_hat`` or ``V_hat`` ``[B, Hkv, C, D]`` in ``dtype``."""
        BH, C, D, G = self.batch * self.n_kv_heads, self.ncomp[layer], self.head_dim, self.block
        words = (self.kq if which == "k" else self.vq)[layer, :, :C]
        codes = unpack_planes({f"w{self.bits}": words.reshape(BH * C, -1)}, self.bits).view(BH, C, D)
        if which == "k":
            z, s = (t[layer, :, :C // G].repeat_interleave(G, 1) for t in (self.kz, self.ks))
        else:
            z, s = (t[layer, :, :C].repeat_interleave(G, 2) for t in (self.vz, self.vs))
        x = z.to(self.dtype) + s.to(self.dtype) * codes.to(self.dtype)
        return x.view(self.batch, self.n_kv_heads, C, D)

    def history(self, layer):
        """``(K_hat, V_hat)`` ``[B, Hkv, C, D]`` of the compressed positions, in position order."""
        return self.dequantize(layer, "k"), self.dequantize(layer, "v")

    def history_scores(self, layer, q4):
        return q4 @ self.dequantize(layer, "k").transpose(-1, -2)

    def history_mix(self, layer, p):
        return p @ self.dequantize(layer, "v")

    def nbytes(self) -> int:
        G, total = self.block, self.window_nbytes()
        for layer, C in enumerate(self.ncomp):
            total += self.kq[layer, :, :C].nbytes + self.vq[layer, :, :C].nbytes
            total += self.kz[layer, :, :C // G].nbytes + self.ks[layer, :, :C // G].nbytes
            total += self.vz[layer, :, :C].nbytes + self.vs[layer, :, :C].nbytes
        return total


def order_median(codes: torch.Tensor) -> torch.Tensor:
    """Permutation ``[N, T]`` sorting each block's tokens by the median of their codes (mean breaks ties).

    ``codes [N, T, C]``: the K and V codes of a block's tokens, side by side.
    """
    key = codes.median(-1).values.double() * 512 + codes.double().mean(-1)
    return key.argsort(dim=-1, stable=True)


def order_greedy(codes: torch.Tensor, pack: int = packkv_ref.PACK) -> torch.Tensor:
    """Permutation ``[N, T]`` filling packs one token at a time.

    Each pack starts from the remaining token with the lowest median code, then takes, 15
    times, the remaining token that least grows the pack's bits ``sum_c bit_length(max_c - min_c)``
    over its K and V channels (ties go to the smaller growth of the ranges).
    """
    N, T, C = codes.shape
    x = codes.float()
    rows = torch.arange(N, device=codes.device)
    seed_key = codes.median(-1).values.float()
    taken = torch.zeros(N, T, dtype=torch.bool, device=codes.device)
    perm = torch.empty(N, T, dtype=torch.long, device=codes.device)
    for s in range(T):
        if s % pack == 0:
            pick = seed_key.masked_fill(taken, math.inf).argmin(-1)
            lo = hi = x[rows, pick]
        else:
            span = torch.maximum(hi[:, None], x) - torch.minimum(lo[:, None], x)  # [N, T, C]
            cost = torch.log2(1 + span).ceil_().sum(-1) + span.sum(-1) / (256 * C)  # tie-break < 1 bit
            pick = cost.masked_fill(taken, math.inf).argmin(-1)
            lo, hi = torch.minimum(lo, x[rows, pick]), torch.maximum(hi, x[rows, pick])
        taken[rows, pick] = True
        perm[:, s] = pick
    return perm


def joined(a: tuple, b: tuple) -> tuple:
    """Tensors of ``a`` and ``b`` pairwise concatenated along the token axis (1)."""
    return tuple(torch.cat([x, y], 1) for x, y in zip(a, b))


ORDERS = {"greedy": order_greedy, "median": order_median,
          "none": lambda codes: torch.arange(codes.shape[1], device=codes.device).expand(codes.shape[:2])}


class PackKVCache(ResidualCache):
    """PackKV (arXiv 2512.24449): error-bounded per-token codes, repacked, bit-packed per 16-token pack.

    Each token leaving the window is quantized per token (``k_rel``, ``v_rel``: step = rel *
    token range) and waits as uint8 codes (``staged``, with its minimum and step) until 16 have
    left; those are bit-packed as one pack row in arrival order (``compress.kernels.packkv_ref``
    has the format). When a block of ``block`` tokens fills, its pack rows are taken back and
    the block is repacked: one permutation, shared by K and V (attention is invariant to
    permuting key/value pairs together), orders its tokens so that packs of 16 span small code
    ranges. So the cache holds exactly ``residual`` fp16 tokens, at most 15 staged ones and at
    most 48 packed in arrival order; everything older is repacked.
    The permutation is kept (uint8 ``[layers, BH, cap]``) only if ``keep_perm`` (default: when
    batch > 1, for left-padding masks); the causal mask never needs it (see the module docstring).

    Defaults ``k_rel=0.04, v_rel=0.1``: on WikiText-2 validation text (eval/kv_quality.py ``--parallel
    --windows 4 --tokens 1536 --data .../wiki.valid.tokens``), the sweep's lowest-KL pair whose bytes
    stay under a third of the fp16 cache's at every length from 1,400 to 1,700 tokens (0.321 at
    1,536, at most 0.328): KL 5.3e-3, where KIVI-4 has 3.9e-3 at 0.370. Matching KIVI-4's KL takes
    0.025:0.1 at 0.340 (1.09x fewer bytes than KIVI-4).

    Attention products come from ``compress.kernels.packkv`` (Triton, decoding in registers) on
    CUDA and from ``packkv_ref`` (unpack into a scratch tensor, then matmul) on the CPU. Measured
    on this project's 2-core CPU (one thread, one layer of SmolLM2, 1,536 tokens of which 1,408
    compressed, one decode query): scratch + matmul 2.6 ms per ``attend``, the same Triton
    kernels under the interpreter about 7 s (KIVI's dequantize + matmul 1.1 ms, fp16 0.18 ms).
    The staged tokens (under 16) are dequantized and multiplied in PyTorch.
    """

    OPTIONS = ("k_rel", "v_rel", "block", "pack", "residual", "order", "keep_perm")
    granule = 1

    def __init__(self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device,
                 k_rel=0.04, v_rel=0.1, block=64, pack=16, residual=128, order="greedy", keep_perm=None):
        for name, rel in (("k_rel", k_rel), ("v_rel", v_rel)):
            if not packkv_ref.MIN_REL <= rel <= 1:
                raise CompressError(f"PackKV {name}={rel} is out of range; use a relative error bound in "
                                    f"[{packkv_ref.MIN_REL:.4f}, 1] (step = rel * token range).")
        if pack != packkv_ref.PACK or block % pack or block > 256:
            raise CompressError(f"PackKV needs pack=16 (the packed format's) and block a multiple of 16 "
                                f"up to 256; got pack={pack}, block={block}.")
        if order not in ORDERS:
            raise CompressError(f"PackKV order='{order}' is unknown; use one of {sorted(ORDERS)}.")
        self.k_rel, self.v_rel, self.block, self.order = k_rel, v_rel, block, order
        self.keep_perm = batch > 1 if keep_perm is None else bool(keep_perm)
        self.ops = packkv_ref
        if device.type == "cuda":
            from compress.kernels import packkv

            if packkv.supports(head_dim):
                self.ops = packkv
        super().__init__(n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, residual)

    def reset_history(self):
        BH, dev, cap = self.batch * self.n_kv_heads, self.device, self.max_len // packkv_ref.PACK * packkv_ref.PACK
        self.k, self.v = ([packkv_ref.Packed.empty(BH, cap, self.head_dim, packkv_ref.max_code(rel), dev)
                           for _ in range(self.n_layers)] for rel in (self.k_rel, self.v_rel))
        self.perm = torch.zeros(self.n_layers, BH, cap if self.keep_perm else 0, dtype=torch.uint8, device=dev)
        none = torch.zeros(BH, 0, self.head_dim, dtype=torch.uint8, device=dev), \
            torch.zeros(BH, 0, dtype=torch.float16, device=dev), torch.zeros(BH, 0, dtype=torch.int8, device=dev)
        self.staged = [(none, none) for _ in range(self.n_layers)]  # per layer, K and V: (codes, tmin, lstep)

    def compress(self, layer, k, v):
        """Quantize the tokens leaving the window, bit-pack whole packs, repack a block when it fills."""
        BH, n, D, blk, pack = self.batch * self.n_kv_heads, k.shape[2], self.head_dim, self.block, packkv_ref.PACK
        pk, pv = self.k[layer], self.v[layer]
        # pending tokens of K and of V, each (codes uint8, tmin, lstep): the staged ones, then these
        new = [packkv_ref.quantize_tokens(x.reshape(BH, n, D), rel) for x, rel in ((k, self.k_rel), (v, self.v_rel))]
        kv = [joined(st, (c.to(torch.uint8), tmin, lstep)) for st, (c, tmin, lstep) in zip(self.staged[layer], new)]
        start = pk.n // blk * blk  # first slot of the block being filled
        if pk.n - start + kv[0][0].shape[1] >= blk:  # it fills: take its packs back, to repack it whole
            kv = [joined(p.pop(start), t) for p, t in zip((pk, pv), kv)]
        m = kv[0][0].shape[1]
        full = m // blk * blk if pk.n == start else 0  # whole blocks, from a block's first slot
        packed = m // pack * pack
        if full:
            codes = torch.cat([kv[0][0][:, :full], kv[1][0][:, :full]], -1).long().view(-1, blk, 2 * D)
            perm = ORDERS[self.order](codes).view(BH, full // blk, blk)
            idx = (perm + torch.arange(0, full, blk, device=self.device)[:, None]).view(BH, full)
            self.store(layer, [[t[:, :full].gather(1, idx if t.dim() == 2 else idx[..., None].expand(-1, -1, D))
                                for t in x] for x in kv], perm.reshape(BH, full))
        if packed > full:  # whole packs of a block not yet full: in arrival order
            self.store(layer, [[t[:, full:packed] for t in x] for x in kv])
        self.staged[layer] = tuple(tuple(t[:, packed:] for t in x) for x in kv)

    def store(self, layer, kv, order=None):
        """Append whole packs ``kv = [K, V]`` of ``(codes, tmin, lstep)``; ``order [BH, n]``: each one's
        token within its block (None: in arrival order)."""
        C, n = self.k[layer].n, kv[0][0].shape[1]
        for p, (codes, tmin, lstep) in zip((self.k[layer], self.v[layer]), kv):
            p.append(codes.long(), tmin, lstep)
        if self.keep_perm:
            slots = torch.arange(C, C + n, device=self.device)
            self.perm[layer, :, C:C + n] = (slots % self.block if order is None else order).to(torch.uint8)

    def staged_hat(self, layer, which: int) -> torch.Tensor:
        """Dequantized staged tokens ``[BH, s, D]`` fp32 of K (0) or V (1)."""
        return packkv_ref.values(*self.staged[layer][which])

    def history(self, layer):
        """``(K_hat, V_hat)`` ``[B, Hkv, C, D]`` fp32 of the compressed positions, in position order
        (the stored order, unpermuted; needs ``keep_perm``)."""
        if not self.keep_perm:
            raise CompressError("PackKV history() needs the permutation: create the cache with keep_perm=True.")
        n, blk, shape = self.k[layer].n, self.block, (self.batch, self.n_kv_heads, -1, self.head_dim)
        pos = (torch.arange(n, device=self.device) // blk * blk + self.perm[layer, :, :n].long())[..., None]
        out = []
        for which, p in enumerate((self.k[layer], self.v[layer])):
            x = torch.empty(p.tmin.shape[0], n, self.head_dim, device=self.device)
            x.scatter_(1, pos.expand(-1, -1, self.head_dim), packkv_ref.dequantize(p))
            out.append(torch.cat([x, self.staged_hat(layer, which)], 1).view(shape))
        return tuple(out)

    def history_scores(self, layer, q4):
        B, H, M, D = q4.shape
        q = q4.reshape(B * H, M, D).float()
        s = self.ops.qk(q, self.k[layer]) if self.k[layer].n else q.new_zeros(B * H, M, 0)
        return torch.cat([s, q @ self.staged_hat(layer, 0).transpose(1, 2)], -1).view(B, H, M, -1)

    def history_mix(self, layer, p):
        B, H, M, C = p.shape
        n, p = self.k[layer].n, p.reshape(B * H, M, C).float()
        out = p[..., n:] @ self.staged_hat(layer, 1)
        if n:
            out = out + self.ops.pv(p[..., :n].contiguous(), self.v[layer])
        return out.view(B, H, M, -1)

    def history_positions(self, layer, qpos, start):
        C, n, blk = self.ncomp[layer], self.k[layer].n, self.block
        slots = torch.arange(C, device=self.device)
        if self.keep_perm:
            packed = slots[:n] // blk * blk + self.perm[layer, :, :n].long()   # staged ones are in order
            pos = torch.cat([packed, slots[n:].expand(len(packed), -1)], 1)
            return pos.view(self.batch, self.n_kv_heads, C)
        # without the permutation a packed slot's position is known up to its block: fine unless a
        # mask boundary (a causal limit qpos + 1, or a row's start) falls inside a repacked block.
        cuts = qpos + 1 if start is None else torch.cat([qpos + 1, start.to(qpos)])
        if ((cuts > 0) & (cuts < n // blk * blk) & (cuts % blk != 0)).any():
            raise CompressError(f"a mask boundary (left padding start={None if start is None else start.tolist()}"
                                f" or the causal limit) falls inside PackKV's compressed history of {C} "
                                f"tokens, whose token order within blocks was not kept. Create the cache "
                                f"with keep_perm=True (the default when batch > 1).")
        return slots[None, None]

    def nbytes(self) -> int:
        total = self.window_nbytes()
        for layer in range(self.n_layers):
            n = self.k[layer].n
            total += self.k[layer].nbytes() + self.v[layer].nbytes() + self.perm[layer, :, :n].nbytes
            total += sum(t.nbytes for kv in self.staged[layer] for t in kv)
        return total


CACHES = {"fp16": FP16Cache, "kivi": KIVICache, "packkv": PackKVCache}
