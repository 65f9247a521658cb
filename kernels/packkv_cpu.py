"""PackKV attention products on the CPU, decoding the packed history one 16-token pack at a time.

Same format and signatures as ``packkv_ref.qk`` / ``packkv_ref.pv`` (the format is described
there). For each row ``bh`` and pack row ``r`` (slots ``s = 16 r .. 16 r + 15``) the C++ kernel
in ``packkv_cpu.cpp`` cuts each channel's 16 codes ``code = pmin[c] + rest[s, c]`` out of the
bit stream into a 16 x D fp32 tile that stays in the L1 cache, and multiplies it at once::

    x_hat[s, c]   = tmin[s] + tstep[s] * (pmin[c] + rest[s, c])     as packkv_ref.values
    scores[m, s]  = sum_c q[m, c] x_hat[s, c]
    out[m, c]    += sum_s p[m, s] x_hat[s, c]

so no copy of the history is ever made. Forming ``x_hat`` per slot costs the same as the
factored ``tmin[s] sum_c q[m, c] + tstep[s] sum_c q[m, c] code[s, c]`` (decoding dominates) and
keeps the error of the reference's matmul, where the factored pv lost digits to cancellation
(``python -m compress.eval.bench.bench_packkv_cpu`` times it). Rows and ranges of pack rows are
spread over ``torch.get_num_threads()`` OpenMP threads; all arithmetic is fp32.

The kernel is compiled on first use by ``torch.utils.cpp_extension.load`` into torch's
extension directory, where later processes find it built (for AVX-512 or AVX2 when the CPU
has them, else portable C++). It includes no torch header, so the build takes seconds, and the
library is called through ``ctypes``. If it cannot be built (no C++ compiler, no ninja, a
compile error) :func:`library` warns once with the reason and ``compress.kernels`` runs the
PyTorch reference instead.
"""

import ctypes
import os
import shutil
import warnings
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.kernels.packkv_ref import PACK, Packed

SOURCE = Path(__file__).with_name("packkv_cpu.cpp")
_LIB: dict = {}  # "lib": the loaded library, or None once a build failed


class BuildError(RuntimeError):
    """The kernel could not be built; the message names the missing piece."""


ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
             "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def _build(capability: str | None = None) -> ctypes.CDLL:
    """Compile (or find compiled) ``packkv_cpu.cpp`` for ``capability`` (default: torch's
    ``get_cpu_capability()``; AVX512, AVX2, or anything else for portable C++) and load it."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler: '{cxx}' is not on PATH (install g++ or clang, or "
                         f"set CXX)")
    if not cpp_extension.is_ninja_available():
        raise BuildError("torch's extension builder needs ninja (pip install ninja)")
    capability = capability or torch.backends.cpu.get_cpu_capability()
    first = None
    # the CPU's widest decoder with OpenMP threads, then fallbacks for compilers without its
    # instructions or without OpenMP: portable C++, then portable C++ on one thread
    for isa, omp in dict.fromkeys([(capability if capability in ISA_FLAGS else None, True),
                                   (None, True), (None, False)]):
        flags = ["-O3", "-ffp-contract=fast"] + ISA_FLAGS.get(isa, []) + ["-fopenmp"] * omp
        name = "compress_packkv_cpu" + (f"_{isa.lower()}" if isa else "") + ("" if omp else "_1t")
        try:
            path = cpp_extension.load(name, [str(SOURCE)], extra_cflags=flags,
                                      extra_ldflags=["-fopenmp"] * omp, is_python_module=False)
            break
        except Exception as e:
            first = first or e
    else:
        raise first
    lib = ctypes.CDLL(path)
    args = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5 \
        + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3
    for fn in (lib.packkv_qk, lib.packkv_pv):
        fn.argtypes, fn.restype = args, None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on the first call; None (after one warning) if it cannot be."""
    if "lib" not in _LIB:
        try:
            _LIB["lib"] = _build()
        except Exception as e:  # no compiler, no ninja, a compile or load error: never a crash
            _LIB["lib"] = None
            reason = " ".join(str(e).split())
            reason = reason if len(reason) <= 400 else reason[:400] + " ..."
            warnings.warn(f"PackKV's CPU kernel could not be built ({type(e).__name__}: {reason}); "
                          f"PackKV attention runs the PyTorch path instead (it unpacks the history "
                          f"into scratch each step: slower at long contexts). Set "
                          f"COMPRESS_KERNELS=ref to skip the build.", RuntimeWarning, stacklevel=3)
    return _LIB["lib"]


def simd() -> int:
    """Vector bits of the loaded kernel's decoder: 512 (AVX-512), 256 (AVX2), 0 (portable)."""
    lib = library()
    return lib.packkv_simd() if lib is not None else 0


def _call(fn, x: torch.Tensor, packed: Packed, shape: tuple, out: torch.Tensor | None):
    """Runs ``fn`` on contiguous fp32 ``x``, into ``out`` (or a new tensor) of ``shape``."""
    x = x.float().contiguous()
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() \
        and tuple(out.shape) == shape
    res = out if direct else torch.empty(shape, dtype=torch.float32)
    parts = [t.contiguous() for t in (packed.tmin, packed.lstep, packed.pmeta, packed.poff,
                                      packed.data)]
    fn(x.data_ptr(), res.data_ptr(), shape[0], x.shape[1], packed.dim,
       *(t.data_ptr() for t in parts), packed.data.numel(), packed.n, packed.tmin.shape[1],
       packed.pmeta.shape[-1], packed.mbits, packed.fbits, torch.get_num_threads())
    if out is not None and not direct:
        return out.copy_(res)
    return res


def _check(x: torch.Tensor, packed: Packed, name: str, inner: int) -> None:
    """The shapes the kernel indexes by: it reads memory, so a mismatch must not reach it."""
    if x.dim() != 3 or x.shape[0] != packed.tmin.shape[0] or x.shape[2] != inner \
            or packed.n % PACK or x.device.type != "cpu":
        raise CompressError(f"PackKV {name}: got {tuple(x.shape)} on {x.device} for a packed "
                            f"tensor of {packed.tmin.shape[0]} rows, {packed.n} slots of "
                            f"{packed.dim} channels; expected a CPU tensor [rows, M, {inner}].")


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` fp32, decoding ``k`` pack by pack."""
    _check(q, k, "qk", k.dim)
    return _call(library().packkv_qk, q, k, (q.shape[0], q.shape[1], k.n), out)


def pv(p: torch.Tensor, v: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` fp32, decoding ``v`` pack by pack."""
    _check(p, v, "pv", v.n)
    return _call(library().packkv_pv, p, v, (p.shape[0], p.shape[1], v.dim), out)
