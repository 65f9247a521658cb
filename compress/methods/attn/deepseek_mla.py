"""MHA/GQA -> DeepSeek V3's multi-head latent attention, as a stock ``deepseek_v3`` model.

The result is ``transformers.DeepseekV3ForCausalLM`` itself: every layer dense
(``first_k_dense_replace`` = the layer count), no ``q_lora_rank``, ``num_key_value_heads`` = the
query heads, and nothing beyond the stock config keys, so ``from_pretrained`` loads it without
``trust_remote_code`` (``compress.arch.spec.LatentSpec`` gives the attention). Per layer, with
G KV heads of width D, H query heads, r RoPE channels and a latent of L:

1. **One RoPE key for all heads** (TransMLA's RoRoPE idea, in closed form). RoPE pair j of a
   head is a complex number k~_g,j = k_g[j] + i k_g[j + D/2], and all heads' pair j turn by the
   same angle, so a complex combination of them stays a RoPE pair. With C_j = E[k~_j k~_j^H]
   (G x G, from the inputs' E[x x^T]) and u_j its top eigenvector, ``k~_g,j ~ u_g,j z_j`` for
   the shared ``z_j = sum_g conj(u_g,j) k~_g,j``, and query head h of group g keeps its score
   term exactly up to that rank-1 truncation with ``q~'_h,j = conj(u_g,j) q~_h,j``. The r/2 pairs
   kept are j = s i (i < r/2, stride s = D / r), the frequencies ``theta^(-2i/r)`` DeepSeek's
   RoPE of r channels computes with the source's theta; they are stored interleaved
   (``rope_interleave``, as DeepSeek's checkpoints and vLLM have them).
2. **The latent**: the other D - r channels of each key (no longer rotated, MHA2MLA's partial
   RoPE) and all of V, ``[W_k,nope; W_v]`` [G (2D - r), hidden], truncated to rank L in the
   metric of the layer's inputs (``compress.methods.attn.mla.low_rank``): ``kv_a_proj_with_mqa``
   = [down; z rows], ``kv_b_proj`` = each query head's group rows of up.
3. **The latent norm** (``kv_a_layernorm``) is not an identity: it divides each token's latent
   by its RMS. Without an anchor its weight starts at the calibration RMS of the latent,
   rho = sqrt(tr(down S down^T)/L), so a token of typical RMS passes unchanged. With
   ``anchor`` (``mla.latent_anchor``) latent channel 0 is a constant a = 100 rho sqrt(L)
   (``kv_a_proj_with_mqa``'s bias, the stock ``attention_bias``; its row of weights and its
   column of ``kv_b_proj`` are zero) and the other L - 1 channels hold the rank-(L - 1) latent:
   the RMS is then a / sqrt(L) (1 + O(1e-4)) for every token, so the norm, with weight
   100 rho, is the identity on them to about 1e-4. The anchor's own norm weight is
   rho / sqrt(L), which makes its normed value rho, the latent's scale: at 100 rho sqrt(L) an
   optimizer step on its (zero) column of ``kv_b_proj`` swamps K and V, and distillation
   diverges. Distillation then trains the norm with the rest.

The scale (qk_nope + qk_rope)^-0.5 = D^-0.5 is the source's; ``o_proj``, the MLPs, norms and
embeddings are copied.
"""

import math

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from compress.arch.adapters import get_adapter
from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.methods.attn.calib import InputGram, attention_inputs
from compress.methods.attn.mla import low_rank


def check_deepseek_mla(config, rank: int, rope_dim: int, anchor: bool = False) -> None:
    """Refuse a latent width or RoPE width the source's heads cannot give (config only)."""
    spec = spec_of(config)
    D, G = spec.head_dim, spec.n_kv_heads
    if not (isinstance(rope_dim, int) and 2 <= rope_dim <= D and rope_dim % 2 == 0):
        raise CompressError(
            f"mla.rope_dim={rope_dim!r}: the shared RoPE key takes an even number of channels "
            f"from 2 to head_dim={D}."
        )
    if D % rope_dim:
        raise CompressError(
            f"mla.rope_dim={rope_dim}: it must divide head_dim={D}, so that the kept frequency "
            f"pairs (every {D}/rope_dim-th) are those DeepSeek's RoPE computes with the "
            f"source's theta; use one of {[d for d in range(2, D + 1, 2) if D % d == 0]}."
        )
    top = min(G * (2 * D - rope_dim), spec.hidden_size)
    if not (isinstance(rank, int) and 1 <= rank <= top + anchor) or rank == anchor:
        raise CompressError(
            f"mla.kv_lora_rank={rank!r}: the joint K/V matrix of a layer has rank at most "
            f"{top} here (KV heads x (2 head_dim - rope_dim), at most hidden), plus the "
            f"anchor channel if mla.latent_anchor; use {1 + anchor}..{top + anchor}."
        )
    if spec.qkv_bias or spec.o_bias:
        raise CompressError(
            "mla with mla.style=deepseek_v3 converts attention without biases (Llama, Mistral); "
            "this model has biases. Use the gqa or cla recipe for it."
        )


def kept_pairs(D: int, rope_dim: int) -> torch.Tensor:
    """The source pairs j (of D/2) the shared key keeps: every (D / rope_dim)-th."""
    return torch.arange(rope_dim // 2) * (D // rope_dim)


def half_to_interleaved(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[re_0 .. re_{n-1}, im_0 .. im_{n-1}]`` -> ``[re_0, im_0, re_1, im_1, ...]``."""
    n = rows.shape[0] // 2
    return torch.stack([rows[:n], rows[n:]], 1).flatten(0, 1)


ANCHOR = 100.0  # the anchor channel over the latent's calibration RMS


def deepseek_layer(wq, wk, wv, gram, H: int, G: int, rank: int, rope_dim: int, anchor=False):
    """One layer's DeepSeek attention tensors (module docstring), from q/k/v weights and the
    layer inputs' ``gram`` = E[x x^T] (float64 [hidden, hidden]); ``anchor``: latent channel 0
    a constant that pins the latent norm's RMS (step 3)."""
    hidden, D = wk.shape[1], wk.shape[0] // G
    dtype, n, half = wk.dtype, D - rope_dim, D // 2
    pairs = kept_pairs(D, rope_dim)
    q = wq.double().view(H, D, hidden)
    k = wk.double().view(G, D, hidden)
    group = torch.arange(H) // (H // G)
    kc = torch.complex(k[:, pairs], k[:, pairs + half])  # [G, r/2, hidden]
    qc = torch.complex(q[:, pairs], q[:, pairs + half])  # [H, r/2, hidden]
    gram_c = gram.to(torch.complex128)
    cov = torch.einsum("gjx,xy,hjy->jgh", kc, gram_c, kc.conj())  # C_j = E[k~ k~^H]
    u = torch.linalg.eigh(cov)[1][..., -1]  # [r/2, G], top eigenvector of each pair
    a = u.conj().T  # [G, r/2]: conj(u_g,j)
    z = (a[..., None] * kc).sum(0)  # [r/2, hidden]
    qr = a[group][..., None] * qc  # [H, r/2, hidden]
    k_rope = half_to_interleaved(torch.cat([z.real, z.imag]))
    q_rope = torch.stack([half_to_interleaved(torch.cat([x.real, x.imag])) for x in qr])
    rope_rows = set(pairs.tolist()) | {j + half for j in pairs.tolist()}
    nope = torch.tensor([d for d in range(D) if d not in rope_rows], dtype=torch.long)
    kv = torch.cat([k[:, nope].reshape(G * n, hidden), wv.double()])  # [G (n + D), hidden]
    up, down = low_rank(kv, rank - anchor, gram)
    rms = math.sqrt(max(torch.trace(down @ gram @ down.T).item() / down.shape[0], 1e-12))
    out = {}
    if anchor:  # channel 0: no weights, a constant bias, no K/V columns
        up = torch.cat([torch.zeros(up.shape[0], 1, dtype=up.dtype), up], 1)
        down = torch.cat([torch.zeros(1, hidden, dtype=down.dtype), down])
        bias = torch.zeros(rank + rope_dim, dtype=torch.float64)
        bias[0] = ANCHOR * rms * math.sqrt(rank)
        out["kv_a_proj_with_mqa.bias"] = bias.to(dtype)
    norm = torch.full((rank,), rms * (ANCHOR if anchor else 1.0), dtype=torch.float64)
    if anchor:  # the normed anchor at the latent's scale, not 100x it: training stays stable
        norm[0] = rms / math.sqrt(rank)
    up_k, up_v = up[: G * n].view(G, n, rank), up[G * n :].view(G, D, rank)
    return out | {
        "q_proj.weight": torch.cat([q[:, nope], q_rope], 1).reshape(H * D, hidden).to(dtype),
        "kv_a_proj_with_mqa.weight": torch.cat([down, k_rope]).to(dtype),
        "kv_a_layernorm.weight": norm.to(dtype),
        "kv_b_proj.weight": torch.cat([up_k[group], up_v[group]], 1).reshape(-1, rank).to(dtype),
    }


def deepseek_config(config, rank: int, rope_dim: int, anchor: bool = False) -> DeepseekV3Config:
    """The stock config of the converted model: the source's sizes, every layer dense."""
    spec = spec_of(config)
    rope = dict(spec.layers[0].rope_parameters())
    kw = {
        k: getattr(config, k)
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        + ("num_attention_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps")
        + ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
        if hasattr(config, k)
    }
    return DeepseekV3Config(
        **kw,
        num_key_value_heads=spec.n_heads,
        first_k_dense_replace=spec.n_layers,
        q_lora_rank=None,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=spec.head_dim - rope_dim,
        v_head_dim=spec.head_dim,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=anchor,  # kv_a_proj_with_mqa's bias holds the anchor (o_proj's is zero)
    )


def convert_deepseek_mla(model, rank: int, rope_dim: int, tokens: torch.Tensor, anchor=False):
    """A ``DeepseekV3ForCausalLM`` from the Llama-family ``model``; ``tokens`` [samples, seqlen]
    for the inputs' E[x x^T] (the shared key's covariances and the latent's metric);
    ``anchor``: pin the latent norm (module docstring, step 3)."""
    config = model.config
    check_deepseek_mla(config, rank, rope_dim, anchor)
    grams = InputGram()
    attention_inputs(model, tokens, grams)
    grams = grams.grams()
    adapter, spec = get_adapter(config), spec_of(config)
    state = model.state_dict()
    for i, layer in enumerate(adapter.decoder_layers(model)):
        w = {r: adapter.linear(layer, r).weight.detach() for r in ("q", "k", "v")}
        for r in ("q", "k", "v"):
            state.pop(f"{adapter.layers}.{i}.{dict(adapter.linears)[r]}.weight")
        H, G = spec.n_heads, spec.n_kv_heads
        new = deepseek_layer(w["q"], w["k"], w["v"], grams[i], H, G, rank, rope_dim, anchor)
        for name, t in new.items():
            state[f"{adapter.layers}.{i}.{adapter.attn}.{name}"] = t
        if anchor:
            o = adapter.linear(layer, "o")
            state[f"{adapter.layers}.{i}.{adapter.attn}.o_proj.bias"] = o.weight.new_zeros(
                o.out_features
            )
    out = DeepseekV3ForCausalLM(deepseek_config(config, rank, rope_dim, anchor))
    out = out.to(next(model.parameters()).dtype)
    out.load_state_dict(state, strict=True)
    return out.eval()
