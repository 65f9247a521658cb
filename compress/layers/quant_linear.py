"""``QuantLinear``: a linear layer that stores packed group-quantized weights.

Buffers (the names are the on-disk tensor names)::

    format "awq" (INT4, AutoAWQ GEMM, see awq_gemm.py):
        qweight  int32 [in, out/8]      qzeros  int32 [in/g, out/8]
        scales   fp16  [in/g, out]      bias    (optional) [out]
    format "compress" (any other width, bit planes, see bitplanes.py):
        qweight_w{p} int32 [in, out*p/32]   qzeros_w{p} int32 [in/g, out*p/32]
        scales   fp16  [in/g, out]          bias    (optional) [out]

    y = x @ W_hat^T + b,  W_hat[o, i] = (q[i, o] - z[i/g, o]) * s[i/g, o]

``forward`` hands the packed layer to ``compress.kernels.quant_matmul``, which
picks Triton on CUDA and the measured-fastest path on the CPU; the plain
PyTorch reference is :meth:`QuantLinear.dequantize`.
"""

import torch
from torch import nn

from compress.formats.awq_gemm import pack_awq, unpack_awq
from compress.formats.bitplanes import pack_planes, plane_widths, unpack_planes
from compress.kernels import quant_matmul


def layout_for(bits: int) -> str:
    """On-disk format of a width: AutoAWQ's GEMM layout for INT4, our bit planes otherwise."""
    return "awq" if bits == 4 else "compress"


def pack_buffers(q_t: torch.Tensor, z_t: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The packed buffers (the module docstring's names) of codes ``q_t [in, out]`` and zeros
    ``z_t [in/g, out]``."""
    if layout_for(bits) == "awq":
        return {"qweight": pack_awq(q_t), "qzeros": pack_awq(z_t)}
    out = {f"qweight_{k}": t for k, t in pack_planes(q_t, bits).items()}
    out.update({f"qzeros_{k}": t for k, t in pack_planes(z_t, bits).items()})
    return out


def buffer_codes(buffers: dict, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_buffers`: ``(q [in, out], z [in/g, out])`` (int32)."""
    if layout_for(bits) == "awq":
        return unpack_awq(buffers["qweight"]), unpack_awq(buffers["qzeros"])
    planes = plane_widths(bits)
    q = unpack_planes({f"w{p}": buffers[f"qweight_w{p}"] for p in planes}, bits)
    z = unpack_planes({f"w{p}": buffers[f"qzeros_w{p}"] for p in planes}, bits)
    return q, z


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool = False,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        group_size = in_features if group_size == -1 else group_size  # -1: one group per row
        self.bits, self.group_size = bits, group_size
        self.format = layout_for(bits)
        ng = in_features // group_size
        kw = dict(dtype=torch.int32, device=device)
        if self.format == "awq":
            self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, **kw))
            self.register_buffer("qzeros", torch.zeros(ng, out_features // 8, **kw))
        else:
            for p in plane_widths(bits):
                self.register_buffer(
                    f"qweight_w{p}", torch.zeros(in_features, out_features * p // 32, **kw)
                )
                self.register_buffer(f"qzeros_w{p}", torch.zeros(ng, out_features * p // 32, **kw))
        self.register_buffer(
            "scales", torch.zeros(ng, out_features, dtype=torch.float16, device=device)
        )
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self.cache = {}  # per-device packed forms built by the kernels (not saved)
        # "exact" (weight-only: the bit-faithful or int4pack paths) or "w4a8" (int8 activations,
        # compress.kernels.w4a8_cpu): how the kernels compute it; not saved
        self.kernel = "exact"
        self.kernel_every_m = False  # "w4a8" at every M (batch-invariant serving), not to 64 rows

    @classmethod
    def from_quantized(cls, qw, bias: torch.Tensor | None = None) -> "QuantLinear":
        """The layer holding ``qw``'s codes: any object with ``q [out, in]``, ``zeros`` and
        ``scales`` ``[out, in/g]``, ``bits`` and ``group_size`` (a quantizer's weight)."""
        out_features, in_features = qw.q.shape
        layer = cls(in_features, out_features, qw.bits, qw.group_size, bias=bias is not None)
        q_t, z_t = qw.q.t().contiguous(), qw.zeros.t().contiguous()  # [in, out], [in/g, out]
        for name, t in pack_buffers(q_t, z_t, qw.bits).items():
            getattr(layer, name).copy_(t)
        layer.scales.copy_(qw.scales.t())
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked codes: ``q [in, out]`` and ``z [in/g, out]`` (int32)."""
        return buffer_codes(self._buffers, self.bits)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """Reference dequantization: ``W_hat [out, in]`` in ``dtype``."""
        q, z = self.codes()
        g = self.group_size
        s = self.scales.to(dtype).repeat_interleave(g, dim=0)
        return ((q - z.repeat_interleave(g, dim=0)).to(dtype) * s).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_matmul(x.reshape(-1, self.in_features), self)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, format={self.format}"
        )
