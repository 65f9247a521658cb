"""``Int8Linear``: bitsandbytes' int8 layout, computed as LLM.int8 (Dettmers et al. 2022).

On disk, the layer is bitsandbytes' ``Linear8bitLt`` state_dict (what transformers
writes and reads for ``load_in_8bit``)::

    {prefix}weight         int8    [out, in]   W_i8, row-major
    {prefix}SCB            float32 [out]       c_w, the absmax of each output row
    {prefix}weight_format  uint8   []          0 (row-major)
    {prefix}bias           float32 [out]       optional

    config.json "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": true,
                                        "llm_int8_threshold": a, ...}

Like bitsandbytes (``Int8Params``), the weight is rounded to fp16 before it is quantized,
so ``weight`` and ``SCB`` are bit-identical to bitsandbytes' for the same fp weights. An
all-zero row gets ``SCB`` 0 and codes 0; no scale divides by it.

The forward, for ``y = x W^T + b``, ``x [M, K]`` (M tokens), ``W [N, K]``::

    weights (offline):  c_w[n] = max_k |W[n, k]|            W_i8 = round(127 * W / c_w)
    outlier dims:       O = {k : max_m |x[m, k]| > a}        a = threshold, default 6.0
    activations:        c_x[m] = max_{k not in O} |x[m, k]|  x_i8 = round(127 * x / c_x), O zeroed
    y = (x_i8 W_i8^T)[m, n] * c_x[m] * c_w[n] / 127^2        int8 x int8 -> int32, epilogue
      + x[:, O] (W_i8[:, O] * c_w / 127)^T                   full precision, dequantized columns
      + b

``threshold = 0`` turns the decomposition off: O is empty and every dim goes through int8
(pure vector-wise int8, the paper's "Int8 vector-wise" baseline). The outlier dims are
found and gathered once per forward with tensor ops; the int8 product is
``compress.kernels.int8_matmul``. When gradients are needed (``x.requires_grad``), the
layer computes ``x W_hat^T + b`` in x's dtype instead, since the int8 product has no
backward.

Where the forward differs from bitsandbytes' (well within 1e-2 of each other): activations
are quantized from fp32 (bitsandbytes casts them to fp16 first); ``c_x`` ignores the outlier
dims entirely (bitsandbytes zeroes only the entries >= a, so smaller entries of an outlier
dim still widen ``c_x``); a dim is an outlier when some |x| > a (bitsandbytes: >= a).
"""

import math

import torch
from torch import nn

from compress.errors import CompressError
from compress.kernels import int8_matmul

_TINY = 127.0 / torch.finfo(torch.float32).max  # below it 127 / c_x would overflow to inf


def check_threshold(threshold) -> float:
    """``threshold`` as a float >= 0, or a CompressError that names the fix."""
    ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if not ok or not math.isfinite(threshold) or threshold < 0:
        raise CompressError(
            f"the LLM.int8 threshold must be a number >= 0, got {threshold!r}. LLM.int8's default "
            f"is 6.0; 0 turns the outlier decomposition off (pure vector-wise int8). Set it in the "
            f"recipe (llm_int8.threshold=6.0) or in config.json "
            f"(quantization_config.llm_int8_threshold)."
        )
    return float(threshold)


def quantize_rowwise(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_i8 [N, K] int8, SCB [N] float32)``: absmax per output row, via fp16 as bitsandbytes
    does."""
    w16 = w.detach().to(torch.float16)
    if not torch.isfinite(w16).all():
        raise CompressError(
            f"weight of '{name}' has NaN, inf or values beyond fp16's range "
            f"(65504), which bitsandbytes' int8 format cannot hold; check the "
            f"source checkpoint."
        )
    scb = w16.abs().amax(dim=1).float()
    scale = torch.where(scb > 0, 127.0 / scb, 0.0)  # an all-zero row: codes 0, SCB 0
    return torch.round(w16 * scale[:, None]).to(torch.int8), scb


def quantize_activations(x: torch.Tensor, threshold: float, name: str = "layer"):
    """Per-token int8 of ``x [M, K]``'s non-outlier dims: ``(x_i8 [M, K], c_x [M], outlier dims
    or None)``.

    Raises a CompressError naming ``name`` when ``x`` holds NaN or inf.
    """
    xf = x.float()
    mag = xf.abs()
    outliers = None
    if threshold > 0:
        col_max = mag.amax(dim=0)
        _check_finite(col_max, name)
        outliers = (col_max > threshold).nonzero().squeeze(1)
        if outliers.numel():
            mag.index_fill_(1, outliers, 0.0)  # touches the outlier columns only
        else:
            outliers = None
    c_x = mag.amax(dim=1)
    if threshold == 0:
        _check_finite(c_x, name)
    # a zero (or subnormal) token: 0
    scaled = xf * torch.where(c_x > _TINY, 127.0 / c_x, 0.0)[:, None]
    if outliers is not None:
        scaled.index_fill_(1, outliers, 0.0)  # their share goes through the fp path
    return scaled.round_().to(torch.int8), c_x, outliers


def _check_finite(t: torch.Tensor, name: str) -> None:
    if not torch.isfinite(t).all():
        raise CompressError(
            f"the input of '{name}' contains NaN or inf. An earlier layer overflowed or the input "
            f"is corrupt; LLM.int8 refuses to quantize it rather than return a NaN perplexity. "
            f"Check the source model in fp32 on the same input."
        )


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scb: torch.Tensor,
    bias: torch.Tensor | None = None,
    threshold: float = 6.0,
    name: str = "layer",
) -> torch.Tensor:
    """LLM.int8's ``x [M, K] @ W_hat^T + b`` -> ``[M, N]`` in ``x.dtype`` (see the module
    docstring)."""
    x_i8, c_x, outliers = quantize_activations(x, threshold, name)
    y = int8_matmul(x_i8, weight, c_x, scb, bias)
    if outliers is not None:
        w_cols = weight[:, outliers].float() * (scb.float() / 127.0)[:, None]  # [N, |O|]
        y.addmm_(x[:, outliers].float(), w_cols.t())
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer in bitsandbytes' int8 format (buffers ``weight``, ``SCB``,
    ``weight_format``, ``bias``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        threshold: float = 6.0,
        device=None,
        name: str = "",
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.threshold = check_threshold(threshold)
        self.name = name  # for error messages
        self.format_checked = False
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("SCB", torch.zeros(out_features, dtype=torch.float32, device=device))
        self.register_buffer("weight_format", torch.tensor(0, dtype=torch.uint8, device=device))
        if bias:
            self.register_buffer(
                "bias", torch.zeros(out_features, dtype=torch.float32, device=device)
            )
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float = 6.0, name: str = "") -> "Int8Linear":
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            threshold=threshold,
            device=linear.weight.device,
            name=name,
        )
        layer.weight, layer.SCB = quantize_rowwise(linear.weight, name or "linear")
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """``W_hat [out, in] = W_i8 * SCB / 127``."""
        return self.weight.to(dtype) * (self.SCB.to(dtype) / 127.0)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.format_checked:  # once: the codes are read as row-major
            if int(self.weight_format) != 0:
                raise CompressError(
                    f"'{self.name}' has weight_format {int(self.weight_format)}; compress reads "
                    f"only 0 (row-major int8), which bitsandbytes >= 0.45 writes. Re-save the "
                    f"checkpoint with it."
                )
            self.format_checked = True
        if x.requires_grad and torch.is_grad_enabled():  # int8 has no backward: go through
            bias = None if self.bias is None else self.bias.to(x.dtype)  # W_hat, as bitsandbytes
            return nn.functional.linear(x, self.dequantize(x.dtype), bias)  # does on the CPU
        y = int8_linear(
            x.reshape(-1, self.in_features),
            self.weight,
            self.SCB,
            self.bias,
            self.threshold,
            self.name or "an Int8Linear layer",
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"threshold={self.threshold}"
        )
