"""MHA/GQA -> multi-head latent attention (MHA2MLA, Ji et al. 2025, arXiv 2502.14837).

Per layer, with KV head g's kept RoPE pairs P_g (``rope_select``) and the rows of a head
ordered ``[P_g | P_g + D/2 | the other D - 2p dims]`` (queries of group g alike, so every
q.k dot product is unchanged):

1. partial RoPE: the kept rows of W_k form ``k_rope_proj``; the others are no longer rotated;
2. joint SVD (MHA2MLA's SVD_joint) of the non-RoPE K rows and the V rows of all KV heads,
   ``[W_k,nope; W_v] = U S V^T`` ([G(D-2p) + G D, hidden]), truncated to L = d_kv G::

       kv_a_proj = V_L^T  [L, hidden]     [k_b_proj; v_b_proj] = U_L S_L  [G(D-2p) + G D, L]

3. the cache holds the latent c = x kv_a_proj^T (L values) and the rotated k_rope (2p G).

``svd=activations`` (beyond MHA2MLA) truncates where the layer's inputs live instead: with
C = E[x x^T] on calibration text and C = R R^T (Cholesky), the rank-L factorisation minimising
E||x (W - up down)^T||^2 is ``W R = U S V^T``, up = U_L S_L, down = V_L^T R^{-1}. The mla
recipe uses it: training-free on SmolLM2-135M it keeps far more of the model than the
weight-space SVD (``python eval/bench/attn_ablation.py rope_select --svd activations``).

At full rank (L = rank of the stacked matrix) with every pair kept the model is the source.
"""

import torch

from compress.arch.adapters import get_adapter
from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.formats.attention import MLAConfig, MLAForCausalLM, converted_config
from compress.methods.attn.calib import InputGram, attention_inputs
from compress.methods.attn.rope_select import PairNorms, check_pairs, select_pairs


def full_rank(config, pairs: int) -> int:
    """The largest useful ``mla.d_kv``: per KV head 2D - 2p rows, at most hidden / G overall."""
    spec = spec_of(config)
    return min(2 * spec.head_dim - 2 * pairs, spec.hidden_size // spec.n_kv_heads)


SVDS = ("weights", "activations")


def check_mla(config, d_kv: int, pairs: int, method: str, svd: str = "weights") -> None:
    check_pairs(config, pairs, method)
    if svd not in SVDS:
        raise CompressError(f"mla.svd={svd!r}: use one of {', '.join(SVDS)}.")
    top = full_rank(config, pairs)
    if not 1 <= d_kv <= top:
        raise CompressError(
            f"mla.d_kv={d_kv}: the joint K/V matrix of a KV head has full rank "
            f"{top} here (2 x head_dim - 2 x rope_pairs, at most hidden / KV "
            f"heads); use 1..{top}."
        )
    if spec_of(config).qkv_bias:
        raise CompressError(
            "mla converts attention without q/k/v biases (Llama, Mistral); this "
            "model has biases. Use the gqa or cla recipe for it."
        )


def head_order(index: torch.Tensor, D: int) -> torch.Tensor:
    """``[G, D]`` row order of each KV head: kept pairs (x1 then x2), then the rest."""
    order = []
    for pairs in index.tolist():
        rope = pairs + [j + D // 2 for j in pairs]
        order.append(rope + [d for d in range(D) if d not in set(rope)])
    return torch.tensor(order)


def low_rank(w: torch.Tensor, rank: int, gram: torch.Tensor | None = None, damp: float = 1e-6):
    """``(up [out, rank], down [rank, in])`` minimising ||w - up down|| (float64), in the
    input metric ``gram`` = E[x x^T] if given."""
    if gram is None:
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        return U[:, :rank] * S[:rank], Vh[:rank]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    R = torch.linalg.cholesky(gram + damp * gram.diagonal().mean() * eye)
    U, S, Vh = torch.linalg.svd(w @ R, full_matrices=False)
    down = torch.linalg.solve_triangular(R, Vh[:rank], upper=False, left=False)  # V_L^T R^-1
    return U[:, :rank] * S[:rank], down


def mla_layer(
    wq, wk, wv, index: torch.Tensor, rank: int, H: int, gram: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The MLA projections of one layer from ``q_proj``/``k_proj``/``v_proj`` weights
    (``gram``: E[x x^T] of its input for ``svd=activations``)."""
    G, p = index.shape
    D = wk.shape[0] // G
    order = head_order(index, D)
    q_rows = (order.repeat_interleave(H // G, 0) + D * torch.arange(H)[:, None]).flatten()
    k_rows = order + D * torch.arange(G)[:, None]
    kv = torch.cat((wk[k_rows[:, 2 * p :].flatten()], wv)).double()
    up, down = low_rank(kv, rank, gram)
    up = up.to(wk.dtype)
    return {
        "q_proj.weight": wq[q_rows],
        "k_rope_proj.weight": wk[k_rows[:, : 2 * p].flatten()],
        "kv_a_proj.weight": down.to(wk.dtype),
        "k_b_proj.weight": up[: G * (D - 2 * p)],
        "v_b_proj.weight": up[G * (D - 2 * p) :],
        "rope_index": index.clone(),
    }


def convert_mla(
    model,
    d_kv: int = 16,
    rope_pairs: int = 4,
    rope_select: str = "2norm",
    tokens: torch.Tensor | None = None,
    svd: str = "weights",
):
    """An ``MLAForCausalLM`` from ``model``; ``tokens`` (calibration) for ``2norm`` and
    ``svd=activations``."""

    config = model.config
    check_mla(config, d_kv, rope_pairs, rope_select, svd)
    norms = PairNorms(model) if rope_select == "2norm" else None
    grams = InputGram() if svd == "activations" else None
    if norms or grams:
        attention_inputs(model, tokens, *[v for v in (norms, grams) if v])
    index = select_pairs(config, rope_pairs, rope_select, norms.scores() if norms else None)
    grams = grams.grams() if grams else None
    adapter = get_adapter(config)
    H, G = config.num_attention_heads, config.num_key_value_heads
    state = model.state_dict()
    for i, layer in enumerate(adapter.decoder_layers(model)):
        prefix = f"{adapter.layers}.{i}.{adapter.attn}."
        w = {r: adapter.linear(layer, r).weight.detach() for r in ("q", "k", "v")}
        for r in ("q", "k", "v"):
            state.pop(f"{adapter.layers}.{i}.{dict(adapter.linears)[r]}.weight")
        gram = grams[i] if grams else None
        for name, t in mla_layer(w["q"], w["k"], w["v"], index[i], d_kv * G, H, gram).items():
            state[prefix + name] = t
    mla_config = converted_config(
        MLAConfig, config, mla_rope_pairs=rope_pairs, kv_lora_rank=d_kv * G, mla_d_kv=d_kv
    )
    out = MLAForCausalLM(mla_config).to(next(model.parameters()).dtype)
    out.load_state_dict(state, strict=True)
    return out.eval()
