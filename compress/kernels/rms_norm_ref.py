"""RMSNorm in PyTorch, the reference of ``compress::rms_norm`` (``cpu_ops.cpp``)::

x_hat = x / sqrt(mean(x^2) + eps)                         (fp32)
offset 0 (Llama):  y = w * round(x_hat)                   (round: to x's dtype)
offset 1 (Gemma):  y = round(x_hat * (1 + w))             (the product in fp32)
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
    xhat = F.rms_norm(x.float(), weight.shape, eps=eps)
    if offset:
        return (xhat * (offset + weight.float())).to(x.dtype)
    return weight * xhat.to(x.dtype)
