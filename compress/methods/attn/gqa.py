"""GQA/MQA from an MHA or GQA checkpoint by mean-pooling K/V heads (Ainslie et al. 2023,
arXiv 2305.13245), after aligning the heads (``align_heads``, ``attn.gqa_init=aligned``).

With G KV heads of dim D pooled into K groups of r = G / K consecutive heads (query head h,
which used KV head h // (H / G), then uses group h // (H / K) -- the same heads)::

    W'_k[j] = (1 / r) sum_{i < r} W_k[j r + i]        W_k[g]: the D rows of KV head g
    W'_v[j] = (1 / r) sum_{i < r} W_v[j r + i]        (biases alike)

The result is a model of the source's own family with ``num_key_value_heads = K``. Per-head
k-norms (Qwen3, Gemma 3; head_dim wide, shared by the heads) are kept: the pooled key is
``k_norm(W'_k x)``, the re-normalized mean of the group's pre-norm keys (see
``compress.methods.attn.checks`` for why that is as meaningful an initialisation as plain pooling).
Each layer keeps its window and RoPE (Gemma's local/global pattern).

Alignment (mha2gqa, fpcsong/mha2gqa): heads are near-orthogonal, so the mean of r of them keeps
about 1/sqrt(r) of a key's length and attention goes uniform. Before pooling, each KV head g of
a group is turned to the group's first head (its reference ``f``) by transforms the layer's
output does not see, computed from the layer inputs' moments ``S = E[[x, 1][x, 1]^T]`` on
calibration text (``W``: a head's rows, with its bias as a last column)::

    V:  R_g = U V^T,  U S' V^T = svd(W_v,g S W_v,f^T)     W_v,g <- R_g^T W_v,g,  O_h <- O_h R_g
    K:  per RoPE plane j (dims j, j + D/2), the 2x2 rotation R_j(t_j) with
        t_j = atan2(M_10 - M_01, M_00 + M_11),  M = (W_k,g S W_k,f^T)[plane j]
        W_k,g <- R^T W_k,g,  W_q,h <- R^T W_q,h for the query heads h of g

(O_h: o_proj's columns of query head h. A 2x2 rotation commutes with RoPE's rotation of its
plane, and q R R^T k^T = q k^T, so the aligned model is the source exactly.) The heads are
grouped by similarity: each group's first head is the first not yet grouped, joined by the r - 1
most similar others, ``sim(a, b) = ||W_a S W_b^T||_* / sqrt(tr(W_a S W_a^T) tr(W_b S W_b^T))``
over K and V (the part Procrustes can align); groups are made consecutive by permuting KV heads
with their query heads (q rows, o columns). After pooling, the pooled key is scaled so that its
mean square equals the group's mean ``mean_g tr(W_k,g S W_k,g^T)``. With per-head k-norms the
keys are not turned (the norm's weight is per channel) nor rescaled (the norm sets the scale).
"""

import math

import torch
from torch import nn

from compress.arch.adapters import get_adapter, head_dim, set_module
from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.methods.attn.calib import InputGram, attention_inputs
from compress.methods.attn.cla import projection

INITS = ("aligned", "mean")


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


def input_moments(model, tokens: torch.Tensor, bias: bool) -> list[torch.Tensor]:
    """Each layer's ``E[[x, 1][x, 1]^T]`` (float64; ``[x]`` alone without biases) on ``tokens``."""
    grams = InputGram(bias)
    attention_inputs(model, tokens, grams)
    return grams.grams()


def _heads(w: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(w.double().view(n, -1, w.shape[-1]))


def _similarity(ks, vs, gram) -> torch.Tensor:
    """``[G, G]``: the Procrustes similarity of the heads' keys plus that of their values."""
    G = len(ks)
    sim = torch.zeros(G, G, dtype=torch.float64)
    for ws in (ks, vs):
        energy = [torch.trace(w @ gram @ w.T) for w in ws]
        for a in range(G):
            for b in range(G):
                nuclear = torch.linalg.matrix_norm(ws[a] @ gram @ ws[b].T, ord="nuc")
                sim[a, b] += nuclear / (energy[a] * energy[b]).sqrt().clamp_min(1e-30)
    return sim


def similarity_groups(sim: torch.Tensor, size: int) -> list[list[int]]:
    """Groups of ``size`` heads: the first head not yet grouped and its ``size - 1`` most
    similar others."""
    left, groups = list(range(sim.shape[0])), []
    while left:
        first = left.pop(0)
        near = sorted(left, key=lambda b: -float(sim[first, b]))[: size - 1]
        left = [b for b in left if b not in near]
        groups.append([first, *near])
    return groups


def _plane_rotation(m: torch.Tensor) -> torch.Tensor:
    """The 2x2 rotation R maximizing tr(R^T m)."""
    t = math.atan2(float(m[1, 0] - m[0, 1]), float(m[0, 0] + m[1, 1]))
    c, s = math.cos(t), math.sin(t)
    return torch.tensor([[c, -s], [s, c]], dtype=torch.float64)


def key_rotation(wk: torch.Tensor, wf: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``[D, D]``: per RoPE plane (half-split), the rotation turning head ``wk``'s keys to
    ``wf``'s."""
    D = wk.shape[0]
    cross = wk @ gram @ wf.T
    r = torch.zeros(D, D, dtype=torch.float64)
    for j in range(D // 2):
        idx = torch.tensor([j, j + D // 2])
        r[idx[:, None], idx[None, :]] = _plane_rotation(cross[idx][:, idx])
    return r


def value_rotation(wv: torch.Tensor, wf: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``[D, D]``: the orthogonal R minimizing ``||V_g R - V_f||`` (Procrustes)."""
    u, _, vh = torch.linalg.svd(wv @ gram @ wf.T)
    return u @ vh


def _set(linear: nn.Linear, aug: torch.Tensor) -> None:
    """Write ``[out, in(+1)]`` (the bias as a last column) into ``linear``."""
    with torch.no_grad():
        w = aug[:, : linear.in_features] if linear.bias is not None else aug
        linear.weight.copy_(w.to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_(aug[:, -1].to(linear.bias.dtype))


def align_heads(model, kv_heads: int, grams: list[torch.Tensor]) -> list[float]:
    """Permute and turn each layer's KV heads (with their query heads) so that each group of
    ``G / kv_heads`` consecutive heads is aligned to its first (the module docstring); the
    model computes what it did. Returns each layer's key-norm factor for pooling (1 with k-norms)."""
    config = model.config
    G, H, D = config.num_key_value_heads, config.num_attention_heads, head_dim(config)
    rep, size = H // G, G // kv_heads
    adapter = get_adapter(config)
    turn_keys = not spec_of(config).qk_norm
    scales = []
    for layer, gram in zip(adapter.decoder_layers(model), grams, strict=True):
        lin = {role: adapter.linear(layer, role) for role in "qkvo"}
        wq, wk, wv = (projection(lin[r]).double() for r in "qkv")
        wo = lin["o"].weight.detach().double()  # [hidden, H D]; its bias stays
        ks, vs = _heads(wk, G), _heads(wv, G)
        qs = _heads(wq, H)
        os_ = list(wo.view(wo.shape[0], H, D).permute(1, 0, 2))  # [H][hidden, D]
        order = [g for group in similarity_groups(_similarity(ks, vs, gram), size) for g in group]
        ks, vs = [ks[g] for g in order], [vs[g] for g in order]
        qs = [qs[g * rep + i] for g in order for i in range(rep)]
        os_ = [os_[g * rep + i] for g in order for i in range(rep)]
        for f in range(0, G, size):
            for g in range(f + 1, f + size):
                rv = value_rotation(vs[g], vs[f], gram)
                vs[g] = rv.T @ vs[g]
                rk = key_rotation(ks[g], ks[f], gram) if turn_keys else None
                if rk is not None:
                    ks[g] = rk.T @ ks[g]
                for h in range(g * rep, (g + 1) * rep):
                    os_[h] = os_[h] @ rv
                    if rk is not None:
                        qs[h] = rk.T @ qs[h]
        energy = torch.stack([torch.trace(k @ gram @ k.T) for k in ks]).view(kv_heads, size)
        pooled = torch.stack(ks).view(kv_heads, size, D, -1).mean(1)
        pooled_energy = torch.stack([torch.trace(k @ gram @ k.T) for k in pooled])
        ratio = (energy.mean(1) / pooled_energy.clamp_min(1e-30)).mean()
        scales.append(float(ratio.sqrt()) if turn_keys else 1.0)
        _set(lin["q"], torch.cat(qs))
        _set(lin["k"], torch.cat(ks))
        _set(lin["v"], torch.cat(vs))
        with torch.no_grad():
            lin["o"].weight.copy_(torch.stack(os_).permute(1, 0, 2).reshape(wo.shape))
    return scales


def aligned_pool_kv(model, kv_heads: int, tokens: torch.Tensor):
    """Align (``align_heads``), mean-pool to ``kv_heads``, and restore each layer's key norm."""
    config = model.config
    check_kv_heads(config, kv_heads)
    adapter = get_adapter(config)
    bias = adapter.linear(adapter.decoder_layers(model)[0], "k").bias is not None
    scales = align_heads(model, kv_heads, input_moments(model, tokens, bias))
    mean_pool_kv(model, kv_heads)
    for layer, s in zip(adapter.decoder_layers(model), scales, strict=True):
        k = adapter.linear(layer, "k")
        with torch.no_grad():
            k.weight.mul_(s)
            if k.bias is not None:
                k.bias.mul_(s)
    return model
