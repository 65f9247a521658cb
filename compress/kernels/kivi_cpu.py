"""KIVI attention products on the CPU, reading the codes in place (``kivi_cpu.cpp``).

Same layout and signatures as ``kivi_ref.qk`` / ``kivi_ref.pv`` (the layout is described
there), fp32. Per token the C++ kernel shifts eight channels' codes out of a splat of their
int32 word, forms ``K_hat`` or ``V_hat`` of those channels in registers and multiplies::

    scores[m, t] = sum_c q[m, c] (kz[t // G, c] + ks[t // G, c] code[t, c])
    out[m, c]   += p[m, t] (vz[t, c // G] + vs[t, c // G] code[t, c])

so no dequantized copy of the history is made. Rows and ranges of groups (qk) or tokens (pv)
are spread over ``torch.get_num_threads()`` OpenMP threads. The V groups must hold whole
vectors of 8 channels (:func:`supports`). Part of the library ``native.py`` builds.
"""

import torch

from compress.errors import CompressError
from compress.kernels.native import library


def supports(x: torch.Tensor, zero: torch.Tensor, head_dim: int, which: str) -> bool:
    """fp32 inputs, and for V, groups of whole 8-channel vectors."""
    if x.dtype != torch.float32 or head_dim % 8:
        return False
    return which == "k" or (head_dim // zero.shape[2]) % 8 == 0


def _run(fn, x, words, zero, scale, n: int, bits: int, inner: int, group: int, out_dim: int):
    """``fn`` on fp32 ``x [BH, M, inner]`` -> a new ``[BH, M, out_dim]``, after the checks that
    keep the kernel inside its tensors."""
    BH, cap, W = words.shape
    D = W * 32 // bits
    if (
        x.dim() != 3
        or x.shape[0] != BH
        or x.shape[2] != inner
        or not 0 <= n <= cap
        or zero.shape != scale.shape
        or zero.shape[0] != BH
    ):
        raise CompressError(
            f"KIVI products: input {tuple(x.shape)} does not fit codes "
            f"{tuple(words.shape)} of {bits} bits, zero points "
            f"{tuple(zero.shape)} and {n} tokens in use."
        )
    x = x.contiguous()
    out = torch.empty(BH, x.shape[1], out_dim, dtype=torch.float32)
    words, zero, scale = (t.contiguous() for t in (words, zero, scale))
    fn(
        x.data_ptr(),
        out.data_ptr(),
        BH,
        x.shape[1],
        D,
        words.data_ptr(),
        zero.data_ptr(),
        scale.data_ptr(),
        n,
        cap,
        group,
        bits,
        torch.get_num_threads(),
    )
    return out


def qk(q: torch.Tensor, words, zero, scale, n: int, bits: int) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ K_hat^T -> [BH, M, n]`` fp32."""
    D = words.shape[2] * 32 // bits
    if (
        zero.shape[2] != D
        or words.shape[1] % zero.shape[1]
        or n % (words.shape[1] // zero.shape[1])
    ):
        raise CompressError(
            f"KIVI K zero points {tuple(zero.shape)} are not per (token group, "
            f"channel) of {D} channels, or {n} tokens are not whole groups."
        )
    return _run(
        library().kivi_qk, q, words, zero, scale, n, bits, D, words.shape[1] // zero.shape[1], n
    )


def pv(p: torch.Tensor, words, zero, scale, n: int, bits: int) -> torch.Tensor:
    """``p [BH, M, n] @ V_hat -> [BH, M, D]`` fp32."""
    D = words.shape[2] * 32 // bits
    if zero.shape[1] != words.shape[1] or D % zero.shape[2]:
        raise CompressError(
            f"KIVI V zero points {tuple(zero.shape)} are not per (token, "
            f"channel group) of {D} channels."
        )
    return _run(library().kivi_pv, p, words, zero, scale, n, bits, n, D // zero.shape[2], D)
