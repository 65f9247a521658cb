"""PackKV (arXiv 2512.24449): error-bounded per-token codes, repacked per block, bit-packed per 16."""

import torch

from compress.decoder.kv.window import ResidualCache
from compress.errors import CompressError
from compress.kernels import packkv_order, packkv_pv, packkv_qk, packkv_ref


def order_median(codes: torch.Tensor) -> torch.Tensor:
    """Permutation ``[N, T]`` sorting each block's tokens by the median of their codes (mean breaks ties).

    ``codes [N, T, C]``: the K and V codes of a block's tokens, side by side.
    """
    key = codes.median(-1).values.double() * 512 + codes.double().mean(-1)
    return key.argsort(dim=-1, stable=True)


def joined(a: tuple, b: tuple) -> tuple:
    """Tensors of ``a`` and ``b`` pairwise concatenated along the token axis (1)."""
    return tuple(torch.cat([x, y], 1) for x, y in zip(a, b))


ORDERS = {
    "greedy": packkv_order,  # C++ on the CPU (packkv_order.cpp); rule in packkv_ref
    "median": order_median,
    "none": lambda codes: torch.arange(codes.shape[1], device=codes.device).expand(codes.shape[:2]),
}


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
    batch > 1, for left-padding masks); the causal mask never needs it (``compress.decoder.kv.window``).

    Defaults ``k_rel=0.04, v_rel=0.1``: the lowest-KL pair of a sweep whose bytes stay
    under a third of the fp16 cache's at every length from 1,400 to 1,700 tokens
    (``python eval/bench/kv_quality.py --parallel --windows 4 --tokens 1536``).

    Attention products come from ``compress.kernels`` (Triton, decoding in registers, on CUDA;
    C++ decoding pack by pack on the CPU). The staged tokens (under 16) are dequantized as they
    arrive and multiplied together with the fp16 window (``tail``).
    """

    OPTIONS = ("k_rel", "v_rel", "block", "pack", "residual", "order", "keep_perm")
    granule = 1

    def __init__(
        self,
        layout,
        batch,
        max_len,
        dtype,
        device,
        lookahead=0,
        k_rel=0.04,
        v_rel=0.1,
        block=64,
        pack=16,
        residual=128,
        order="greedy",
        keep_perm=None,
    ):
        for name, rel in (("k_rel", k_rel), ("v_rel", v_rel)):
            if not packkv_ref.MIN_REL <= rel <= 1:
                raise CompressError(
                    f"PackKV {name}={rel} is out of range; use a relative error bound in "
                    f"[{packkv_ref.MIN_REL:.4f}, 1] (step = rel * token range)."
                )
        if pack != packkv_ref.PACK or block % pack or block > 256:
            raise CompressError(
                f"PackKV needs pack=16 (the packed format's) and block a multiple of 16 "
                f"up to 256; got pack={pack}, block={block}."
            )
        if order not in ORDERS:
            raise CompressError(f"PackKV order='{order}' is unknown; use one of {sorted(ORDERS)}.")
        self.k_rel, self.v_rel, self.block, self.order = k_rel, v_rel, block, order
        self.keep_perm = batch > 1 if keep_perm is None else bool(keep_perm)
        # quantize_tokens' per-entry rel and max code of stacked [K, V]
        self.rels = tuple(
            torch.tensor(x, dtype=torch.float32, device=device).view(2, 1, 1)
            for x in ([k_rel, v_rel], [packkv_ref.max_code(k_rel), packkv_ref.max_code(v_rel)])
        )
        super().__init__(layout, batch, max_len, dtype, device, lookahead, residual)

    def reset_history(self):
        BH, dev, cap = (
            self.batch * self.n_kv_heads,
            self.device,
            self.max_len // packkv_ref.PACK * packkv_ref.PACK,
        )
        self.k, self.v = (
            [
                packkv_ref.Packed.empty(BH, cap, self.head_dim, packkv_ref.max_code(rel), dev)
                for _ in range(self.n_layers)
            ]
            for rel in (self.k_rel, self.v_rel)
        )
        self.perm = torch.zeros(
            self.n_layers, BH, cap if self.keep_perm else 0, dtype=torch.uint8, device=dev
        )
        none = (
            torch.zeros(BH, 0, self.head_dim, dtype=torch.uint8, device=dev),
            torch.zeros(BH, 0, dtype=torch.float16, device=dev),
            torch.zeros(BH, 0, dtype=torch.int8, device=dev),
        )
        self.staged = [
            (none, none) for _ in range(self.n_layers)
        ]  # per layer, K and V: (codes, tmin, lstep)
        # per layer, their x_hat fp32 [2 (K, V), BH, s, D]: attention's tail, made as they arrive
        self.staged_x = [torch.zeros(2, BH, 0, self.head_dim, device=dev)] * self.n_layers

    def compress(self, layer, k, v):
        """Quantize the tokens leaving the window, bit-pack whole packs, repack a block when it fills."""
        BH, n, D, blk, pack = (
            self.batch * self.n_kv_heads,
            k.shape[2],
            self.head_dim,
            self.block,
            packkv_ref.PACK,
        )
        pk, pv = self.k[layer], self.v[layer]
        # pending tokens of K and of V, each (codes uint8, tmin, lstep): the staged ones, then these
        codes, tmin, lstep = packkv_ref.quantize_tokens(
            torch.stack([k.reshape(BH, n, D), v.reshape(BH, n, D)]), *self.rels
        )  # K and V in one pass
        codes = codes.to(torch.uint8)
        staged_before = self.staged[layer][0][0].shape[1]
        kv = [joined(st, (codes[i], tmin[i], lstep[i])) for i, st in enumerate(self.staged[layer])]
        start = pk.n // blk * blk  # first slot of the block being filled
        if (
            pk.n - start + kv[0][0].shape[1] >= blk
        ):  # it fills: take its packs back, to repack it whole
            kv = [joined(p.pop(start), t) for p, t in zip((pk, pv), kv)]
        m = kv[0][0].shape[1]
        full = m // blk * blk if pk.n == start else 0  # whole blocks, from a block's first slot
        packed = m // pack * pack
        if full:
            codes = torch.cat([kv[0][0][:, :full], kv[1][0][:, :full]], -1).view(-1, blk, 2 * D)
            perm = ORDERS[self.order](codes).view(BH, full // blk, blk)
            idx = (perm + torch.arange(0, full, blk, device=self.device)[:, None]).view(BH, full)
            self.store(
                layer,
                [
                    [
                        t[:, :full].gather(
                            1, idx if t.dim() == 2 else idx[..., None].expand(-1, -1, D)
                        )
                        for t in x
                    ]
                    for x in kv
                ],
                perm.reshape(BH, full),
            )
        if packed > full:  # whole packs of a block not yet full: in arrival order
            self.store(layer, [[t[:, full:packed] for t in x] for x in kv])
        self.staged[layer] = tuple(tuple(t[:, packed:] for t in x) for x in kv)
        if not packed and m == staged_before + n:  # the staged ones, then these: extend x_hat
            self.staged_x[layer] = torch.cat(
                [self.staged_x[layer], packkv_ref.values(codes, tmin, lstep)], 2
            )
        else:
            self.staged_x[layer] = torch.stack([packkv_ref.values(*x) for x in self.staged[layer]])

    def store(self, layer, kv, order=None):
        """Append whole packs ``kv = [K, V]`` of ``(codes, tmin, lstep)``; ``order [BH, n]``: each one's
        token within its block (None: in arrival order)."""
        C, n = self.k[layer].n, kv[0][0].shape[1]
        for p, (codes, tmin, lstep) in zip((self.k[layer], self.v[layer]), kv):
            p.append(codes.long(), tmin, lstep)
        if self.keep_perm:
            slots = torch.arange(C, C + n, device=self.device)
            self.perm[layer, :, C : C + n] = (slots % self.block if order is None else order).to(
                torch.uint8
            )

    def staged_hat(self, layer, which: int) -> torch.Tensor:
        """Dequantized staged tokens ``[BH, s, D]`` fp32 of K (0) or V (1)."""
        return self.staged_x[layer][which]

    def tail(self, layer):
        """The staged tokens, dequantized as they arrived: attention takes them with the window."""
        x = self.staged_x[layer]
        if not x.shape[2]:
            return None
        shape = (self.batch, self.n_kv_heads, -1, self.head_dim)
        return x[0].view(shape).to(self.dtype), x[1].view(shape).to(self.dtype)

    def history(self, layer):
        """``(K_hat, V_hat)`` ``[B, Hkv, C, D]`` fp32 of the compressed positions, in position order
        (the stored order, unpermuted; needs ``keep_perm``)."""
        if not self.keep_perm:
            raise CompressError(
                "PackKV history() needs the permutation: create the cache with keep_perm=True."
            )
        n, blk, shape = (
            self.k[layer].n,
            self.block,
            (self.batch, self.n_kv_heads, -1, self.head_dim),
        )
        pos = (torch.arange(n, device=self.device) // blk * blk + self.perm[layer, :, :n].long())[
            ..., None
        ]
        out = []
        for which, p in enumerate((self.k[layer], self.v[layer])):
            x = torch.empty(p.tmin.shape[0], n, self.head_dim, device=self.device)
            x.scatter_(1, pos.expand(-1, -1, self.head_dim), packkv_ref.dequantize(p))
            out.append(torch.cat([x, self.staged_hat(layer, which)], 1).view(shape))
        return tuple(out)

    def history_scores(self, layer, q4):
        """Scores of the packed tokens (the staged ones are the :meth:`tail`)."""
        B, H, M, D = q4.shape
        return packkv_qk(q4.reshape(B * H, M, D).float(), self.k[layer]).view(B, H, M, -1)

    def history_mix(self, layer, p):
        """Mix of the packed tokens' values."""
        B, H, M, n = p.shape
        return packkv_pv(p.reshape(B * H, M, n).float(), self.v[layer]).view(B, H, M, -1)

    def history_positions(self, layer, qpos, start):
        C, n, blk = self.ncomp[layer], self.k[layer].n, self.block
        slots = torch.arange(C, device=self.device)
        if self.keep_perm:
            packed = (
                slots[:n] // blk * blk + self.perm[layer, :, :n].long()
            )  # staged ones are in order
            pos = torch.cat([packed, slots[n:].expand(len(packed), -1)], 1)
            return pos.view(self.batch, self.n_kv_heads, C)
        # without the permutation a packed slot's position is known up to its block: fine unless a
        # mask boundary (a causal limit qpos + 1, or a row's start) falls inside a repacked block.
        cuts = qpos + 1 if start is None else torch.cat([qpos + 1, start.to(qpos)])
        if ((cuts > 0) & (cuts < n // blk * blk) & (cuts % blk != 0)).any():
            raise CompressError(
                f"a mask boundary (left padding start={None if start is None else start.tolist()}"
                f" or the causal limit) falls inside PackKV's compressed history of {C} "
                f"tokens, whose token order within blocks was not kept. Create the cache "
                f"with keep_perm=True (the default when batch > 1)."
            )
        return slots[None, None]

    def nbytes(self) -> int:
        total = self.window_nbytes()
        for layer in range(self.n_layers):
            n = self.k[layer].n
            total += (
                self.k[layer].nbytes() + self.v[layer].nbytes() + self.perm[layer, :, :n].nbytes
            )
            total += sum(t.nbytes for kv in self.staged[layer] for t in kv)
        return total
