"""Multi-head latent attention converted from a Llama (MHA2MLA, Ji et al. 2025, arXiv 2502.14837).

Per layer (H query heads, G KV heads, head dim D, p RoPE pairs per KV head, latent width L,
n = D - 2p; query head h belongs to KV head g = h // (H / G))::

    c      = x kv_a_proj^T                          [t, L]       cached
    k_r,g  = RoPE_g(x k_rope_proj^T)_g             [t, 2p]      cached (after RoPE)
    k_n,g  = (c k_b_proj^T)_g                       [t, n]       expanded, or absorbed into q
    v_g    = (c v_b_proj^T)_g                       [t, D]       expanded, or absorbed into o_proj
    q_h    = x q_proj^T, split [RoPE_g(q_h[:2p]) | q_h[2p:]]
    score  = (q_h,r . k_r,g + q_h,n . k_n,g) / sqrt(D)

RoPE_g rotates a 2p-vector in transformers' half-split layout ``[x1 | x2]`` with the
frequencies ``inv_freq[rope_index[g]]`` (``rope_index``: [G, p] buffer of pair indices).
The cache holds ``k_r`` as keys and ``c`` as values. Self-contained (transformers only).
"""

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaForCausalLM,
    eager_attention_forward,
    rotate_half,
)

from .configuration_mla import MLAConfig


def rope_pairs(x, cos, sin, index):
    """Rotate ``x [b, heads, t, 2p]`` (half-split) by the pairs ``index [heads, p]`` of
    ``cos``/``sin [b, t, D]`` (transformers' rotary embedding)."""
    half = cos.shape[-1] // 2
    c = cos[..., :half][:, :, index].permute(0, 2, 1, 3)  # [b, heads, t, p]
    s = sin[..., :half][:, :, index].permute(0, 2, 1, 3)
    c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    return x * c + rotate_half(x) * s


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        H, G = config.num_attention_heads, config.num_key_value_heads
        D = getattr(config, "head_dim", None) or config.hidden_size // H
        p, L = config.mla_rope_pairs, config.kv_lora_rank
        self.heads, self.kv_heads, self.head_dim, self.rope_dim = H, G, D, 2 * p
        self.num_key_value_groups = H // G
        self.scaling = D**-0.5
        self.attention_dropout = config.attention_dropout
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.k_rope_proj = nn.Linear(hidden, G * 2 * p, bias=False)
        self.kv_a_proj = nn.Linear(hidden, L, bias=False)
        self.k_b_proj = nn.Linear(L, G * (D - 2 * p), bias=False)
        self.v_b_proj = nn.Linear(L, G * D, bias=False)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)
        self.register_buffer("rope_index", torch.zeros(G, p, dtype=torch.long))

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs
    ):
        b, t, _ = hidden_states.shape
        G, D, r = self.kv_heads, self.head_dim, self.rope_dim
        cos, sin = position_embeddings
        q = self.q_proj(hidden_states).view(b, t, -1, D).transpose(1, 2)
        q_index = self.rope_index.repeat_interleave(self.num_key_value_groups, dim=0)
        q = torch.cat((rope_pairs(q[..., :r], cos, sin, q_index), q[..., r:]), dim=-1)
        k_r = self.k_rope_proj(hidden_states).view(b, t, G, r).transpose(1, 2)
        k_r = rope_pairs(k_r, cos, sin, self.rope_index)
        c = self.kv_a_proj(hidden_states).unsqueeze(1)  # [b, 1, t, L]
        if cache is not None:
            k_r, c = cache.update(k_r, c, self.layer_idx, kwargs=kwargs)
        T = c.shape[2]
        k_n = self.k_b_proj(c[:, 0]).view(b, T, G, D - r).transpose(1, 2)
        v = self.v_b_proj(c[:, 0]).view(b, T, G, D).transpose(1, 2)
        k = torch.cat((k_r, k_n), dim=-1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            **kwargs,
        )
        return self.o_proj(out.reshape(b, t, -1).contiguous()), weights


class MLAForCausalLM(LlamaForCausalLM):
    config_class = MLAConfig

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = MLAAttention(config, i).to(layer.input_layernorm.weight.device)
        self.post_init()


__all__ = ["MLAForCausalLM"]
