"""PackKV attention products on the CPU, decoding the packed history one 16-token pack at a time.

Same format and signatures as ``packkv_ref.qk`` / ``packkv_ref.pv`` (the format is described
there). For each row ``bh`` and pack row ``r`` (slots ``s = 16 r .. 16 r + 15``) the C++ kernel
in ``packkv_cpu.cpp`` cuts each channel's 16 codes ``code = pmin[c] + rest[s, c]`` out of the
bit stream into a 16 x D fp32 tile that stays in the L1 cache, and multiplies it at once::

    x_hat[s, c]   = tmin[s] + tstep[s] * (pmin[c] + rest[s, c])     as packkv_ref.values
    scores[m, s]  = sum_c q[m, c] x_hat[s, c]
    out[m, c]    += sum_s p[m, s] x_hat[s, c]

so no copy of the history is ever made. Forming ``x_hat`` per slot keeps the reference's
rounding; the factored ``tmin[s] sum_c q[m, c] + tstep[s] sum_c q[m, c] code[s, c]`` was no
faster (decoding dominates) and lost digits to cancellation in pv. Rows and ranges of pack rows
are spread over ``torch.get_num_threads()`` OpenMP threads; all arithmetic is fp32
(``python eval/bench/bench_packkv_cpu.py`` times the kernels).

The kernel is part of the library that ``native.py`` builds on first use; where it cannot be
built ``compress.kernels`` runs the PyTorch reference instead.
"""

import torch

from compress.errors import CompressError
from compress.kernels.native import library
from compress.kernels.packkv_ref import PACK, Packed


def _call(fn, x: torch.Tensor, packed: Packed, shape: tuple, out: torch.Tensor | None):
    """Runs ``fn`` on contiguous fp32 ``x``, into ``out`` (or a new tensor) of ``shape``."""
    x = x.float().contiguous()
    direct = (
        out is not None
        and out.dtype == torch.float32
        and out.is_contiguous()
        and tuple(out.shape) == shape
    )
    res = out if direct else torch.empty(shape, dtype=torch.float32)
    parts = [
        t.contiguous() for t in (packed.tmin, packed.lstep, packed.pmeta, packed.poff, packed.data)
    ]
    fn(
        x.data_ptr(),
        res.data_ptr(),
        shape[0],
        x.shape[1],
        packed.dim,
        *(t.data_ptr() for t in parts),
        packed.data.numel(),
        packed.n,
        packed.tmin.shape[1],
        packed.pmeta.shape[-1],
        packed.mbits,
        packed.fbits,
        torch.get_num_threads(),
    )
    if out is not None and not direct:
        return out.copy_(res)
    return res


def _check(x: torch.Tensor, packed: Packed, name: str, inner: int) -> None:
    """The shapes the kernel indexes by: it reads memory, so a mismatch must not reach it."""
    if (
        x.dim() != 3
        or x.shape[0] != packed.tmin.shape[0]
        or x.shape[2] != inner
        or packed.n % PACK
        or x.device.type != "cpu"
    ):
        raise CompressError(
            f"PackKV {name}: got {tuple(x.shape)} on {x.device} for a packed "
            f"tensor of {packed.tmin.shape[0]} rows, {packed.n} slots of "
            f"{packed.dim} channels; expected a CPU tensor [rows, M, {inner}]."
        )


def order_greedy(codes: torch.Tensor, pack: int = PACK) -> torch.Tensor:
    """``packkv_ref.order_greedy`` (the rule is there) in C++ (``packkv_order.cpp``): block rows
    spread over ``torch.get_num_threads()`` threads."""
    N, T, C = codes.shape
    wide = codes.dtype != torch.uint8 and (int(codes.max()) > 255 or int(codes.min()) < 0)
    if codes.device.type != "cpu" or wide or T % pack:
        raise CompressError(
            f"PackKV order: codes {tuple(codes.shape)} on {codes.device} must be CPU codes "
            f"0..255 of blocks of a multiple of {pack} tokens."
        )
    x = codes.to(torch.uint8).contiguous()
    perm = torch.empty(N, T, dtype=torch.long)
    library().packkv_order_greedy(
        x.data_ptr(), perm.data_ptr(), N, T, C, pack, torch.get_num_threads()
    )
    return perm


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` fp32, decoding ``k`` pack by pack."""
    _check(q, k, "qk", k.dim)
    return _call(library().packkv_qk, q, k, (q.shape[0], q.shape[1], k.n), out)


def pv(p: torch.Tensor, v: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` fp32, decoding ``v`` pack by pack."""
    _check(p, v, "pv", v.n)
    return _call(library().packkv_pv, p, v, (p.shape[0], p.shape[1], v.dim), out)
