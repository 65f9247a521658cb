"""Kernels: fused dequant-matmul and compressed-KV attention, each beside its reference.

``quant_matmul(x, layer)`` is the one entry point the model code calls; it
picks the fastest path for the layer's format and ``x``'s device: Triton on
CUDA (``dequant_matmul.py``), the measured-fastest CPU path otherwise
(``cpu.py``). ``COMPRESS_KERNELS=ref`` forces the reference (dequantize, then
matmul) for debugging; ``COMPRESS_KERNELS=eager`` runs the CPU paths without
``torch.compile``.
"""

import os

import torch

from compress.kernels.layout import check_inputs


def quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for a ``QuantLinear``, in ``x``'s dtype."""
    if os.environ.get("COMPRESS_KERNELS") == "ref" or (x.requires_grad and torch.is_grad_enabled()):
        return x @ layer.dequantize(x.dtype).t()  # the kernels have no backward
    check_inputs(x, layer)
    if x.shape[0] == 0:
        return x.new_empty(0, layer.out_features)
    if x.is_cuda:
        from compress.kernels.dequant_matmul import triton_quant_matmul  # imports triton only when needed

        return triton_quant_matmul(x, layer)
    from compress.kernels.cpu import cpu_quant_matmul

    return cpu_quant_matmul(x, layer)
