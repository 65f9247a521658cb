"""The C++ CPU kernels (``packkv_cpu.cpp``, ``packkv_order.cpp``, ``kivi_cpu.cpp``,
``w4a8_cpu.cpp``, ``paged_attn_cpu.cpp``): one library, built on first use.

``torch.utils.cpp_extension.load`` compiles them into torch's extension directory, where later
processes find the library built; it is built for the CPU's widest instruction set that the
kernels use (AVX-512 or AVX2, torch's ``get_cpu_capability()``), else as portable C++ (the W4A8
kernel compiles its AVX2 and AVX-512 VNNI paths with function target attributes whatever the
flags, and picks one at run time from the CPU's features), with
OpenMP threads (``torch.get_num_threads()`` per call) where the compiler has them. The sources
include no torch header, so a build takes seconds, and the functions are called through
``ctypes``. Nothing is compiled at install. If the library cannot be built (no C++ compiler, no
ninja, a compile error) :func:`library` warns once with the reason and returns None, and
``compress.kernels`` runs the PyTorch references.
"""

import ctypes
import os
import shutil
import warnings
from pathlib import Path

import torch

SOURCES = [
    Path(__file__).with_name(f)
    for f in (
        "packkv_cpu.cpp",
        "packkv_order.cpp",
        "kivi_cpu.cpp",
        "w4a8_cpu.cpp",
        "paged_attn_cpu.cpp",
    )
]
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {  # argument types of the exported functions (all return void)
    "packkv_qk": [P, P, I64, I64, I64, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT],
    "packkv_pv": [P, P, I64, I64, I64, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT],
    "packkv_order_greedy": [P, P, I64, I64, I64, I64, INT],
    "kivi_qk": [P, P, I64, I64, I64, P, P, P, I64, I64, I64, INT, INT],
    "kivi_pv": [P, P, I64, I64, I64, P, P, P, I64, I64, I64, INT, INT],
    "w4a8_quantize": [P, P, P, P, I64, I64, I64],
    "w4a8_gemm": [P, P, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT],
    "w4a8_linear": [P, P, P, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT],
    "paged_attention": [P, P, P, P, *[I64] * 4, P, P, *[I64] * 7, ctypes.c_float, INT, INT],
}
RESTYPES = {"w4a8_caps": INT}  # functions returning a value (the others return void)
_LIB: dict = {}  # "lib": the loaded library, or None once a build failed


class BuildError(RuntimeError):
    """The library could not be built; the message names the missing piece."""


def _build(capability: str | None = None) -> ctypes.CDLL:
    """Compile (or find compiled) the library for ``capability`` (default: torch's
    ``get_cpu_capability()``; AVX512, AVX2, or anything else for portable C++) and load it."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(
            f"no C++ compiler: '{cxx}' is not on PATH (install g++ or clang, or set CXX)"
        )
    if not cpp_extension.is_ninja_available():
        raise BuildError("torch's extension builder needs ninja (pip install ninja)")
    capability = capability or torch.backends.cpu.get_cpu_capability()
    first = None
    # the CPU's widest build with OpenMP threads, then fallbacks for compilers without its
    # instructions or without OpenMP: portable C++, then portable C++ on one thread
    for isa, omp in dict.fromkeys(
        [(capability if capability in ISA_FLAGS else None, True), (None, True), (None, False)]
    ):
        flags = ["-O3", "-ffp-contract=fast"] + ISA_FLAGS.get(isa, []) + ["-fopenmp"] * omp
        name = "compress_cpu_kernels" + (f"_{isa.lower()}" if isa else "") + ("" if omp else "_1t")
        try:
            path = cpp_extension.load(
                name,
                [str(s) for s in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] * omp,
                is_python_module=False,
            )
            break
        except Exception as e:
            first = first or e
    else:
        raise first
    lib = ctypes.CDLL(path)
    for fn, args in SIGNATURES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, None
    for fn, res in RESTYPES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = [], res
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, built on the first call; None (after one warning) if it cannot be."""
    if "lib" not in _LIB:
        try:
            _LIB["lib"] = _build()
        except Exception as e:  # no compiler, no ninja, a compile or load error: never a crash
            _LIB["lib"] = None
            reason = " ".join(str(e).split())
            reason = reason if len(reason) <= 400 else reason[:400] + " ..."
            warnings.warn(
                f"the C++ CPU kernels could not be built ({type(e).__name__}: "
                f"{reason}); PackKV and KIVI attention run the PyTorch path instead "
                f"(it dequantizes the history into scratch each step: slower at long "
                f"contexts). Set COMPRESS_KERNELS=ref to skip the build.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _LIB["lib"]


def simd() -> int:
    """Vector bits of the loaded library's build: 512 (AVX-512), 256 (AVX2), 0 (portable)."""
    lib = library()
    return lib.cpu_simd_bits() if lib is not None else 0
