"""Our own Llama-family transformer (llama, mistral, qwen2), in the spirit of gpt-fast's ``model.py``.

One decoder layer, with n1 = input_layernorm and n2 = post_attention_layernorm::

    h = x + o_proj(attend(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))

    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)                      (computed in fp32)
    rope(x)[p] = x * cos(p * f) + rotate_half(x) * sin(p * f),       f_i = theta^(-2i / head_dim)
    rotate_half([a, b]) = [-b, a]                                    (HF's half-split layout)

``attend`` is the KV cache's (``compress.decoder.kv_cache``): K and V are
appended after RoPE, and the cache computes causal GQA attention over what it
holds. Module names are the HF checkpoint's, so a run folder's tensors load by
name and validation errors name the tensor as it is stored. Linears are
``nn.Linear``, or the quantized layer the folder's ``quantization_config`` asks
for (``compress.checkpoint.quantized_layer``), whose forward calls the kernels.
After loading, q/k/v and gate/up are fused into ``qkv_proj`` and ``gate_up_proj``
(one matmul each: fewer calls per token). Mistral's sliding window is not
implemented: ``generate`` refuses sequences longer than the window.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from compress.checkpoint import (load_state, quantized_layer, read_config, read_tensors, read_tokenizer,
                                 swap_quantized)
from compress.errors import CompressError


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Frequencies ``f_i = theta^(-2i/d)`` [d/2], with "linear" or "llama3" scaling if asked.

    llama3: wavelengths longer than ``ctx/low_freq_factor`` are divided by ``factor``, shorter
    than ``ctx/high_freq_factor`` kept, and those between interpolated smoothly.
    """
    theta = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        ctx = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > ctx / lo, inv_freq / factor, inv_freq)
        smooth = (ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= ctx / hi) & (wavelen <= ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise CompressError(f"RoPE type '{kind}' is not supported by compress's decoder (it reads "
                        f"'default', 'linear' and 'llama3'); config.json's rope_parameters asks for it.")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]``; ``cos``, ``sin`` [B or 1, 1, T, D]."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
        dim, qkv_bias, o_bias = config.hidden_size, *attention_biases(config)
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=o_bias)
        self.qkv_proj = None  # q_proj, k_proj, v_proj fused by fuse_projections()

    def forward(self, x, cos, sin, cache, start):
        B, T, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        heads = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk = apply_rope(heads[:, :H + Hkv], cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], heads[:, H + Hkv:]
        cache.append(self.layer, k, v)
        y = cache.attend(self.layer, q, start).to(x.dtype)  # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, hidden, bias = config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.gate_up_proj = None  # gate_proj and up_proj fused by fuse_projections()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x, cos, sin, cache, start):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """``forward(idx [B, T], cache, start) -> logits [B, T, V]`` for the T tokens after the cache's."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim_of(config), config.rope_parameters), persistent=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self):
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, idx: torch.Tensor, cache, start: torch.Tensor | None = None, last: bool = False):
        """Run ``idx`` at positions ``cache.length ...``; row b's position 0 is slot ``start[b]``.

        ``last=True`` returns only the last position's logits ``[B, 1, V]`` (prefill).
        """
        T = idx.shape[1]
        pos = torch.arange(cache.length, cache.length + T, device=idx.device)
        pos = pos[None] if start is None else (pos[None] - start[:, None]).clamp(min=0)  # [B or 1, T]
        angles = (pos[..., None].float() * self.inv_freq).repeat(1, 1, 2)[:, None]  # [B or 1, 1, T, D]
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        x = self.model.embed_tokens(idx)
        for block in self.model.layers:
            x = block(x, cos, sin, cache, start)
        if last:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))


class Parallel(nn.Module):
    """Layers that share an input, their outputs side by side: for projections that do not fuse."""

    def __init__(self, layers):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x):
        return torch.cat([layer(x) for layer in self.parts], dim=-1)


def fuse_linears(layers: list[nn.Module], qcfg: dict | None, device, name: str = "") -> nn.Module:
    """One layer whose output is the ``layers``' outputs side by side (they share the input).

    Each tensor of the fused layer (an ``nn.Linear``, or the quantized layer ``qcfg`` names) is
    the parts' tensors concatenated along the dimension whose sizes add up: the output
    dimension (rows of a weight, columns of packed codes and scales). Layers of different
    kinds, or tensors without such a dimension, give a :class:`Parallel` instead.
    """
    first = layers[0]
    if any(type(m) is not type(first) for m in layers):
        return Parallel(layers)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, sum(m.out_features for m in layers), bias=first.bias is not None)
        if type(first) is not nn.Linear:
            fused = quantized_layer(qcfg, fused, name)
    fused.to_empty(device=device)
    state, parts = {}, [m.state_dict() for m in layers]
    for name, t in fused.state_dict().items():
        ts = [p[name] for p in parts]
        dims = [d for d in range(t.dim()) if sum(x.shape[d] for x in ts) == t.shape[d]
                and all(x.shape[:d] + x.shape[d + 1:] == t.shape[:d] + t.shape[d + 1:] for x in ts)]
        if dims:
            state[name] = torch.cat(ts, dim=dims[0])
        elif all(x.shape == t.shape and torch.equal(x, ts[0]) for x in ts):
            state[name] = ts[0]  # a shared constant (e.g. a format tag)
        else:
            return Parallel(layers)
    fused.load_state_dict(state)
    return fused


def fuse_projections(model: "Transformer", qcfg: dict | None, device) -> None:
    """Replace q/k/v by ``qkv_proj`` and gate/up by ``gate_up_proj`` in every layer (fewer, larger matmuls)."""
    for i, block in enumerate(model.model.layers):
        a, f = block.self_attn, block.mlp
        a.qkv_proj = fuse_linears([a.q_proj, a.k_proj, a.v_proj], qcfg, device, f"model.layers.{i}.self_attn.qkv")
        f.gate_up_proj = fuse_linears([f.gate_proj, f.up_proj], qcfg, device, f"model.layers.{i}.mlp.gate_up")
        del a.q_proj, a.k_proj, a.v_proj, f.gate_proj, f.up_proj


class Cast(nn.Module):
    """``layer`` computing in ``dtype``: ``y = layer(x.to(dtype)).to(x.dtype)``."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.layer, self.dtype = layer, dtype

    def forward(self, x):
        return self.layer(x.to(self.dtype)).to(x.dtype)


def cast_quantized(model: "Transformer", dtype: torch.dtype) -> None:
    """Wrap every group-quantized projection (``QuantLinear``) in :class:`Cast` to ``dtype``."""
    from compress.quant.linear import QuantLinear

    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, QuantLinear):
                setattr(module, name, Cast(child, dtype))


def make_lean(model: "Transformer", qdtype: torch.dtype) -> None:
    """Keep one in-memory form per quantized layer: the bfloat16 int4pack form (see :func:`load`)."""
    from compress.kernels.cpu import int4pack_fits, keep_int4pack_only
    from compress.quant.linear import QuantLinear

    if qdtype != torch.bfloat16 or model.lm_head.weight.device.type != "cpu":
        raise CompressError("lean loading keeps only the CPU's bfloat16 int4pack form of quantized layers: "
                            "load on the CPU with dtype or qdtype bfloat16, or without lean.")
    for m in model.modules():
        if isinstance(m, QuantLinear) and int4pack_fits(torch.empty(0, dtype=qdtype), m):
            keep_int4pack_only(m)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_biases(config) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Llama's ``attention_bias`` covers all four; Qwen2 biases q/k/v only."""
    if config.model_type == "qwen2":
        return True, False
    bias = getattr(config, "attention_bias", False)
    return bias, bias


def release_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS (glibc ``malloc_trim``), so RSS shows what is live."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load(folder, dtype: torch.dtype = torch.float32, device="cpu",
         qdtype: torch.dtype | None = None, lean: bool = False) -> tuple[Transformer, object]:
    """Load a run folder (any recipe's) or an HF Llama-family folder as ``(model, tokenizer)``.

    Tensors are checked by name, shape and finiteness against config.json. Floating-point
    parameters (embedding, norms, unquantized linears) take ``dtype``; quantized layers keep
    their packed buffers and fp16 scales. ``qdtype`` (e.g. bfloat16, which ATen's int4pack CPU
    kernel needs) makes the group-quantized layers compute in that dtype (:class:`Cast`);
    that rounds their inputs, so the logits are no longer those of the pipeline's loader.
    ``lean`` (CPU, quantized layers computing in bfloat16) keeps only ATen's int4pack form of
    each quantized layer and frees the packed codes (``kernels.cpu.keep_int4pack_only``).
    """
    from compress.checkpoint import check_finite

    folder = Path(folder)
    config, qcfg = read_config(folder)
    with torch.device("meta"):
        model = Transformer(config)
        swap_quantized(model, config, qcfg)
    model.to_empty(device=device)
    model.inv_freq.copy_(rope_inv_freq(head_dim_of(config), config.rope_parameters))
    load_state(model, read_tensors(folder), str(folder))
    check_finite(model, f"run folder '{folder}'")
    fuse_projections(model, qcfg, device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if qdtype is not None and qdtype != dtype:
        cast_quantized(model, qdtype)
    if lean:
        make_lean(model, qdtype or dtype)
    model.eval().requires_grad_(False)
    release_freed_memory()
    return model, read_tokenizer(folder)
