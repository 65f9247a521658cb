"""The C++ CPU kernels (``packkv_cpu.cpp``, ``packkv_order.cpp``, ``kivi_cpu.cpp``,
``w4a8_cpu.cpp``, ``paged_attn_cpu.cpp``, ``skinny_cpu.cpp``): one library, built on first use;
and the torch operators over them (``cpu_ops.cpp``), a second library.

``torch.utils.cpp_extension.load`` compiles them into torch's extension directory, where later
processes find the library built; it is built for the CPU's widest instruction set that the
kernels use (AVX-512 or AVX2, torch's ``get_cpu_capability()``), else as portable C++ (the W4A8
and skinny kernels compile their AVX2 and AVX-512 paths with function target attributes whatever
the flags, and pick one at run time from the CPU's features), with
OpenMP threads (``torch.get_num_threads()`` per call) where the compiler has them. The kernels'
sources include no torch header, so their build takes seconds, and their functions are called
through ``ctypes`` (:func:`library`). The operators include torch's headers and register with
its dispatcher (:func:`ops`), so that a compiled decode step calls the kernel with no Python in
between. Nothing is compiled at install. If the kernels cannot be built (no C++ compiler, no
ninja, a compile error) :func:`library` warns once with the reason and returns None, and
``compress.kernels`` runs the PyTorch references; if only the operators cannot, the kernel is
called through ``ctypes``.
"""

import contextlib
import ctypes
import fcntl
import os
import shutil
import warnings
from pathlib import Path

import torch

from compress.errors import CompressError

# the C++ sources: the repository's top-level kernels/ (a checkout, an editable install), or the
# copy a wheel carries as compress/kernels/csrc (setup.py's build step)
_PACKAGED = Path(__file__).resolve().parent / "csrc"
CSRC = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "kernels"
SOURCES = [
    CSRC / f
    for f in (
        "packkv_cpu.cpp",
        "packkv_order.cpp",
        "kivi_cpu.cpp",
        "w4a8_cpu.cpp",
        "paged_attn_cpu.cpp",
        "skinny_cpu.cpp",
    )
]
# torch operators (they include torch's headers), with the kernels they call
OP_SOURCES = [
    CSRC / f for f in ("cpu_ops.cpp", "w4a8_cpu.cpp", "paged_attn_cpu.cpp", "skinny_cpu.cpp")
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
    "w4a8_gemm": [P, P, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT, INT],
    "w4a8_linear": [P, P, P, P, P, P, P, P, I64, I64, I64, I64, INT, INT, INT, INT],
    "w4a8_experts": [
        P,
        P,
        P,
        *[I64] * 4,
        P,
        P,
        P,
        I64,
        INT,
        INT,
        P,
        P,
        P,
        I64,
        INT,
        INT,
        P,
        INT,
        INT,
    ],
    "paged_attention": [P, P, P, P, *[I64] * 4, P, P, *[I64] * 7, ctypes.c_float, P, INT, INT],
    "skinny_linear": [P, P, P, P, I64, I64, I64, INT, INT],
}
RESTYPES = {"w4a8_caps": INT, "skinny_caps": INT}  # functions returning a value (others: void)
_LIB: dict = {}  # "lib": the loaded library, or None once a build failed


class BuildError(RuntimeError):
    """The library could not be built; the message names the missing piece."""


def _compile(name: str, sources: list[Path], capability: str | None = None) -> str:
    """Compile (or find compiled) ``sources`` into a shared library for ``capability`` (default:
    torch's ``get_cpu_capability()``; AVX512, AVX2, or anything else for portable C++); its
    path."""
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
        full = name + (f"_{isa.lower()}" if isa else "") + ("" if omp else "_1t")
        try:
            with build_lock(Path(cpp_extension._get_build_directory(full, verbose=False))):
                return cpp_extension.load(
                    full,
                    [str(s) for s in sources],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"] * omp,
                    is_python_module=False,
                )
        except Exception as e:
            first = first or e
    raise first


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """One build of an extension at a time across processes, under an ``flock`` that the OS
    releases when its holder dies. torch's own lock (``build_dir/lock``, a plain file that a
    waiting process polls) outlives a killed build and would keep every later process waiting
    forever; under this lock no live build of ours holds it, so one found is stale and removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _build(capability: str | None = None) -> ctypes.CDLL:
    """The kernels' library (:func:`_compile`), loaded, its functions typed."""
    lib = ctypes.CDLL(_compile("compress_cpu_kernels", SOURCES, capability))
    for fn, args in SIGNATURES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, None
    for fn, res in RESTYPES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = [], res
    return lib


def _warn(what: str, e: Exception, instead: str) -> None:
    reason = " ".join(str(e).split())
    reason = reason if len(reason) <= 400 else reason[:400] + " ..."
    warnings.warn(
        f"{what} could not be built ({type(e).__name__}: {reason}); {instead}. "
        f"Set COMPRESS_KERNELS=ref to skip the build.",
        RuntimeWarning,
        stacklevel=4,
    )


def ops() -> bool:
    """Whether the C++ torch operators (``cpu_ops.cpp``: ``compress::w4a8_linear``,
    ``compress::w4a8_experts``, ``compress::skinny_linear``, ``compress::cache_attention``) are
    loaded; built on the first
    call (their sources include torch's headers, which makes this the slow build: BENCHMARKS.md),
    False (after one warning) if they cannot be."""
    if "ops" not in _LIB:
        _LIB["ops"] = False
        if library() is not None:  # a machine that builds nothing warns once, there
            try:
                torch.ops.load_library(_compile("compress_cpu_ops", OP_SOURCES))
                _LIB["ops"] = True
            except Exception as e:
                _warn(
                    "the C++ torch operators",
                    e,
                    "the W4A8 kernel is called through ctypes, and the compiled step's "
                    "attention converts its cache to fp32",
                )
    return _LIB["ops"]


_CAPS: dict = {}  # (id of the loaded library, caps function) -> its value


def runnable(caps_fn: str, caps: dict[str, int]) -> list[str]:
    """A kernel's paths this machine runs: each name of ``caps`` (fastest first) whose bit is set
    in the library's ``caps_fn()``, then ``ref`` (the PyTorch path, always)."""
    lib = library()
    if lib is None:
        bits = 0
    elif (bits := _CAPS.get((id(lib), caps_fn))) is None:
        bits = _CAPS[id(lib), caps_fn] = getattr(lib, caps_fn)()
    return [p for p, bit in caps.items() if bits & bit] + ["ref"]


def chosen(variable: str, have: list[str], what: str) -> str:
    """The path calls take: environment ``variable`` if set (one of ``have``, else a
    ``CompressError`` naming them), else the fastest, ``have[0]``."""
    forced = os.environ.get(variable)
    if forced and forced not in have:
        raise CompressError(
            f"{variable}={forced}: this machine runs the {what} paths {', '.join(have)}; "
            f"set one of them, or unset it for the fastest."
        )
    return forced or have[0]


_OPS: dict = {}  # name -> the operator (torch.ops.compress.NAME), once defined
_FALLBACK: list = []  # the Python library of the ctypes fallbacks, kept alive


def operator(name: str, schema: str, ctypes_impl, fake):
    """``torch.ops.compress.NAME`` (``schema``), defined on the first call: the C++ operator where
    :func:`ops` builds it, else ``ctypes_impl`` registered under the same schema; ``fake`` gives
    its output's shape, so it is an opaque op inside a ``torch.compile`` graph either way."""
    if name not in _OPS:
        if not ops():
            if not _FALLBACK:
                _FALLBACK.append(torch.library.Library("compress", "FRAGMENT"))
            _FALLBACK[0].define(schema)
            _FALLBACK[0].impl(name, ctypes_impl, "CPU")
        torch.library.register_fake(f"compress::{name}")(fake)
        _OPS[name] = getattr(torch.ops.compress, name)
    return _OPS[name]


def library() -> ctypes.CDLL | None:
    """The compiled library, built on the first call; None (after one warning) if it cannot be."""
    if "lib" not in _LIB:
        try:
            _LIB["lib"] = _build()
        except Exception as e:  # no compiler, no ninja, a compile or load error: never a crash
            _LIB["lib"] = None
            _warn(
                "the C++ CPU kernels",
                e,
                "PackKV and KIVI attention run the PyTorch path instead (it dequantizes the "
                "history into scratch each step: slower at long contexts), and the quantized "
                "linears their exact PyTorch paths",
            )
    return _LIB["lib"]


def simd() -> int:
    """Vector bits of the loaded library's build: 512 (AVX-512), 256 (AVX2), 0 (portable)."""
    lib = library()
    return lib.cpu_simd_bits() if lib is not None else 0
