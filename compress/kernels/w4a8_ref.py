"""W4A8: a group-quantized linear with its activations rounded to int8, in PyTorch (the reference
of ``w4a8_cpu``).

The weight is the layer's group-wise asymmetric codes, ``W_hat[o, i] = (q[i, o] - z[G, o]) s[G,
o]`` for input channel ``i`` in group ``G`` (``g`` channels). The activations ``x [M, K]`` are
quantized per token and block of ``BLOCK = 32`` channels (llama.cpp's Q8_1 blocks; a weight group
holds ``g / 32`` of them)::

    d[m, b]  = max_{i in b} |x[m, i]| / 127                           (fp32)
    xq[m, i] = round(x[m, i] * (127 / max_{i in b} |x[m, i]|))        int8 in [-127, 127], half to even
    xs[m, G] = sum_{b in G} d[m, b] sum_{i in b} xq[m, i]             the zero-point term's sum

so that, with the integer sums ``I[m, b, o] = sum_{i in b} q[i, o] xq[m, i]``,

    y[m, o] = sum_i W_hat[o, i] d[m, b(i)] xq[m, i]
            = sum_G s[G, o] (sum_{b in G} d[m, b] I[m, b, o]) - sum_G (s z)[G, o] xs[m, G]

The first line is what :func:`matmul` computes (the dequantized activations times the dequantized
weight, in ``dtype``: float64 for tests, float32 as the PyTorch path of ``kernel=w4a8``); the
second is the kernel's: int32 sums per block, scaled in fp32.
"""

import torch

BLOCK = 32  # input channels per activation scale


def quantize(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xq int8 [M, K], d fp32 [M, K/32], xs fp32 [M, K/g])`` of ``x [M, K]`` (fp32 math, as
    the kernel's)."""
    x = x.float()
    M, K = x.shape
    blocks = x.reshape(M, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).to(torch.int8)
    d = amax / 127.0
    bsum = xq.sum(-1, dtype=torch.int32).float()
    xs = (d * bsum).reshape(M, K // group_size, group_size // BLOCK).sum(-1)
    return xq.reshape(M, K), d, xs


def dequantized(x: torch.Tensor, group_size: int, dtype=torch.float64) -> torch.Tensor:
    """``x_hat [M, K] = d xq``: the activations the kernel multiplies, in ``dtype``."""
    xq, d, _ = quantize(x, group_size)
    M, K = xq.shape
    return (xq.to(dtype).reshape(M, -1, BLOCK) * d.to(dtype)[..., None]).reshape(M, K)


def matmul(x: torch.Tensor, layer, dtype=torch.float64) -> torch.Tensor:
    """``x_hat @ W_hat^T`` ``[M, out]`` in ``dtype`` for a ``QuantLinear`` (no bias)."""
    return dequantized(x, layer.group_size, dtype) @ layer.dequantize(dtype).t()


def experts(
    x: torch.Tensor,
    w: torch.Tensor,
    e: torch.Tensor,
    gate_up: list,
    down: list,
    dtype=torch.float64,
) -> torch.Tensor:
    """``y [M, H]`` in ``dtype`` of SiLU-gated experts (``w4a8_cpu.experts``): for each row m and
    its experts ``e[m, j]`` in ascending order, ``w[m, j] down(silu(g) * u)`` with ``[g, u] =
    gate_up(x_m)``, each product :func:`matmul`'s."""
    y = torch.zeros(x.shape, dtype=dtype)
    for m in range(x.shape[0]):
        for j in e[m].argsort().tolist():
            ex = int(e[m, j])
            h = matmul(x[m : m + 1], gate_up[ex], dtype)
            gate, up = h.chunk(2, -1)
            y[m] += float(w[m, j]) * matmul(torch.nn.functional.silu(gate) * up, down[ex], dtype)[0]
    return y
