"""Our own decoder-only transformer, in the spirit of gpt-fast's ``model.py``: one forward for every
family of ``compress.arch.adapters`` (llama, mistral, qwen2, qwen3, gemma3_text, the
mixture-of-experts qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, gpt_oss and the converted
cla / mla), reading only
the architecture spec (``compress.arch.spec.ArchSpec``, ``model.spec``).

One decoder layer l, with n1 = the input norm and n2 = the MLP's input norm::

    h = x + o_post(o_proj(attend_l(rope_l(qn(q_proj(n1(x)))), rope_l(kn(k_proj(n1(x)))), v_proj(n1(x)))))
    y = h + m_post(down_proj(act(gate_proj(n2(h))) * up_proj(n2(h))))

    RMSNorm(x) = (offset + w) * x / sqrt(mean(x^2) + eps)            (fp32; offset 1: Gemma)
    rope_l(x)[p] = x * cos(p * f) + rotate_half(x) * sin(p * f),     f_i = theta_l^(-2i / head_dim)
    rotate_half([a, b]) = [-b, a]                                    (HF's half-split layout)
    attend_l = the cache's attention (kv/base.py) under mask_l: the future, the left padding
               and, for a local layer of window w, the keys at positions <= p - w are hidden

``attend_l`` adds gpt-oss's attention sinks (one logit per query head, ``self_attn.sinks``) to
the attention weights' denominator.
``qn``/``kn`` (per-head RMSNorm, Qwen3 and Gemma 3; over the whole q and k projections, OLMoE),
``o_post``/``m_post`` (Gemma 3's post-norms) are the identity where the spec has none; a sparse
layer's MLP is the router-weighted sum of its top-k experts' (``compress.decoder.experts``);
``act`` is SiLU or GELU-tanh; the embeddings are multiplied by the spec's ``embed_scale``
(Gemma: sqrt(hidden) in the embedding's dtype) and ``theta_l`` and its scaling are the layer's
(Gemma 3: local 10k, global 1M).

One forward serves every use: eager, compiled (``compress.decoder.compiled`` runs it with a
static cache and compile-friendly linears), batched with left padding, teacher-forced
(``eval/bench/kv_quality.py``). It takes the cache slots of its tokens as a tensor ``pos``, so
nothing in it depends on a Python-side position. Attention is the cache's
(``compress.decoder.kv``): K and V are appended after position encoding, and the cache decides
how they are stored and read. Module names are the HF checkpoint's, so a run folder's tensors
load by name and validation errors name the tensor as it is stored. Linears are
``nn.Linear``, or the quantized layer the folder's ``quantization_config`` asks for
(``compress.io.checkpoint.quantized_layer``), whose forward calls the kernels.
After loading, q/k/v and gate/up are fused into ``qkv_proj`` and ``gate_up_proj``
(one matmul each: fewer calls per token). Sliding windows are the caches' (``compress.decoder.kv``
takes each slot's window from :meth:`Transformer.kv_layout`, a ``KVLayout``).

A layer's attention module is that of its spec's attention kind (:data:`ATTENTIONS`); a method
adds a kind of its own with :func:`register_attention` and loads with ``load(folder,
attention={layer: kind})`` (IAM's mapped layers: ``compress.methods.iam.attention``), so the
decoder imports no method and the HF config is never written to.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from compress.arch.spec import ArchSpec, spec_of, yarn_mscale
from compress.decoder.experts import (
    QuantExperts,
    SparseMoE,
    fused_expert_tensors,
    quantized_experts,
)
from compress.decoder.kv.base import KVLayout
from compress.decoder.runtime import RuntimeConfig
from compress.errors import CompressError
from compress.formats.attention.absorb import absorb_output, absorb_query
from compress.io.checkpoint import (
    check_finite,
    load_state,
    quantized_layer,
    read_config,
    read_tensors,
    read_tokenizer,
    swap_quantized,
)
from compress.io.manifest import check_loadable
from compress.io.memory import release_freed_memory
from compress.kernels import linear, rms_norm
from compress.kernels.cpu import int4pack_fits, keep_int4pack_only, keep_w4a8_only, takes_w4a8
from compress.kernels.w4a8_cpu import use
from compress.layers import QuantLinear
from compress.layers.head import quantize_head


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Frequencies ``f_i = theta^(-2i/d)`` [d/2], with "linear", "llama3" or "yarn" scaling.

    llama3: wavelengths longer than ``ctx/low_freq_factor`` are divided by ``factor``, shorter
    than ``ctx/high_freq_factor`` kept, and those between interpolated smoothly.
    yarn (Peng et al. 2023, arXiv 2309.00071, eqs. 17-19): ``f_i = f_i/s (1 - g_i) + f_i g_i``,
    g_i = 1 - clamp((i - lo) / (hi - lo), 0, 1), lo and hi the dimensions where the pretrained
    context ``ctx`` makes ``beta_fast`` and ``beta_slow`` rotations (floored / ceiled unless
    ``truncate`` is false); cos and sin are then scaled by :func:`rope_gain`.
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
    if kind == "yarn":
        factor, ctx = rope["factor"], rope["original_max_position_embeddings"]
        fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

        def dim_of(rotations):  # the dimension making ``rotations`` turns over ctx
            return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(fast), dim_of(slow)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp
        return inv_freq / factor * (1 - keep) + inv_freq * keep
    raise CompressError(
        f"RoPE type '{kind}' is not supported by compress's decoder (it reads "
        f"'default', 'linear', 'llama3' and 'yarn'); config.json's rope_parameters asks for it."
    )


def rope_gain(rope: dict) -> float:
    """The factor cos and sin are multiplied by: YaRN's ``attention_factor``, by default
    ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` with both given, else ``mscale(s)``
    (``compress.arch.spec.yarn_mscale``); 1 for the other kinds."""
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, m, m_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]``; ``cos``, ``sin`` [B or 1, 1, T, D]."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """``(offset + w) * x / sqrt(mean(x^2) + eps)``: offset 0 rounds x-hat to x's dtype, then
    scales (Llama's order); offset 1 scales in fp32, then rounds (Gemma's ``(1 + w)``)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def norm(spec: ArchSpec, dim: int | None = None) -> RMSNorm:
    """The spec's RMSNorm over ``dim`` channels (default: the hidden size)."""
    return RMSNorm(dim or spec.hidden_size, spec.norm_eps, spec.norm_offset)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class Attention(nn.Module):
    """Grouped-query attention; with ``cla_share`` s in the config, cross-layer attention (CLA):
    layer i reads the K/V that layer ``i - i % s`` wrote into cache slot ``i // s`` and has no
    k/v projections of its own. Kinds differ only in :meth:`project` (and their loading)."""

    def __init__(self, spec: ArchSpec, layer: int):
        super().__init__()
        lay = spec.layers[layer]
        self.kv_slot, self.writes_kv, self.window = lay.kv_slot, lay.writes_kv, lay.window
        self.n_heads, self.head_dim = spec.n_heads, spec.head_dim
        self.n_kv_heads = spec.n_kv_heads if self.writes_kv else 0  # heads this layer projects
        dim, qkv_bias = spec.hidden_size, spec.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=qkv_bias)
        if self.writes_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=spec.o_bias)
        self.qk_norm_full = spec.qk_norm_full  # the norms span the whole projection (OLMoE)
        if spec.qk_norm_full:
            D = self.head_dim
            self.q_norm, self.k_norm = norm(spec, self.n_heads * D), norm(spec, self.n_kv_heads * D)
        elif spec.qk_norm:  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
            self.q_norm, self.k_norm = norm(spec, spec.head_dim), norm(spec, spec.head_dim)
        # gpt-oss: a sink logit per query head (the cache applies it: kv/base.py)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if spec.sinks else None
        self.qkv_proj = None  # the input projections, fused by fuse_projections()

    def inputs(self) -> list[str]:
        """Names of the input projections that :func:`fuse_projections` fuses into ``qkv_proj``."""
        return ["q_proj", "k_proj", "v_proj"] if self.writes_kv else ["q_proj"]

    def dropped(self) -> list[str]:
        """Projections of the checkpoint this kind loads but never runs (freed after loading)."""
        return []

    def project(self, x, cos, sin):
        """``(q [B, H, T, Dk], k [B, Hkv, T, Dk] or None, v or None)``, position-encoded."""
        B, T, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        out = self.qkv_proj(x)
        if self.qk_norm_full:
            q, k, v = out.split([H * self.head_dim, Hkv * self.head_dim, Hkv * self.head_dim], -1)
            out = torch.cat([self.q_norm(q), self.k_norm(k), v], -1)
        heads = out.view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk = heads[:, : H + Hkv]
        if hasattr(self, "q_norm") and not self.qk_norm_full:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], 1)
        qk = apply_rope(qk, cos, sin)
        if not self.writes_kv:
            return qk, None, None
        return qk[:, :H], qk[:, H:], heads[:, H + Hkv :]

    def forward(self, x, cos, sin, cache, pos, start):
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if k is not None or v is not None:
            cache.append(self.kv_slot, k, v, pos)
        y = cache.attend(self.kv_slot, q, pos, start).to(x.dtype)  # [B, H, T, Dv]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LatentAttention(Attention):
    """Multi-head latent attention (MHA2MLA layout, ``compress.methods.attn.mla``), decoded absorbed.

    Per layer (H query heads, G KV heads of width D, p RoPE pairs per KV head, latent width L,
    n = D - 2p), the checkpoint holds ``q_proj`` (each head's rows ``[2p rotated | n]``),
    ``k_rope_proj`` [G 2p], ``kv_a_proj`` [L], ``k_b_proj`` [G n, L], ``v_b_proj`` [G D, L],
    ``o_proj`` and ``rope_index`` [G, p] (the frequency pairs each KV head keeps). Nothing is
    expanded per token: with W_kb,g and W_vb,g the rows of KV head g,

        q_lat,h = q_n,h W_kb,g          score = (q_r,h . k_r,g + q_lat,h . c) / sqrt(D)
        u_h = sum_t p(t) c(t)           y = sum_h u_h (W_o,h W_vb,g)^T

    so the cache holds one key per token, ``[c | k_r,1 .. k_r,G]`` (L + 2pG values), whose first
    L channels are also the value, and query head h is ``[q_lat,h | q_r,h in group g's slot]``.
    """

    def __init__(self, spec: ArchSpec, layer: int):
        nn.Module.__init__(self)
        self.kv_slot, self.writes_kv, self.window = layer, True, spec.layers[layer].window
        H, G, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
        p, L = spec.mla_rope_pairs, spec.kv_lora_rank
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope, self.latent = H, G, D, 2 * p, L
        dim = spec.hidden_size
        self.q_proj = nn.Linear(dim, H * D, bias=False)
        self.k_rope_proj = nn.Linear(dim, G * 2 * p, bias=False)
        self.kv_a_proj = nn.Linear(dim, L, bias=False)
        self.k_b_proj = nn.Linear(L, G * (D - 2 * p), bias=False)
        self.v_b_proj = nn.Linear(L, G * D, bias=False)
        self.o_proj = nn.Linear(H * D, dim, bias=False)
        self.register_buffer("rope_index", torch.zeros(G, p, dtype=torch.long))
        self.qkv_proj = None

    def inputs(self) -> list[str]:
        return ["q_proj", "k_rope_proj", "kv_a_proj"]

    def absorb(self) -> None:
        """Fold ``k_b_proj`` into the query rows and ``v_b_proj`` into ``o_proj`` (see the class)."""

        H, G, D, r, L = self.n_heads, self.n_kv_heads, self.head_dim, self.rope, self.latent
        wq = self.q_proj.weight.view(H, D, -1).double()
        kb, vb = self.k_b_proj.weight.double(), self.v_b_proj.weight.double()
        q_lat = absorb_query(wq[:, r:].transpose(1, 2), kb, G).transpose(1, 2)  # [H, L, hidden]
        dtype = self.q_proj.weight.dtype
        self.q_proj.weight = nn.Parameter(
            torch.cat([wq[:, :r], q_lat], 1).reshape(H * (r + L), -1).to(dtype)
        )
        self.o_proj.weight = nn.Parameter(
            absorb_output(self.o_proj.weight.double(), vb, H).to(dtype)
        )
        self.q_proj.out_features, self.o_proj.in_features = H * (r + L), H * L
        del self.k_b_proj, self.v_b_proj
        # query head h's rotated part goes to its group's slot of the key's 2pG RoPE channels
        g = torch.arange(H) // (H // G)
        slot = (torch.arange(G * r) // r == g[:, None]).to(dtype)  # [H, G 2p]
        self.register_buffer("rope_slot", slot[None, :, None], persistent=False)

    def project(self, x, cos, sin):
        B, T, _ = x.shape
        H, G, r, L = self.n_heads, self.n_kv_heads, self.rope, self.latent
        out = self.qkv_proj(x)
        q = out[..., : H * (r + L)].view(B, T, H, r + L).transpose(1, 2)
        kr = out[..., H * (r + L) : -L].view(B, T, G, r).transpose(1, 2)
        half = cos.shape[-1] // 2
        cg, sg = (
            torch.cat([t[:, 0, :, :half][..., self.rope_index]] * 2, -1).permute(0, 2, 1, 3)
            for t in (cos, sin)
        )  # [B|1, G, T, 2p]
        kr = apply_rope(kr, cg, sg)
        each = H // G
        qr = apply_rope(q[..., :r], cg.repeat_interleave(each, 1), sg.repeat_interleave(each, 1))
        k = torch.cat(
            [out[:, None, :, -L:], kr.transpose(1, 2).reshape(B, 1, T, G * r)], -1
        )  # [B, 1, T, L + 2pG]
        q = torch.cat([q[..., r:], qr.repeat(1, 1, 1, G) * self.rope_slot], -1)
        return q, k, None


def interleaved_to_half(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[x0, x1, x2, x3, ...]`` of RoPE pairs (0, 1), (2, 3) ... reordered to
    ``[x0, x2, ..., x1, x3, ...]``, the half-split pairs (i, i + r/2) :func:`apply_rope` rotates
    (along dim 0 of the last ``r`` rows given)."""
    return torch.cat([rows[0::2], rows[1::2]])


class DeepSeekAttention(LatentAttention):
    """DeepSeek V2/V3 multi-head latent attention (``compress.arch.spec.LatentSpec``), decoded
    absorbed as :class:`LatentAttention` is. With W_kb,h and W_vb,h head h's rows of
    ``kv_b_proj`` ([nope, L] and [v, L]) and c the normed latent::

        q_lat,h = q_nope,h W_kb,h        score = (q_lat,h . c + rope(q_rope,h) . rope(k_rope)) * scale
        u_h = sum_t p(t) c(t)            y = sum_h u_h (W_o,h W_vb,h)^T

    so the cache holds one key per token, ``[c | k_rope]`` (L + r values: DeepSeek V3's latent
    cache), whose first L channels are the value. W_kb goes into ``q_proj`` (or ``q_b_proj``),
    W_vb into ``o_proj``; interleaved RoPE rows are reordered to the half-split layout in both
    q and ``kv_a_proj_with_mqa``, which leaves every score unchanged.
    """

    def __init__(self, spec: ArchSpec, layer: int):
        nn.Module.__init__(self)
        lat = spec.latent
        self.kv_slot, self.writes_kv, self.window = layer, True, spec.layers[layer].window
        H, L, r = spec.n_heads, lat.kv_lora_rank, lat.rope
        self.n_heads, self.n_kv_heads, self.rope, self.latent = H, 1, r, L
        self.nope, self.v_dim, self.q_lora, self.interleave = (
            lat.nope,
            lat.v_dim,
            lat.q_lora_rank,
            lat.interleave,
        )
        dim, bias, qk = spec.hidden_size, spec.qkv_bias, lat.nope + r
        if self.q_lora is None:
            self.q_proj = nn.Linear(dim, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, 1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(self.q_lora, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, L + r, bias=bias)
        self.kv_a_layernorm = RMSNorm(L, 1e-6)
        self.kv_b_proj = nn.Linear(L, H * (lat.nope + lat.v_dim), bias=False)
        self.o_proj = nn.Linear(H * lat.v_dim, dim, bias=spec.o_bias)
        self.qkv_proj = None

    def inputs(self) -> list[str]:
        return ["q_proj" if self.q_lora is None else "q_a_proj", "kv_a_proj_with_mqa"]

    def dropped(self) -> list[str]:
        return ["kv_b_proj"]

    def absorb(self) -> None:
        """Fold ``kv_b_proj`` into the query and ``o_proj`` (see the class), in float64."""
        H, n, r, L, v = self.n_heads, self.nope, self.rope, self.latent, self.v_dim
        kvb = self.kv_b_proj.weight.double().view(H, n + v, L)
        q = self.q_proj if self.q_lora is None else self.q_b_proj
        wq, dtype = q.weight.double().view(H, n + r, -1), q.weight.dtype
        q_rope = wq[:, n:]
        if self.interleave:
            q_rope = interleaved_to_half(q_rope.transpose(0, 1)).transpose(0, 1)
            kva = self.kv_a_proj_with_mqa
            kva.weight.data[L:] = interleaved_to_half(kva.weight.data[L:])
            if kva.bias is not None:
                kva.bias.data[L:] = interleaved_to_half(kva.bias.data[L:])
        q_lat = absorb_query(wq[:, :n].transpose(1, 2), kvb[:, :n].reshape(H * n, L), H)
        q.weight = nn.Parameter(
            torch.cat([q_lat.transpose(1, 2), q_rope], 1).reshape(H * (L + r), -1).to(dtype)
        )
        q.out_features = H * (L + r)
        w_o = absorb_output(self.o_proj.weight.double(), kvb[:, n:].reshape(H * v, L), H)
        self.o_proj.weight = nn.Parameter(w_o.to(self.o_proj.weight.dtype))
        self.o_proj.in_features = H * L

    def project(self, x, cos, sin):
        B, T, _ = x.shape
        H, r, L = self.n_heads, self.rope, self.latent
        out = self.qkv_proj(x)
        if self.q_lora is None:
            q = out[..., : H * (L + r)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(out[..., : self.q_lora]))
        q = q.view(B, T, H, L + r).transpose(1, 2)
        c = self.kv_a_layernorm(out[..., -(L + r) : -r])
        kr = apply_rope(out[:, None, :, -r:], cos, sin)  # [B, 1, T, r]
        k = torch.cat([c[:, None], kr], -1)  # [B, 1, T, L + r]
        return torch.cat([q[..., :L], apply_rope(q[..., L:], cos, sin)], -1), k, None


# attention kinds (``LayerSpec.attention``) -> the module a layer of that kind is built as
ATTENTIONS = {
    "gqa": Attention,
    "cla": Attention,
    "mla": LatentAttention,
    "deepseek_mla": DeepSeekAttention,
}
BUILT_IN = tuple(ATTENTIONS)


def register_attention(kind: str, cls: type) -> None:
    """Build layers of attention ``kind`` as ``cls`` (an :class:`Attention` whose ``project``
    returns what its cache takes). A method brings its own kind this way, registering on
    import (IAM's ``mapped``: ``compress.methods.iam.attention``), and loads a model with
    ``load(folder, attention={layer: kind})``; the decoder imports no method."""
    if kind in BUILT_IN:
        raise CompressError(f"attention kind '{kind}' is the decoder's own; register another name.")
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
        raise CompressError(f"attention kind '{kind}': {cls!r} is not a decoder Attention class.")
    ATTENTIONS[kind] = cls


def attention_class(spec: ArchSpec, layer: int) -> type:
    """The module class of ``layer``'s attention kind (a :class:`CompressError` if none is
    registered)."""
    kind = spec.layers[layer].attention
    if kind not in ATTENTIONS:
        raise CompressError(
            f"layer {layer} asks for attention kind '{kind}', which nothing registered with the "
            f"decoder (it knows {', '.join(sorted(ATTENTIONS))}); import the method that "
            f"provides it, which calls compress.decoder.model.register_attention."
        )
    return ATTENTIONS[kind]


class FeedForward(nn.Module):
    """The gated MLP, of width ``hidden`` (default: the spec's intermediate size)."""

    def __init__(self, spec: ArchSpec, hidden: int | None = None):
        super().__init__()
        dim, hidden, bias = spec.hidden_size, hidden or spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.gate_up_proj = None  # gate_proj and up_proj fused by fuse_projections()
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def mlp(spec: ArchSpec, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: a :class:`FeedForward`, or a sparse layer's experts
    (``compress.decoder.experts.SparseMoE``, with its shared expert a :class:`FeedForward`)."""
    if spec.layers[layer].mlp == "dense":
        return FeedForward(spec)
    width = spec.moe.shared_intermediate_size
    return SparseMoE(spec, ACTIVATIONS[spec.activation], width and FeedForward(spec, width) or None)


class Block(nn.Module):
    """One decoder layer; its norms carry the checkpoint's names (the spec's adapter)."""

    def __init__(self, spec: ArchSpec, layer: int):
        super().__init__()
        a = spec.adapter
        self.norm_names = (a.input_norm, a.attn_out_norm, a.post_norm, a.mlp_out_norm)
        for name in a.norms():
            setattr(self, name, norm(spec))
        self.self_attn = attention_class(spec, layer)(spec, layer)
        self.mlp = mlp(spec, layer)

    def forward(self, x, cos, sin, cache, pos, start):
        n_in, o_post, n_mlp, m_post = (n and getattr(self, n) for n in self.norm_names)
        a = self.self_attn(n_in(x), cos, sin, cache, pos, start)
        h = x + (o_post(a) if o_post else a)
        m = self.mlp(n_mlp(h))
        return h + (m_post(m) if m_post else m)


class Body(nn.Module):
    def __init__(self, spec: ArchSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.n_layers))
        self.norm = norm(spec)


class Transformer(nn.Module):
    """``forward(idx [B, T], cache, pos [T], start [B]) -> logits [B, T, V]``.

    ``inv_freq [R, head_dim/2]`` holds the frequencies of the spec's R distinct RoPE parameter
    sets (``spec.rope_groups()``); layer l rotates with row ``rope_row[l]``.
    """

    def __init__(self, config, attention: dict[int, str] | None = None):
        super().__init__()
        self.config = config  # kept as read (HF-style consumers); the forward reads the spec
        spec = spec_of(config)
        self.spec = spec = spec.with_attention(attention) if attention else spec
        self.model = Body(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        groups = spec.rope_groups()
        self.rope_row = [groups.index(layer.rope) for layer in spec.layers]
        self.register_buffer("inv_freq", self.rope_frequencies(), persistent=False)
        self.rope_gains = [rope_gain(dict(r)) for r in groups]  # YaRN's cos/sin factor
        if spec.tied:
            self.tie_weights()

    def rope_frequencies(self) -> torch.Tensor:
        """``inv_freq`` computed from the spec (after loading on the meta device, it is copied in)."""
        rows = [rope_inv_freq(self.spec.head_dim, dict(r)) for r in self.spec.rope_groups()]
        return torch.stack(rows)

    def tie_weights(self):
        self.lm_head.weight = self.model.embed_tokens.weight

    def kv_layout(self) -> KVLayout:
        """What a KV cache for this model holds per token (``kv/base.py``): one slot per
        K/V-writing layer group, and for latent attention one key per token of ``latent +
        n_kv_heads * rope`` channels whose first ``latent`` are the value."""
        spec = self.spec
        a, windows = self.model.layers[0].self_attn, tuple(spec.slot_windows())
        sinks = None
        if spec.sinks:  # each slot's writer's sink logits
            writers = [b.self_attn for b in self.model.layers if b.self_attn.writes_kv]
            sinks = torch.stack([w.sinks.detach().float() for w in writers])
        if isinstance(a, LatentAttention):
            return KVLayout(
                n_layers=spec.n_slots,
                n_kv_heads=1,
                head_dim=a.latent + a.n_kv_heads * a.rope,
                v_dim=a.latent,
                scale=spec.attn_scale,
                windows=windows,
            )
        return KVLayout(
            n_layers=spec.n_slots,
            n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            scale=None if spec.attn_scale == spec.head_dim**-0.5 else spec.attn_scale,
            windows=windows,
            sinks=sinks,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        idx: torch.Tensor,
        cache,
        pos: torch.Tensor | None = None,
        start: torch.Tensor | None = None,
        last: bool = False,
        skip=(),
    ):
        """Run ``idx`` at cache slots ``pos`` (default: the next T, ``cache.length ...``); row b's
        position 0 is slot ``start[b]`` (left padding before it is masked).

        ``last=True`` returns only the last position's logits ``[B, 1, V]`` (prefill). ``skip``:
        indices of layers to leave out (a self-speculative draft); they neither run nor write K/V.
        """
        if pos is None:
            pos = torch.arange(cache.length, cache.length + idx.shape[1], device=idx.device)
        rel = (
            pos[None] if start is None else (pos[None] - start[:, None]).clamp(min=0)
        )  # [B or 1, T]
        angles = (rel[None, ..., None].float() * self.inv_freq[:, None, None]).repeat(1, 1, 1, 2)[
            :, :, None
        ]  # [R, B or 1, 1, T, D]
        cos, sin = angles.cos(), angles.sin()
        if any(g != 1.0 for g in self.rope_gains):
            gains = torch.tensor(self.rope_gains, device=cos.device)[:, None, None, None, None]
            cos, sin = cos * gains, sin * gains
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        x = self.model.embed_tokens(idx)
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        for i, block in enumerate(self.model.layers):
            if i not in skip:
                r = self.rope_row[i]
                x = block(x, cos[r], sin[r], cache, pos, start)
        if last:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        if self.spec.final_softcap is not None:
            c = self.spec.final_softcap
            logits = c * torch.tanh(logits / c)
        return logits


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
    if any((m.bias is None) != (first.bias is None) for m in layers):
        return Parallel(layers)  # DeepSeek's q_proj without a bias beside kv_a_proj's
    if isinstance(first, QuantLinear) and any(
        (m.bits, m.group_size) != (first.bits, first.group_size) for m in layers
    ):
        return Parallel(layers)  # a format with a scheme per layer (compressed-tensors)
    with torch.device("meta"):
        out = sum(m.out_features for m in layers)
        fused = nn.Linear(first.in_features, out, bias=first.bias is not None)
        if isinstance(first, QuantLinear):
            fused = QuantLinear(
                first.in_features, out, first.bits, first.group_size, fused.bias is not None
            )
        elif type(first) is not nn.Linear:
            fused = quantized_layer(qcfg, fused, name)
    fused.to_empty(device=device)
    state, parts = {}, [m.state_dict() for m in layers]
    for name, t in fused.state_dict().items():
        ts = [p[name] for p in parts]
        dims = [
            d
            for d in range(t.dim())
            if sum(x.shape[d] for x in ts) == t.shape[d]
            and all(x.shape[:d] + x.shape[d + 1 :] == t.shape[:d] + t.shape[d + 1 :] for x in ts)
        ]
        if dims:
            state[name] = torch.cat(ts, dim=dims[0])
        elif all(x.shape == t.shape and torch.equal(x, ts[0]) for x in ts):
            state[name] = ts[0]  # a shared constant (e.g. a format tag)
        else:
            return Parallel(layers)
    fused.load_state_dict(state)
    return fused


def fuse_projections(model: "Transformer", qcfg: dict | None, device) -> None:
    """Replace the attention's input projections by ``qkv_proj`` and gate/up by ``gate_up_proj``
    in every layer (fewer, larger matmuls); latent attention is absorbed first. A sparse layer's
    experts are stored fused already; its shared expert, if any, is fused like a dense MLP."""
    for i, block in enumerate(model.model.layers):
        a, f = block.self_attn, block.mlp
        sparse = isinstance(f, SparseMoE)
        f = f.shared() if sparse else f
        if isinstance(a, LatentAttention):
            if any(type(m) is not nn.Linear for m in a.children() if hasattr(m, "in_features")):
                raise CompressError(
                    "the decoder runs latent (MLA) attention from float weights only; this "
                    "folder's attention projections are quantized."
                )
            a.absorb()
        a.qkv_proj = fuse_linears(
            [getattr(a, n) for n in a.inputs()], qcfg, device, f"model.layers.{i}.self_attn.qkv"
        )
        for name in a.inputs() + a.dropped():
            delattr(a, name)
        if sparse and isinstance(block.mlp.experts, QuantExperts):
            for e, expert in block.mlp.experts.named_children():
                g, u, _ = expert.names
                where = f"model.layers.{i}.mlp.experts.{e}.gate_up"
                expert.gate_up_proj = fuse_linears(
                    [getattr(expert, g), getattr(expert, u)], qcfg, device, where
                )
                delattr(expert, g)
                delattr(expert, u)
        if f is None:
            continue
        where = f"model.layers.{i}.mlp" + (f".{block.mlp.shared_name}" if sparse else "")
        f.gate_up_proj = fuse_linears([f.gate_proj, f.up_proj], qcfg, device, f"{where}.gate_up")
        del f.gate_proj, f.up_proj


class Linear(nn.Linear):
    """``nn.Linear`` through ``compress.kernels.linear``: on the CPU, fp32 products of 2 to 8 rows
    (speculative verification, small batches) read the weight once for all the rows."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def dense_kernels(model: nn.Module) -> int:
    """Make every plain fp32 ``nn.Linear`` of ``model`` a :class:`Linear` (the same module and
    parameters, another forward); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32:
            m.__class__ = Linear
            n += 1
    return n


class Cast(nn.Module):
    """``layer`` computing in ``dtype``: ``y = layer(x.to(dtype)).to(x.dtype)``."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.layer, self.dtype = layer, dtype

    def forward(self, x):
        return self.layer(x.to(self.dtype)).to(x.dtype)


def cast_quantized(model: "Transformer", dtype: torch.dtype) -> None:
    """Wrap every group-quantized projection (``QuantLinear``) in :class:`Cast` to ``dtype``."""

    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, QuantLinear):
                setattr(module, name, Cast(child, dtype))


TRIM_EVERY = 64  # quantized layers repacked between two heap trims (make_lean)


def make_lean(model: "Transformer", qdtype: torch.dtype) -> None:
    """Keep one in-memory form per quantized layer: the W4A8 form where the layer takes it, else
    the bfloat16 int4pack form (see :func:`load`)."""

    rest = [m for m in model.modules() if isinstance(m, QuantLinear) and not takes_w4a8(m)]
    if model.device.type == "cpu":
        w4a8 = [m for m in model.modules() if isinstance(m, QuantLinear) and takes_w4a8(m)]
        for i, m in enumerate(w4a8, 1):
            keep_w4a8_only(m)
            if i % TRIM_EVERY == 0:  # repacking's freed temporaries, between live forms
                release_freed_memory()
        if not rest:
            return
    if qdtype != torch.bfloat16 or model.device.type != "cpu":
        raise CompressError(
            "lean loading keeps only the CPU's bfloat16 int4pack form of quantized layers: "
            "load on the CPU with dtype or qdtype bfloat16, or without lean."
        )
    for m in rest:
        if int4pack_fits(torch.empty(0, dtype=qdtype), m):
            keep_int4pack_only(m)


def load(
    folder,
    dtype: torch.dtype = torch.float32,
    device=None,
    qdtype: torch.dtype | None = None,
    lean: bool = False,
    attention: dict[int, str] | None = None,
    head: str = "none",
    kernel: str = "exact",
    verify: bool = True,
    runtime: RuntimeConfig | None = None,
) -> tuple[Transformer, object]:
    """Load a run folder (any recipe's) or an HF folder of a supported family as ``(model, tokenizer)``.

    ``load(folder, runtime=conf)`` is how the decoder CLI, a ``--draft`` folder, the server and
    ``compress.load`` load: ``conf`` (``compress.decoder.runtime.resolve_runtime``'s
    configuration) sets ``device``, ``dtype``, ``qdtype``, ``lean``, ``head``, ``kernel`` and
    torch's CPU ``threads`` at once; the separate keywords are for the pipeline and the tests
    (``device`` default: the CPU).

    Tensors are checked by name, shape and finiteness against config.json. Floating-point
    parameters (embedding, norms, unquantized linears) take ``dtype``; quantized layers keep
    their packed buffers and fp16 scales. ``qdtype`` (e.g. bfloat16, which ATen's int4pack CPU
    kernel needs) makes the group-quantized layers compute in that dtype (:class:`Cast`);
    that rounds their inputs, so the logits are no longer those of the pipeline's loader.
    ``lean`` (CPU, quantized layers computing in bfloat16) keeps only ATen's int4pack form of
    each quantized layer and frees the packed codes (``kernels.cpu.keep_int4pack_only``).
    ``attention``: ``{layer: kind}`` of layers built as an attention kind a method registered
    (:func:`register_attention`; IAM's mapped layers: ``compress.methods.iam.attention``).
    ``head`` (none, int8, int4) group-quantizes the output head at load
    (``compress.layers.head``: the embedding stays exact); it then computes like the other
    quantized layers (``qdtype``, ``lean``). ``kernel`` "w4a8" rounds the quantized layers'
    inputs to int8 for the integer kernel (``compress.kernels.w4a8_cpu``); "exact" keeps them.
    ``verify`` checks the folder against its manifest first (``manifest.check_loadable``: an
    unfinished or edited run folder is refused); ``verify=False`` loads it as it is.
    """

    if runtime is not None:
        kw = runtime.load_kwargs()
        if device is not None and torch.device(device) != torch.device(kw["device"]):
            raise CompressError(
                f"load(device={device!r}) with a runtime resolved for {kw['device']}: resolve "
                f"the runtime for that device (resolve_runtime(folder, {device!r}, ...)), or "
                f"leave out device."
            )
        device, dtype, qdtype, lean, head, kernel = (
            kw[k] for k in ("device", "dtype", "qdtype", "lean", "head", "kernel")
        )
        if runtime.threads:
            torch.set_num_threads(runtime.threads)
    device = device or "cpu"
    folder = Path(folder)
    if verify:
        check_loadable(folder)
    config, qcfg = read_config(folder)
    with torch.device("meta"):
        model = Transformer(config, attention)
        quantized_experts(model, model.spec, qcfg)
        swap_quantized(model, config, qcfg)
    model.to_empty(device=device)
    model.inv_freq.copy_(model.rope_frequencies())
    # no name holds the folder's tensors past load_state: they are freed before the kernels'
    # forms are made (BENCHMARKS.md: loading the OLMoE-shaped int4 folder)
    load_state(
        model,
        fused_expert_tensors(read_tensors(folder, model, qcfg), model.spec, qcfg),
        str(folder),
    )
    release_freed_memory()
    check_finite(model, f"run folder '{folder}'")
    quantize_head(model, head, qcfg)
    fuse_projections(model, qcfg, device)
    use(model, kernel)
    fp32 = {
        id(p) for m in model.modules() if getattr(m, "keeps_fp32", False) for p in m.parameters()
    }
    for p in model.parameters():
        if id(p) not in fp32:
            p.data = p.data.to(dtype)
    if qdtype is not None and qdtype != dtype:
        cast_quantized(model, qdtype)
    if lean:
        make_lean(model, qdtype or dtype)
    if model.device.type == "cpu":
        dense_kernels(model)
    model.eval().requires_grad_(False)
    release_freed_memory()
    return model, read_tokenizer(folder)
