"""GQA/MQA from an MHA or GQA checkpoint by mean-pooling K/V heads (Ainslie et al. 2023,
arXiv 2305.13245).

With G KV heads of dim D pooled into K groups of r = G / K consecutive heads (query head h,
which used KV head h // (H / G), then uses group h // (H / K) -- the same heads)::

    W'_k[j] = (1 / r) sum_{i < r} W_k[j r + i]        W_k[g]: the D rows of KV head g
    W'_v[j] = (1 / r) sum_{i < r} W_v[j r + i]        (biases alike)

The result is a model of the source's own family with ``num_key_value_heads = K``. Per-head
k-norms (Qwen3, Gemma 3; head_dim wide, shared by the heads) are kept: the pooled key is
``k_norm(W'_k x)``, the re-normalized mean of the group's pre-norm keys (see
``compress.methods.attn.checks`` for why that is as meaningful an initialisation as plain pooling).
Each layer keeps its window and RoPE (Gemma's local/global pattern).
"""

import torch
from torch import nn

from compress.arch.adapters import get_adapter, head_dim, set_module
from compress.errors import CompressError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_kv_heads(config, kv_heads: int) -> None:
    G, H = config.num_key_value_heads, config.num_attention_heads
    if kv_heads < 1 or H % kv_heads or G % kv_heads:
        raise CompressError(
            f"attn.kv_heads={kv_heads}: mean-pooling merges groups of this model's {G} KV heads "
            f"({H} query heads), so kv_heads must divide {G}; valid values: "
            f"{', '.join(map(str, divisors(G)))}."
        )


def pool_heads(linear: nn.Linear, heads: int, groups: int, head_dim: int) -> nn.Linear:
    """A linear whose ``groups`` output heads are the means of consecutive input-head groups."""
    out = nn.Linear(
        linear.in_features,
        groups * head_dim,
        bias=linear.bias is not None,
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    with torch.no_grad():
        w = linear.weight.view(groups, heads // groups, head_dim, -1).mean(1)
        out.weight.copy_(w.reshape(groups * head_dim, -1))
        if linear.bias is not None:
            out.bias.copy_(linear.bias.view(groups, heads // groups, head_dim).mean(1).flatten())
    return out


def mean_pool_kv(model, kv_heads: int):
    """Pool ``model``'s K/V heads in place down to ``kv_heads``; returns the model."""
    config = model.config
    check_kv_heads(config, kv_heads)
    G, H = config.num_key_value_heads, config.num_attention_heads
    D = head_dim(config)
    adapter = get_adapter(config)
    for layer in adapter.decoder_layers(model):
        for role in ("k", "v"):
            path = dict(adapter.linears)[role]
            set_module(layer, path, pool_heads(adapter.linear(layer, role), G, kv_heads, D))
        layer.get_submodule(adapter.attn).num_key_value_groups = H // kv_heads
    config.num_key_value_heads = kv_heads
    return model
