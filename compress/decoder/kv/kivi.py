"""KIVI (Liu et al. 2024): 2- or 4-bit K per channel and V per token, behind an fp16 window."""

import torch

from compress.decoder.kv.window import ResidualCache
from compress.errors import CompressError
from compress.formats.bitplanes import pack_planes
from compress.kernels import kivi_pv, kivi_qk, kivi_ref


def minmax_quantize(x: torch.Tensor, bits: int, dim: int):
    """Asymmetric ``bits``-bit quantization of ``x`` over ``dim``: ``(codes, zero fp16, scale fp16)``.

    ``scale = (max - min) / (2^bits - 1)``, ``code = round((x - min) / scale)``, ``x_hat = min + scale * code``;
    the fp16 ``zero`` and ``scale`` are the ones used to round, so ``|x - x_hat| <= scale / 2``.
    """
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half()
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=2.0**-14).half()
    codes = torch.round((x - zero.float()) / scale.float()).clamp(0, 2**bits - 1)
    return codes.to(torch.int32), zero, scale


class KIVICache(ResidualCache):
    """KIVI (Liu et al. 2024): K per channel over 32-token groups, V per token over 32-channel groups.

    Left padding (the ``start`` last given to ``attend``) stays out of the K groups: padded slots
    copy their row's first token before a group is quantized, so they cannot widen its range.

    Layout per layer (``BH = B * Hkv``, ``cap`` tokens, ``G = group``, ``b = bits``)::

        kq, vq : int32 [BH, cap, D*b/32]   codes along the channel axis, compress.formats.bitplanes planes
        kz, ks : fp16  [BH, cap/G, D]      K zero and scale per (token group, channel)
        vz, vs : fp16  [BH, cap, D/G]      V zero and scale per (token, channel group)

    Attention products come from ``compress.kernels`` (C++ reading the codes in place on the CPU;
    dequantize, then matmul, elsewhere).
    """

    OPTIONS = ("bits", "group", "residual")

    def __init__(
        self, layout, batch, max_len, dtype, device, lookahead=0, bits=2, group=32, residual=128
    ):
        head_dim = layout.head_dim
        if bits not in (2, 4):
            raise CompressError(f"KIVI bits={bits} is not supported; use bits=2 or bits=4.")
        if group < 1 or head_dim % group or head_dim % 32:
            raise CompressError(
                f"KIVI needs head_dim ({head_dim}) to be a multiple of 32 and of "
                f"group ({group}); use group=32 or another divisor of head_dim."
            )
        self.bits, self.block = bits, group
        super().__init__(layout, batch, max_len, dtype, device, lookahead, residual)

    def reset_history(self):
        BH, cap, D, G, dev = (
            self.batch * self.n_kv_heads,
            self.cap,
            self.head_dim,
            self.block,
            self.device,
        )
        words = torch.zeros(
            self.n_layers, BH, cap, D * self.bits // 32, dtype=torch.int32, device=dev
        )
        self.kq, self.vq = words, words.clone()
        self.kz = torch.zeros(self.n_layers, BH, cap // G, D, dtype=torch.float16, device=dev)
        self.ks = self.kz.clone()
        self.vz = torch.zeros(self.n_layers, BH, cap, D // G, dtype=torch.float16, device=dev)
        self.vs = self.vz.clone()

    def compress(self, layer, k, v):
        BH, n, D, G, C = (
            self.batch * self.n_kv_heads,
            k.shape[2],
            self.head_dim,
            self.block,
            self.ncomp[layer],
        )
        if (
            self.start is not None
        ):  # left padding must not widen a K group: its slots copy the row's first token
            pad = (
                torch.arange(C, C + n, device=k.device) < self.start.to(k.device)[:, None]
            )  # [B, n]
            first = (
                (self.start.to(k.device) - C)
                .clamp(0, n - 1)
                .view(-1, 1, 1, 1)
                .expand(-1, k.shape[1], 1, D)
            )
            k = torch.where(pad[:, None, :, None], k.gather(2, first), k)
        kc, kz, ks = minmax_quantize(k.reshape(BH, n // G, G, D), self.bits, dim=2)
        vc, vz, vs = minmax_quantize(v.reshape(BH, n, D // G, G), self.bits, dim=3)
        plane = f"w{self.bits}"
        self.kq[layer, :, C : C + n] = pack_planes(kc.reshape(BH * n, D), self.bits)[plane].view(
            BH, n, -1
        )
        self.vq[layer, :, C : C + n] = pack_planes(vc.reshape(BH * n, D), self.bits)[plane].view(
            BH, n, -1
        )
        self.kz[layer, :, C // G : (C + n) // G], self.ks[layer, :, C // G : (C + n) // G] = (
            kz[:, :, 0],
            ks[:, :, 0],
        )
        self.vz[layer, :, C : C + n], self.vs[layer, :, C : C + n] = vz[..., 0], vs[..., 0]

    def dequantize(self, layer, which: str) -> torch.Tensor:
        """``K_hat`` or ``V_hat`` ``[B, Hkv, C, D]`` in ``dtype``."""
        C, ref = self.ncomp[layer], kivi_ref.k_hat if which == "k" else kivi_ref.v_hat
        x = ref(*self.stored(layer, which), C, self.bits, self.dtype)
        return x.view(self.batch, self.n_kv_heads, C, self.head_dim)

    def stored(self, layer, which: str) -> tuple:
        """``(codes, zero, scale)`` of K or V of ``layer``, laid out as ``kernels.kivi_ref`` says."""
        if which == "k":
            return self.kq[layer], self.kz[layer], self.ks[layer]
        return self.vq[layer], self.vz[layer], self.vs[layer]

    def history(self, layer):
        """``(K_hat, V_hat)`` ``[B, Hkv, C, D]`` of the compressed positions, in position order."""
        return self.dequantize(layer, "k"), self.dequantize(layer, "v")

    def history_scores(self, layer, q4):
        B, H, M, D = q4.shape
        s = kivi_qk(q4.reshape(B * H, M, D), *self.stored(layer, "k"), self.ncomp[layer], self.bits)
        return s.view(B, H, M, -1)

    def history_mix(self, layer, p):
        B, H, M, C = p.shape
        out = kivi_pv(p.reshape(B * H, M, C), *self.stored(layer, "v"), C, self.bits)
        return out.view(B, H, M, -1)

    def nbytes(self) -> int:
        G, total = self.block, self.window_nbytes()
        for layer, C in enumerate(self.ncomp):
            total += self.kq[layer, :, :C].nbytes + self.vq[layer, :, :C].nbytes
            total += self.kz[layer, :, : C // G].nbytes + self.ks[layer, :, : C // G].nbytes
            total += self.vz[layer, :, :C].nbytes + self.vs[layer, :, :C].nbytes
        return total
