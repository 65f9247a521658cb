"""The buffer that prefill paths dequantize a layer's ``W_hat^T`` into before a dense matmul.

One buffer per dtype, the size of the largest layer seen, shared by all layers: a fresh one per
call costs more in page faults than the dequantization itself (``python -m timeit -s "import
torch; b = torch.empty(2**24)" "torch.empty(2**24).fill_(1)"`` against ``"b.fill_(1)"``).
"""

import torch

_BUFFERS: dict[torch.dtype, torch.Tensor] = {}


def workspace(dtype: torch.dtype, k: int, n: int) -> torch.Tensor:
    """A ``[k, n]`` view of the shared buffer of ``dtype``."""
    buf = _BUFFERS.get(dtype)
    if buf is None or buf.numel() < k * n:
        buf = _BUFFERS[dtype] = torch.empty(k * n, dtype=dtype)
    return buf[: k * n].view(k, n)
