"""The architecture spec: one frozen description of a decoder-only model, built once from an HF config.

``spec_of(config)`` reads the config together with its family's entry (``compress.arch.adapters``)
and checks, before any weight is read, that the decoder can run it. Everything downstream (the
decoder's one forward, its caches, the methods) reads the spec, never the raw config::

    spec.layers[i].window        None (global attention) or w: the query at position p sees the
                                 keys at positions p - w < k <= p (transformers' sliding window)
    spec.layers[i].rope          the layer's RoPE parameters (Gemma 3: local theta 10k, global 1M
                                 with its own scaling); spec.layers[i].kind the HF layer type
    spec.norm_offset             RMSNorm weight (offset + w): 0 (Llama), 1 (Gemma's (1 + w))
    spec.sandwich                norms after attention and MLP too (Gemma 3's four per block)
    spec.qk_norm                 per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    spec.qk_norm_full            those norms span the whole q and k projections (OLMoE)
    spec.latent                  None, or DeepSeek V3's latent attention (:class:`LatentSpec`:
                                 q_lora_rank, kv_lora_rank, the nope / rope / v head widths,
                                 interleaved RoPE); spec.head_dim is then the RoPE width
    spec.moe                     None (dense), or the experts of the sparse layers
                                 (``compress.arch.moe.MoESpec``: count, top-k, router kind,
                                 expert width, shared expert); spec.layers[i].mlp "dense" or
                                 "experts"
    spec.sinks                   attention sinks: a learned logit per query head in every layer's
                                 attention weights, a key whose value is 0 (gpt-oss)
    spec.activation              "silu", "gelu_tanh" or "gelu" of the gated MLP
    spec.embed_scale             None, or the factor the embeddings are multiplied by (Gemma:
                                 sqrt(hidden), rounded to the embedding's dtype as transformers does)
    spec.attn_scale              the attention scale of q K^T (Gemma: query_pre_attn_scalar**-0.5, else
                                 head_dim**-0.5)
    spec.final_softcap           None, or c: logits = c * tanh(logits / c) (Gemma 2 style)
    spec.adapter                 the family entry: module names of the checkpoint
    spec.head_dim                the width of one attention head (``arch.adapters.head_dim``, the
                                 one formula: config.head_dim, else hidden_size / heads)
    spec.vocab_size, spec.max_positions, spec.eos_ids, spec.n_layers   the runtime's sizes and stops

Sliding windows are read the same way for every family: ``config.layer_types`` (qwen2, qwen3,
gemma3_text) gives each layer "sliding_attention" (window ``config.sliding_window``) or
"full_attention"; without it (mistral) ``config.sliding_window`` applies to every layer unless
``use_sliding_window`` is false. RoPE parameters come from ``config.rope_parameters``: keyed by
layer type (Gemma 3) or one dict for all layers.
"""

import math
from dataclasses import dataclass, replace

from compress.arch.adapters import Adapter, get_adapter, head_dim
from compress.arch.moe import DENSE, MoESpec, moe_of
from compress.errors import CompressError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its attention and position encoding."""

    index: int
    # "gqa", "cla" (reads another layer's K/V), "mla" (latent), or a kind a method registers
    # with the decoder and sets with ArchSpec.with_attention (IAM's "mapped")
    attention: str
    kind: str  # the HF layer type: "full_attention" or "sliding_attention"
    window: int | None  # sliding window in tokens; None: global
    rope: tuple  # the RoPE parameters as sorted (key, value) pairs; rope_parameters() as a dict
    kv_slot: int  # the cache slot it reads (CLA: the first layer of its group's)
    writes_kv: bool  # it projects and caches K/V (CLA: only a group's first layer)
    mlp: str = DENSE  # "dense" (a gated MLP) or "experts" (the spec's MoESpec)

    def rope_parameters(self) -> dict:
        return dict(self.rope)


@dataclass(frozen=True)
class LatentSpec:
    """DeepSeek V2/V3 multi-head latent attention (``compress.decoder.model.DeepSeekAttention``).

    Per token x: q_h = [q_nope,h | q_rope,h] = (W_q x)_h, or W_qb RMSNorm(W_qa x) with q_lora_rank;
    [c | k_rope] = W_kva x, c <- RMSNorm(c) (kv_lora_rank channels, ``kv_a_layernorm``), k_rope one
    RoPE key of ``rope`` channels shared by all heads; [k_nope,h | v_h] = (W_kvb c)_h. The score is
    (q_nope,h . k_nope,h + rope(q_rope,h) . rope(k_rope)) * scale. ``interleave``: the RoPE
    channels pair (0, 1), (2, 3) ... (DeepSeek's checkpoints) instead of (i, i + rope/2).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    interleave: bool


@dataclass(frozen=True)
class ArchSpec:
    """Every architectural fact the decoder and the methods need (see the module docstring)."""

    family: str
    adapter: Adapter
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    norm_offset: float
    sandwich: bool
    qk_norm: bool
    activation: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    embed_scale: float | None
    attn_scale: float
    final_softcap: float | None
    tied: bool
    max_positions: int | None
    layers: tuple[LayerSpec, ...]
    eos_ids: tuple[int, ...] = ()  # config.eos_token_id: one id, a list, or none
    mla_rope_pairs: int | None = None  # latent attention (compress_mla)
    kv_lora_rank: int | None = None
    qk_norm_full: bool = False  # q/k norms over the whole projection (OLMoE), not per head
    moe: MoESpec | None = None  # the sparse layers' experts (compress.arch.moe)
    latent: LatentSpec | None = None  # DeepSeek's latent attention
    sinks: bool = False  # attention sinks (gpt-oss)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_slots(self) -> int:
        """KV cache slots: layers that write K/V (CLA shares one slot per group)."""
        return max(layer.kv_slot for layer in self.layers) + 1

    def slot_windows(self) -> list[int | None]:
        """The sliding window of each KV cache slot (None: global)."""
        out = [None] * self.n_slots
        for layer in self.layers:
            out[layer.kv_slot] = layer.window
        return out

    @property
    def windowed(self) -> bool:
        """Some layer attends within a sliding window."""
        return any(layer.window is not None for layer in self.layers)

    def with_attention(self, kinds: dict[int, str]) -> "ArchSpec":
        """This spec with layer ``i``'s attention of kind ``kinds[i]``: how a method builds its own
        attention into some layers (IAM: ``compress.methods.iam.attention``) without touching the
        HF config, from which the rest of the spec came."""
        bad = [i for i in kinds if not (isinstance(i, int) and 0 <= i < self.n_layers)]
        if bad:
            raise CompressError(
                f"attention kinds given for layers {bad}; the model has layers "
                f"0..{self.n_layers - 1}."
            )
        layers = tuple(
            replace(ls, attention=kinds.get(ls.index, ls.attention)) for ls in self.layers
        )
        return replace(self, layers=layers)

    def rope_groups(self) -> list[tuple]:
        """The distinct RoPE parameter sets, in order of first use (one cos/sin table each)."""
        out = []
        for layer in self.layers:
            if layer.rope not in out:
                out.append(layer.rope)
        return out


def _frozen(d: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _refuse(config, problem: str, fix: str):
    raise CompressError(
        f"the '{config.model_type}' config {problem}, which compress's decoder cannot run; {fix}"
    )


def _layer_kinds(config, n: int) -> list[tuple[str, int | None]]:
    """``(layer type, window)`` per layer, read as the module docstring says."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        on = window is not None and getattr(config, "use_sliding_window", True)
        types = ["sliding_attention" if on else "full_attention"] * n
    if len(types) != n:
        _refuse(config, f"lists {len(types)} layer_types for {n} layers", "fix config.json.")
    out = []
    for t in types:
        if t not in LAYER_TYPES:
            _refuse(
                config,
                f"has layer type '{t}'",
                f"the decoder runs {' and '.join(LAYER_TYPES)} layers.",
            )
        w = window if t == "sliding_attention" else None
        if t == "sliding_attention" and (w is None or int(w) < 1):
            _refuse(
                config,
                f"has sliding-attention layers with sliding_window={window}",
                "set sliding_window to a positive number of tokens.",
            )
        out.append((t, None if w is None else int(w)))
    return out


def _rope_of(config, kind: str, head_dim: int) -> tuple:
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params or any(t in params for t in LAYER_TYPES):
        params = params.get(kind) or {}
    params = dict(params)
    if "rope_theta" not in params:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            _refuse(config, "gives no rope_theta", "set rope_parameters.rope_theta.")
        params["rope_theta"] = theta
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
        _refuse(
            config,
            f"has rope_theta={theta!r}",
            "RoPE's base must be a finite number > 0 (10000 to 1e6 in most models).",
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        _refuse(
            config,
            f"asks for RoPE type '{rope_type}'",
            f"the decoder computes {', '.join(ROPE_TYPES)}.",
        )
    params["rope_type"] = rope_type
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings")
        if not _whole(orig):
            _refuse(
                config,
                f"asks for YaRN with original_max_position_embeddings={orig!r}",
                "set it to the context length the model was pretrained at.",
            )
        if params.get("factor") is None:  # DeepSeek V3: the ratio of the two lengths
            params["factor"] = config.max_position_embeddings / orig
        if not isinstance(params["factor"], int | float) or params["factor"] <= 0:
            _refuse(config, f"has YaRN factor={params['factor']!r}", "set a factor > 0.")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _refuse(config, f"rotates {partial} of each head", "the decoder rotates whole heads only.")
    if head_dim % 2:
        _refuse(config, f"has odd head_dim={head_dim}", "RoPE needs an even head width.")
    return _frozen(params)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _latent_of(config) -> LatentSpec:
    q_lora = getattr(config, "q_lora_rank", None)
    fields = {
        "kv_lora_rank": getattr(config, "kv_lora_rank", None),
        "qk_nope_head_dim": getattr(config, "qk_nope_head_dim", None),
        "qk_rope_head_dim": getattr(config, "qk_rope_head_dim", None),
        "v_head_dim": getattr(config, "v_head_dim", None),
    }
    if q_lora is not None:
        fields["q_lora_rank"] = q_lora
    for name, value in fields.items():
        if not _whole(value) and not (name == "qk_nope_head_dim" and value == 0):
            _refuse(config, f"has {name}={value!r}", f"set {name} to a whole number >= 1.")
    if fields["qk_rope_head_dim"] % 2:
        _refuse(
            config,
            f"has odd qk_rope_head_dim={fields['qk_rope_head_dim']}",
            "RoPE rotates pairs of channels: use an even width.",
        )
    return LatentSpec(
        q_lora_rank=q_lora,
        kv_lora_rank=fields["kv_lora_rank"],
        nope=fields["qk_nope_head_dim"],
        rope=fields["qk_rope_head_dim"],
        v_dim=fields["v_head_dim"],
        interleave=bool(getattr(config, "rope_interleave", True)),
    )


def _attn_scale(config, adapter, D: int, latent: LatentSpec | None, rope: dict) -> float:
    """The score scale: Gemma's query_pre_attn_scalar**-0.5, DeepSeek's (nope + rope)**-0.5
    times YaRN's mscale(factor, mscale_all_dim)^2, else head_dim**-0.5."""
    if latent is not None:
        scale = (latent.nope + latent.rope) ** -0.5
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return scale
    scalar = getattr(config, adapter.attn_scalar, None) if adapter.attn_scalar else None
    return (scalar if scalar else D) ** -0.5


def spec_of(config) -> ArchSpec:
    """The :class:`ArchSpec` of an HF config; a :class:`CompressError` for anything the decoder
    cannot run (raised before any weight is read)."""
    adapter = get_adapter(config)
    n = config.num_hidden_layers
    H, G = config.num_attention_heads, config.num_key_value_heads
    D = head_dim(config)
    if G < 1 or H % G:
        _refuse(
            config,
            f"has {H} query heads over {G} KV heads",
            "the number of query heads must be a multiple of num_key_value_heads.",
        )
    act_name = getattr(config, adapter.act_field, None)
    if act_name not in ACTIVATIONS:
        _refuse(
            config,
            f"asks for activation {adapter.act_field}='{act_name}'",
            f"the decoder computes {', '.join(sorted(ACTIVATIONS))}.",
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        _refuse(
            config,
            "softcaps attention logits (attn_logit_softcapping, Gemma 2)",
            "the decoder's caches do not; Gemma 3 has none.",
        )
    if getattr(config, "use_bidirectional_attention", False):
        _refuse(config, "attends bidirectionally", "the decoder is causal.")
    if getattr(config, "clip_qkv", None) is not None:
        _refuse(
            config,
            f"clips q, k and v to clip_qkv={config.clip_qkv}",
            "the decoder does not clamp q, k and v, which a model trained with clipping needs; "
            "run this model with transformers.",
        )
    if not adapter.windowed and getattr(config, "sliding_window", None) is not None:
        _refuse(
            config,
            f"sets sliding_window={config.sliding_window}, which the family never applies",
            "remove sliding_window from config.json.",
        )
    if adapter.qk_norm_full and H * D != config.hidden_size:
        _refuse(
            config,
            f"has {H} heads of width {D} and hidden size {config.hidden_size}, but its q norm "
            f"spans hidden_size channels",
            "heads x head_dim must equal hidden_size.",
        )
    moe, mlps = moe_of(config, adapter, n, _refuse)
    share = int(getattr(config, "cla_share", None) or 1) if adapter.attention == "cla" else 1
    layers = []
    for i, (kind, window) in enumerate(_layer_kinds(config, n)):
        layers.append(
            LayerSpec(
                index=i,
                attention=adapter.attention,
                kind=kind,
                window=window,
                rope=_rope_of(config, kind, D),
                kv_slot=i // share,
                writes_kv=i % share == 0,
                mlp=mlps[i],
            )
        )
    for layer in layers:
        first = layers[layer.kv_slot * share]
        if layer.window != first.window:
            _refuse(
                config,
                f"shares layer {first.index}'s K/V (CLA) in layer {layer.index}, whose "
                f"sliding window differs",
                "group only layers of one attention kind.",
            )
    latent = _latent_of(config) if adapter.attention == "deepseek_mla" else None
    bias = bool(getattr(config, adapter.bias_field, False))
    qkv_bias = bias if adapter.qkv_bias is None else adapter.qkv_bias
    o_bias = bias if adapter.o_bias is None else adapter.o_bias
    return ArchSpec(
        family=adapter.family,
        adapter=adapter,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        n_heads=H,
        n_kv_heads=G,
        head_dim=D,
        norm_eps=float(config.rms_norm_eps),
        norm_offset=adapter.norm_offset,
        sandwich=adapter.attn_out_norm is not None,
        qk_norm=adapter.q_norm is not None,
        activation=ACTIVATIONS[act_name],
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        embed_scale=math.sqrt(config.hidden_size) if adapter.embed_scale else None,
        attn_scale=_attn_scale(config, adapter, D, latent, layers[0].rope_parameters()),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=getattr(config, "max_position_embeddings", None),
        layers=tuple(layers),
        eos_ids=eos_ids(getattr(config, "eos_token_id", None)),
        mla_rope_pairs=getattr(config, "mla_rope_pairs", None)
        if adapter.attention == "mla"
        else None,
        kv_lora_rank=getattr(config, "kv_lora_rank", None) if adapter.attention == "mla" else None,
        qk_norm_full=adapter.qk_norm_full,
        moe=moe,
        latent=latent,
        sinks=adapter.sinks,
    )


def model_spec(model) -> ArchSpec:
    """The spec of a model (ours: ``model.spec``; an HF model: built from ``model.config``)."""
    spec = getattr(model, "spec", None)
    return spec if isinstance(spec, ArchSpec) else spec_of(model.config)


def eos_ids(value) -> tuple[int, ...]:
    """``config.eos_token_id`` (an id, a list of ids or None) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
