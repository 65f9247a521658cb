"""A static-shape decode step for ``torch.compile`` (gpt-fast's recipe): the fast CPU decode path.

For a 135M model on 2 cores, eager decoding spends more time dispatching ~1,000 small ops
per token than multiplying. Compiling removes that, but only if every decode step has the
same shapes, so that one graph serves every token:

    cache         the fp16 (or full) cache: K and V per layer, [B, Hkv, max_len, D] each,
                  preallocated. The prompt is prefilled eagerly through ``cache.append``/``attend``.
    step(idx [B, 1], pos [1], start [B])
                  writes the token's K, V into slot ``pos`` of every layer (index_put, done in
                  place by inductor), then attends over all ``max_len`` slots with the slots
                  ``> pos`` (not yet written) and ``< start[b]`` (left padding) masked:

                  attn = softmax(q K^T / sqrt(D) + mask) V,   mask = -inf where hidden

Only ``pos`` changes between tokens, and it is a tensor, so nothing recompiles. The linears are
swapped for compile-friendly forms of the same kernels (:func:`static_linear`): the prepared
int4pack tensors, the K-packed planes' GEMV, or the layer's own forward outside the graph.

Dynamo's guards on the model's ~300 weight tensors cost ~1 ms a call, as much as the
attention; they are dropped (``skip_guard_on_all_nn_modules_unsafe``), which is safe because a
:class:`StaticDecoder` compiles its own code object for its one model. Guards on the inputs
(the token, the position, the cache tensors) stay.
"""

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from compress.decoder.kv_cache import FP16Cache
from compress.decoder.model import Cast, Parallel, apply_rope, head_dim_of
from compress.errors import CompressError
from compress.kernels.cpu import Eager, Int4PackLinear, KPlanesLinear


def static_linear(layer: nn.Module, dtype: torch.dtype, batch: int) -> nn.Module:
    """A compile-friendly form of ``layer`` for inputs of ``dtype`` with ``batch`` rows, computing the same."""
    from compress.kernels import cpu
    from compress.formats import QuantLinear

    if isinstance(layer, nn.Linear):
        return layer
    if isinstance(layer, Cast):
        return Cast(static_linear(layer.layer, layer.dtype, batch), layer.dtype)
    if isinstance(layer, Parallel):
        return Parallel([static_linear(p, dtype, batch) for p in layer.parts])
    if isinstance(layer, QuantLinear) and layer.scales.device.type == "cpu":
        probe = torch.empty(batch, layer.in_features, dtype=dtype)
        path = cpu.cpu_path(probe, layer)
        if path == "int4pack":
            return Int4PackLinear(layer, dtype)
        if path == "kplanes-gemv":
            return KPlanesLinear(layer, cpu.gemv_unroll(layer, batch))
    return Eager(layer)


class StaticDecoder(nn.Module):
    """``step(idx [B, 1], cache, start)`` for :func:`generate`, compiled, over an fp16 or full cache."""

    def __init__(self, model, batch: int):
        super().__init__()
        if model.lm_head.weight.device.type != "cpu":
            raise CompressError("the static compiled decode step is for the CPU; on CUDA the Triton kernels "
                                "already fuse the work, decode without --compile.")
        self.model, self.batch = model, batch
        c = model.config
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, head_dim_of(c)
        self.qkv, self.o, self.gate_up, self.down = (nn.ModuleList(
            static_linear(getattr(getattr(b, part), name), model.dtype, batch) for b in model.model.layers)
            for part, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                               ("mlp", "down_proj")))
        # a code object of its own, so dynamo's cache (and the dropped weight guards) serve this model only
        fwd = type(self).forward
        own = types.FunctionType(fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__)
        whole = not any(isinstance(m, Eager) for m in self.modules())  # else graph breaks around those layers
        try:
            self.step = torch.compile(types.MethodType(own, self), dynamic=False, fullgraph=whole, options={
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        except Exception as e:  # no compiler, unsupported platform
            self.eager(e)

    def eager(self, error: Exception) -> None:
        """Run the step uncompiled from now on (it computes the same, and is still faster than the model's)."""
        warnings.warn(f"torch.compile of the decode step failed ({type(error).__name__}: {error}); "
                      f"decoding with the same step uncompiled, which is slower.")
        self.step = self.forward

    def __call__(self, idx, cache: FP16Cache, start=None):
        if not isinstance(cache, FP16Cache) or idx.shape != (self.batch, 1):
            raise CompressError(f"the compiled decode step takes one token per row of a batch of {self.batch} "
                                f"and an fp16 or full cache; got ids {tuple(idx.shape)} and {type(cache).__name__}.")
        L = cache.length
        if L >= cache.max_len:
            raise CompressError(f"KV cache full: it holds {L} tokens (max_len={cache.max_len}).")
        start = torch.zeros(self.batch, dtype=torch.long) if start is None else start
        args = (idx, torch.tensor([L]), start, cache.k, cache.v)
        try:
            out = self.step(*args)
        except Exception as e:  # a compile error: inductor bug, no C++ compiler
            if self.step == self.forward:
                raise
            self.eager(e)
            out = self.step(*args)  # rewrites the same cache slot
        cache.lens = [L + 1] * cache.n_layers
        return out

    def forward(self, idx, pos, start, ks, vs):
        m, B, H, Hkv, D = self.model, self.batch, self.n_heads, self.n_kv_heads, self.head_dim
        angles = ((pos - start).float()[:, None] * m.inv_freq).repeat(1, 2)[:, None, None]  # [B, 1, 1, D]
        cos, sin = angles.cos().to(m.dtype), angles.sin().to(m.dtype)
        slots = torch.arange(ks[0].shape[2], device=idx.device)
        hide = (slots > pos)[None] | (slots[None] < start[:, None])  # [B, max_len]
        x = m.model.embed_tokens(idx)
        for i, block in enumerate(m.model.layers):
            heads = self.qkv[i](block.input_layernorm(x)).view(B, 1, H + 2 * Hkv, D).transpose(1, 2)
            qk = apply_rope(heads[:, :H + Hkv], cos, sin)
            ks[i][:, :, pos] = qk[:, H:].to(ks[i].dtype)
            vs[i][:, :, pos] = heads[:, H + Hkv:].to(vs[i].dtype)
            q = qk[:, :H].float().reshape(B, Hkv, H // Hkv, D) * D ** -0.5
            s = (q @ ks[i].float().transpose(-1, -2)).masked_fill(hide[:, None, None], float("-inf"))
            y = (s.softmax(-1) @ vs[i].float()).reshape(B, 1, H * D).to(x.dtype)
            h = x + self.o[i](y)
            gate, up = self.gate_up[i](block.post_attention_layernorm(h)).chunk(2, dim=-1)
            x = h + self.down[i](F.silu(gate) * up)
        return m.lm_head(m.model.norm(x))
