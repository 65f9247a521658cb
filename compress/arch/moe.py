"""The MLP as experts: a frozen :class:`MoESpec`, read from an HF config with its family's entry.

A sparse layer's MLP routes each token x (a row of the MLP's input) to ``top_k`` of
``n_experts`` gated MLPs and sums their outputs, weighted by the router::

    logits = W_r x                                   W_r [n_experts, hidden] (``mlp.gate.weight``)
    p = softmax(logits)                              in fp32
    (w, e) = top_k(p)                                the k largest p and their experts
    w <- w / sum(w)                                  "topk_softmax" always (Mixtral: this is the
                                                     softmax over the top-k logits); "softmax_topk"
                                                     only with norm_topk_prob
    y = sum_j w_j * down_e_j(act(gate_e_j(x)) * up_e_j(x))
      + sigmoid(g . x) * shared(x)                   qwen2_moe's shared expert, gated by g
                                                     (``shared_expert_gate``)
      + shared(x)                                    deepseek_v3's shared experts (ungated, one
                                                     MLP of n_shared_experts x the expert width)

DeepSeek V3's router ("sigmoid_group", the DeepSeek-V3 report's eqs. 12-16) scores with a
sigmoid and chooses with a bias it adds for load balancing only, among the best groups::

    s = sigmoid(W_r x)                               fp32 (the router's weight is kept in fp32)
    c = s + b                                        b = ``mlp.gate.e_score_correction_bias``
    group score = sum of the 2 largest c in each of the n_group groups of E / n_group experts
    e = top_k(c) among the experts of the topk_group best groups
    w = s[e]; w <- w / (sum(w) + 1e-20) if norm_topk_prob; w <- routed_scaling_factor * w

gpt-oss's router ("biased_topk_softmax") has a bias and takes the softmax over the top-k
logits, in the activations' dtype; its experts carry biases and compute the clamped SwiGLU
(``swiglu_limit`` L, ``swiglu_alpha`` a)::

    logits = W_r x + b_r;  (v, e) = top_k(logits);  w = softmax(v)
    g = min(gate_e(x) + bg_e, L);  u = clamp(up_e(x) + bu_e, -L, L)
    f_e(x) = down_e((u + 1) * g * sigmoid(a * g)) + bd_e

The other router kinds differ in their dtype order too: "softmax_topk" (qwen2_moe, qwen3_moe,
olmoe) rounds w to the activations' dtype before the product; "topk_softmax" (mixtral) keeps w
in fp32, multiplies in fp32 and rounds the product. Layers are dense or sparse per config:
qwen2_moe and qwen3_moe make layer i dense when it is in ``mlp_only_layers`` or when
``(i + 1) % decoder_sparse_step != 0``; deepseek_v3's first ``first_k_dense_replace`` layers
are dense; mixtral and olmoe have no dense layers.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

SOFTMAX_TOPK, TOPK_SOFTMAX = "softmax_topk", "topk_softmax"  # the router kinds (docstring)
SIGMOID_GROUP = "sigmoid_group"  # DeepSeek V3's grouped sigmoid router (docstring)
BIASED_TOPK = "biased_topk_softmax"  # gpt-oss's router (docstring)
ROUTERS = (SOFTMAX_TOPK, TOPK_SOFTMAX, SIGMOID_GROUP, BIASED_TOPK)
DENSE, EXPERTS = "dense", "experts"


@dataclass(frozen=True)
class MoESpec:
    """A sparse layer's MLP (see the module docstring)."""

    n_experts: int
    top_k: int
    router: str  # one of ROUTERS
    norm_topk: bool  # w renormalized over the top k (always for "topk_softmax")
    intermediate_size: int  # each expert's width
    shared_intermediate_size: int | None = (
        None  # the shared expert's width (qwen2_moe, deepseek_v3)
    )
    shared_gated: bool = True  # sigmoid(shared_expert_gate(x)) weighs it (qwen2_moe), or not
    n_group: int = 1  # sigmoid_group: expert groups, of which topk_group are chosen from
    topk_group: int = 1
    routed_scale: float = 1.0  # sigmoid_group: routed_scaling_factor
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    swiglu_limit: float | None = None  # the clamped SwiGLU's L (gpt-oss); None: act(gate) * up
    swiglu_alpha: float = 1.0  # the clamped SwiGLU's a


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def moe_of(config, adapter, n_layers: int, refuse: Callable) -> tuple[MoESpec | None, tuple]:
    """``(MoESpec or None, the MLP kind of each layer: "dense" or "experts")``; ``refuse(config,
    problem, fix)`` raises for a field that does not fit (before any weight is read)."""
    if adapter.router is None:
        return None, (DENSE,) * n_layers
    if adapter.router not in ROUTERS:
        refuse(
            config,
            f"is read by a family entry with router kind '{adapter.router}'",
            f"the decoder routes {' and '.join(ROUTERS)}; set Adapter.router in "
            f"compress/arch/adapters.py to one of them or add the router to compress/arch/moe.py.",
        )
    E = getattr(config, adapter.experts_field, None)
    if not _count(E) or E < 1:
        refuse(
            config,
            f"has {adapter.experts_field}={E!r}",
            "a mixture of experts needs a whole number >= 1 of experts.",
        )
    k = getattr(config, "num_experts_per_tok", None)
    if not _count(k) or not 1 <= k <= E:
        refuse(
            config,
            f"routes each token to num_experts_per_tok={k!r} of {E} experts",
            f"set num_experts_per_tok to a whole number from 1 to {adapter.experts_field}={E}.",
        )
    width = getattr(config, adapter.expert_size_field, None)
    if not _count(width) or width < 1:
        refuse(
            config,
            f"has {adapter.expert_size_field}={width!r}",
            "each expert's intermediate size must be a whole number >= 1.",
        )
    shared = None
    if adapter.shared_expert == "gated":
        shared = getattr(config, "shared_expert_intermediate_size", None)
        if not _count(shared) or shared < 1:
            refuse(
                config,
                f"has shared_expert_intermediate_size={shared!r}",
                "the shared expert's intermediate size must be a whole number >= 1.",
            )
    elif adapter.shared_expert:  # n_shared_experts experts of the routed width, as one MLP
        n = getattr(config, "n_shared_experts", None)
        if n is not None and (not _count(n) or n < 0):
            refuse(config, f"has n_shared_experts={n!r}", "set it to a whole number >= 0.")
        shared = width * n if n else None
    groups = _groups(config, adapter, E, k, refuse)
    kinds = [EXPERTS] * n_layers
    if adapter.sparse_step:
        step = getattr(config, "decoder_sparse_step", 1)
        if not _count(step) or step < 1:
            refuse(
                config,
                f"has decoder_sparse_step={step!r}",
                "set it to a whole number >= 1 (every step-th layer is sparse).",
            )
        only = list(getattr(config, "mlp_only_layers", None) or [])
        bad = [i for i in only if not _count(i) or not 0 <= i < n_layers]
        if bad:
            refuse(
                config,
                f"lists mlp_only_layers {bad}, which are not layers 0..{n_layers - 1}",
                "list only the model's layers there.",
            )
        kinds = [DENSE if i in only or (i + 1) % step else EXPERTS for i in range(n_layers)]
    if adapter.dense_first:
        first = getattr(config, adapter.dense_first, 0)
        if not _count(first) or not 0 <= first <= n_layers:
            refuse(
                config,
                f"has {adapter.dense_first}={first!r}",
                f"set it to the number of leading dense layers, 0..{n_layers}.",
            )
        kinds = [DENSE] * first + [EXPERTS] * (n_layers - first)
    renorm = adapter.router in (TOPK_SOFTMAX, BIASED_TOPK) or bool(
        getattr(config, "norm_topk_prob", False)
    )
    spec = MoESpec(
        n_experts=E,
        top_k=k,
        router=adapter.router,
        norm_topk=renorm,
        intermediate_size=width,
        shared_intermediate_size=shared,
        shared_gated=adapter.shared_expert == "gated",
        expert_bias=adapter.expert_bias,
        **groups,
        **_clamped_swiglu(config, adapter, refuse),
    )
    return spec, tuple(kinds)


def _clamped_swiglu(config, adapter, refuse: Callable) -> dict:
    """gpt-oss's swiglu_limit and swiglu_alpha (empty for the plain gated MLP), checked."""
    if adapter.expert_glu != "clamped_swiglu":
        return {}
    out = {}
    for field in ("swiglu_limit", "swiglu_alpha"):
        value = getattr(config, field, None)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            refuse(config, f"has {field}={value!r}", f"set {field} to a finite number > 0.")
        out[field] = float(value)
    return out


def _groups(config, adapter, E: int, k: int, refuse: Callable) -> dict:
    """The sigmoid_group router's fields (empty for the other kinds), checked."""
    if adapter.router != SIGMOID_GROUP:
        return {}
    n_group = getattr(config, "n_group", None) or 1
    topk_group = getattr(config, "topk_group", None) or 1
    scale = getattr(config, "routed_scaling_factor", 1.0)
    if not _count(n_group) or n_group < 1 or E % n_group or E // n_group < 2:
        refuse(
            config,
            f"splits {E} experts into n_group={n_group!r} groups",
            "n_group must divide the expert count into groups of at least 2 (a group scores "
            "by its two best experts).",
        )
    if not _count(topk_group) or not 1 <= topk_group <= n_group:
        refuse(
            config,
            f"chooses topk_group={topk_group!r} of {n_group} groups",
            f"set topk_group to a whole number from 1 to n_group={n_group}.",
        )
    if k > topk_group * (E // n_group):
        refuse(
            config,
            f"routes each token to {k} experts among topk_group={topk_group} groups of "
            f"{E // n_group}",
            "num_experts_per_tok must be at most topk_group x experts per group.",
        )
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        refuse(config, f"has routed_scaling_factor={scale!r}", "set it to a finite number > 0.")
    return dict(n_group=n_group, topk_group=topk_group, routed_scale=float(scale))
