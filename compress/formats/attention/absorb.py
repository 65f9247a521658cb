"""MLA's two ways to attend over the cached latent c [T, L] (``modeling_mla`` names).

Expanded (prefill): per KV head g, K_g = [k_r,g | c W_kb,g^T] and V_g = c W_vb,g^T, with
W_kb,g = ``k_b_proj.weight[g n:(g+1) n]`` [n, L] and W_vb,g = ``v_b_proj.weight[g D:(g+1) D]``
[D, L], then ordinary attention and ``o_proj``.

Absorbed (decode, nothing expanded per token), for query head h of group g:

    q_lat,h = q_n,h W_kb,g                               [L]   so q_n,h . k_n,g(t) = q_lat,h . c(t)
    score   = (q_r,h . k_r,g(t) + q_lat,h . c(t)) / sqrt(D)
    u_h     = sum_t softmax(score)(t) c(t)               [L]
    y       = sum_h u_h W_ol,h^T,   W_ol,h = W_o[:, h D:(h+1) D] W_vb,g      [hidden, L]
"""

import torch


def expand_kv(c: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor, kv_heads: int):
    """``(k_nope [.., G, T, n], v [.., G, T, D])`` from the latent ``c [.., T, L]``."""
    k = (c @ k_b.T).unflatten(-1, (kv_heads, -1)).transpose(-2, -3)
    v = (c @ v_b.T).unflatten(-1, (kv_heads, -1)).transpose(-2, -3)
    return k, v


def absorb_query(q_nope: torch.Tensor, k_b: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q_lat [.., H, t, L]`` from ``q_nope [.., H, t, n]``: each head times its W_kb,g."""
    H = q_nope.shape[-3]
    w = k_b.view(kv_heads, -1, k_b.shape[-1]).repeat_interleave(H // kv_heads, 0)  # [H, n, L]
    return q_nope @ w


def absorb_output(o_proj: torch.Tensor, v_b: torch.Tensor, heads: int) -> torch.Tensor:
    """``W_ol [hidden, H * L]``: y = u.flatten(heads) @ W_ol^T replaces v_b and o_proj."""
    hidden, L = o_proj.shape[0], v_b.shape[1]
    G = v_b.shape[0] // (o_proj.shape[1] // heads)
    wo = o_proj.view(hidden, heads, -1).transpose(0, 1)  # [H, hidden, D]
    wv = v_b.view(G, -1, L).repeat_interleave(heads // G, 0)  # [H, D, L]
    return (wo @ wv).transpose(0, 1).reshape(hidden, heads * L)
