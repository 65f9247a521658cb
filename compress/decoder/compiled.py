"""A static-shape decode step for ``torch.compile`` (gpt-fast's recipe): the fast CPU decode path.

The step is the model's own forward (``compress.decoder.model``) over a static fp16 or full
cache (``compress.decoder.kv.fp16``): K and V preallocated per layer, each step writes slot
``pos`` (a tensor, so nothing recompiles between tokens) and attends over all ``max_len``
slots with the unwritten ones and the left padding masked. The linears are swapped, in a
copy of the module tree that shares every tensor, for compile-friendly forms of the same
kernels (:func:`static_linear`): the prepared int4pack tensors, the K-packed planes' GEMV, the
W4A8 kernel (an opaque op, ``compress::w4a8_linear``), or the layer's own forward outside the graph;
quantized experts whose layers all take the W4A8 kernel run as one op in the graph
(``compress::w4a8_experts``), others outside it.

Dynamo's guards on the model's ~300 weight tensors cost about as much as the attention; they
are dropped (``skip_guard_on_all_nn_modules_unsafe``), which is safe because a
:class:`StaticDecoder` compiles its own code object for its one model. Guards on the inputs
(the token, the position, the cache tensors) stay. For the same reason inductor's size
asserts on the inputs are dropped (``size_asserts``): the wrapper checked every weight tensor
on every call. A sparse layer's experts enter the graph as six stacked tensors
(``w4a8_cpu.Experts``), not six per expert: a Python list of hundreds of tensors per call was
most of the OLMoE-shaped step's overhead.

A compile failure (no C++ compiler, an inductor bug) falls back to the same step uncompiled, with
a warning. With ``COMPRESS_STRICT_COMPILE=1`` (the test suite sets it) the failure is an error
instead, so that a test of the compiled path cannot pass on the eager one; ``compiled_calls``
counts the steps the compiled graph ran.
"""

import copy
import os
import types
import warnings

import torch
from torch import nn

from compress.decoder.kv import FP16Cache
from compress.decoder.model import Cast, Parallel
from compress.errors import CompressError
from compress.kernels import cpu, w4a8_cpu
from compress.kernels.cpu import Eager, Int4PackLinear, KPlanesLinear
from compress.layers import QuantLinear

# "1": a compile failure raises (the test suite) instead of falling back to the eager step
STRICT_ENV = "COMPRESS_STRICT_COMPILE"


def static_linear(layer: nn.Module, dtype: torch.dtype, batch: int) -> nn.Module:
    """A compile-friendly form of ``layer`` for inputs of ``dtype`` with ``batch`` rows, computing the same."""

    if isinstance(layer, nn.Linear):
        return layer
    if isinstance(layer, Cast):
        return Cast(static_linear(layer.layer, layer.dtype, batch), layer.dtype)
    if isinstance(layer, Parallel):
        return Parallel([static_linear(p, dtype, batch) for p in layer.parts])
    if isinstance(layer, QuantLinear) and layer.scales.device.type == "cpu":
        probe = torch.empty(batch, layer.in_features, dtype=dtype)
        path = cpu.cpu_path(probe, layer)
        if path == "w4a8" and w4a8_cpu.path() != "ref":
            return w4a8_cpu.W4A8Linear(layer)
        if path == "int4pack":
            return Int4PackLinear(layer, dtype)
        if path == "kplanes-gemv":
            return KPlanesLinear(layer, cpu.gemv_unroll(layer, batch))
    return Eager(layer)


def with_static_linears(module: nn.Module, dtype: torch.dtype, batch: int) -> nn.Module:
    """A copy of ``module``'s tree (sharing every parameter and buffer) whose quantized linears are
    their :func:`static_linear` forms; modules without such a descendant are shared as they are."""
    if getattr(module, "graph_break", False):  # quantized experts
        fused = module.w4a8(torch.empty(batch, 1, dtype=dtype))
        return w4a8_cpu.W4A8Experts(fused) if fused else module  # in the graph, else eager
    if isinstance(module, (Cast, Parallel)) or (
        hasattr(module, "in_features") and not isinstance(module, nn.Linear)
    ):
        return static_linear(module, dtype, batch)
    children = {
        name: with_static_linears(child, dtype, batch) for name, child in module._modules.items()
    }
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    twin = copy.copy(module)
    twin._modules = children
    return twin


class StaticDecoder(nn.Module):
    """``step(idx [B, 1], cache, start)`` for :func:`generate`, compiled, over an fp16 or full cache."""

    def __init__(self, model, batch: int):
        super().__init__()
        if model.device.type != "cpu":
            raise CompressError(
                "the static compiled decode step is for the CPU; on CUDA the Triton kernels "
                "already fuse the work, decode without --compile."
            )
        self.batch = batch
        self.compiled_calls = 0  # steps the compiled graph ran (not the eager fallback)
        self.model = with_static_linears(model, model.dtype, batch)
        # a code object of its own, so dynamo's cache (and the dropped weight guards) serve this model only
        fwd = type(self).forward
        own = types.FunctionType(
            fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__
        )
        whole = not any(
            isinstance(m, Eager) or getattr(m, "graph_break", False) for m in self.modules()
        )  # else graph breaks around those layers (and quantized experts)
        try:
            # the guards on modules are dropped only for one whole graph: after a graph break
            # the resumed frames of one layer's code would serve every layer with its weights
            guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            options = {"size_asserts": False, **(guards if whole else {})}
            self.step = torch.compile(
                types.MethodType(own, self), dynamic=False, fullgraph=whole, options=options
            )
        except Exception as e:  # no compiler, unsupported platform
            self.eager(e)

    def eager(self, error: Exception) -> None:
        """Run the step uncompiled from now on (it computes the same); under
        ``COMPRESS_STRICT_COMPILE=1``, raise instead."""
        if os.environ.get(STRICT_ENV, "").strip() == "1":
            raise RuntimeError(
                f"torch.compile of the decode step failed ({type(error).__name__}: {error}); "
                f"{STRICT_ENV}=1 makes this an error instead of an eager fallback."
            ) from error
        warnings.warn(
            f"torch.compile of the decode step failed ({type(error).__name__}: {error}); "
            f"decoding with the same step uncompiled, which is slower."
        )
        self.step = self.forward

    def __call__(self, idx, cache: FP16Cache, start=None):
        if not (isinstance(cache, FP16Cache) and cache.static) or idx.shape != (self.batch, 1):
            raise CompressError(
                f"the compiled decode step takes one token per row of a batch of {self.batch} "
                f"and a static fp16 or full cache; got ids {tuple(idx.shape)} and "
                f"{type(cache).__name__}."
            )
        L = cache.length
        if L >= cache.max_len:
            raise CompressError(f"KV cache full: it holds {L} tokens (max_len={cache.max_len}).")
        start = torch.zeros(self.batch, dtype=torch.long) if start is None else start
        args = (idx, cache, torch.tensor([L]), start)
        try:
            out = self.step(*args)
        except Exception as e:  # a compile error: inductor bug, no C++ compiler
            if self.step == self.forward:
                raise
            self.eager(e)
            out = self.step(*args)  # rewrites the same cache slot
        if (
            self.step != self.forward
        ):  # the compiled graph does not count the token; eager append did
            cache.mark(L + 1)
            self.compiled_calls += 1
        return out

    def forward(self, idx, cache, pos, start):
        return self.model(idx, cache, pos, start)
