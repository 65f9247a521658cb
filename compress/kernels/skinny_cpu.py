"""Skinny fp32 matmuls on the CPU: ``y = x W^T + b`` for a few rows (``skinny_cpu.cpp``), the
products of speculative verification (γ + 1 tokens) and of small batches.

    y[m, n] = sum_k x[m, k] W[n, k] + b[n]        x [M, K], W [N, K] (nn.Linear's layout)

in fp32. A pass takes R rows of ``W`` (R = 8, 6, 4, 3 for M <= 2, 4, 6, 8) and all M rows of
``x`` into R x M vector accumulators, so each weight vector loaded feeds M fused multiply-adds
and ``W`` is read from memory once for all M rows (a software prefetch runs 512 bytes ahead in
each row); each accumulator is summed across its lanes at the end. Weight rows are spread over
``torch.get_num_threads()`` OpenMP threads; M > 8 runs in chunks of 8. The paths: ``avx512``
(16 lanes, masked tail), ``avx2`` (8 lanes, scalar tail), ``portable`` (C++ loops) and ``ref``
(``F.linear``). The fastest the CPU runs is chosen at run time; ``COMPRESS_SKINNY=avx512|avx2|
portable|ref`` forces one.

:func:`chosen_path` routes fp32 CPU products of 2 to ``MAX_M`` rows here when a SIMD path runs (not
while tracing for ``torch.compile``, nor with autograd); one row, and more than ``MAX_M``, stay
with ATen's ``F.linear``, which reads the weight once at M = 1 too and blocks large M better
(``python eval/bench/bench_linear.py --skinny``; figures in BENCHMARKS.md).
"""

import os

import torch
import torch.nn.functional as F

import compress.kernels.native as native

MAX_M = 8
PATHS = {"portable": 0, "avx2": 1, "avx512": 2}  # the C++ paths, by their code in skinny_cpu.cpp
CAPS = {"avx512": 4, "avx2": 2, "portable": 1}  # their bit in skinny_caps(), fastest first


def available() -> list[str]:
    """The paths this machine runs, fastest first (``ref`` always)."""
    return native.runnable("skinny_caps", CAPS)


def path() -> str:
    """The path calls take: ``COMPRESS_SKINNY`` if set (one this CPU runs), else the fastest."""
    return native.chosen("COMPRESS_SKINNY", available(), "skinny matmul")


def chosen_path(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The SIMD path ``x @ weight^T`` takes through this kernel, or None where it stays with
    ``F.linear`` (module docstring)."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not 2 <= x.numel() // max(x.shape[-1], 1) <= MAX_M
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or os.environ.get("COMPRESS_KERNELS") in ("ref", "eager")
    ):
        return None
    which = path()
    return which if which in ("avx512", "avx2") else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, which: str | None = None):
    """``y [..., N] = x [..., K] @ weight [N, K]^T + bias`` in fp32 through path ``which``
    (default :func:`path`): the operator :func:`op`, or ``F.linear`` for ``ref``."""
    which = which or path()
    if which == "ref":
        return F.linear(x, weight, bias)
    return op()(x, weight.contiguous(), bias, PATHS[which])


def _ctypes_op(x, w, b, which):
    lib = native.library()
    xc = x.contiguous()
    y = torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.float32)
    b = None if b is None else b.contiguous()
    lib.skinny_linear(
        xc.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
        xc.numel() // max(x.shape[-1], 1), x.shape[-1], w.shape[0], which, torch.get_num_threads(),
    )  # fmt: skip
    return y


def _fake(x, w, b, which):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def op():
    """``torch.ops.compress.skinny_linear`` (``native.operator``): the C++ operator where it
    builds, else the same kernel through ``ctypes``."""
    return native.operator(
        "skinny_linear", "skinny_linear(Tensor x, Tensor w, Tensor? b, int path) -> Tensor",
        _ctypes_op, _fake,
    )  # fmt: skip
