"""Architecture adapters: the registry of supported families, one :class:`Adapter` entry each.

An entry names where the family keeps its layers, projections and norms, and says what of its
computation the HF config does not (norm kind and placement, q/k norms, which config field holds
the activation, biases, embedding and attention scales). ``compress.arch.spec.spec_of`` reads an entry
together with the config into the frozen :class:`compress.arch.spec.ArchSpec` that the decoder and the
methods read. Methods never hard-code module names; they ask the adapter. One decoder layer::

    h = x + o_post(o_proj(attn(q_proj(n1(x)), k_proj(n1(x)), v_proj(n1(x)))))   n1 = input_norm
    y = h + m_post(down_proj(act(gate_proj(n2(h))) * up_proj(n2(h))))          n2 = post_norm

    n(x) = (offset + w) * x / sqrt(mean(x^2) + eps)      offset 0 (Llama), 1 (Gemma: ``(1+w)``)

``o_post`` / ``m_post`` are the identity in the Llama family (llama, mistral, qwen2, qwen3) and
``attn_out_norm`` / ``mlp_out_norm`` in Gemma 3 (four norms per block; there ``post_norm`` is
``pre_feedforward_layernorm``, the norm feeding the MLP). Qwen3 and Gemma 3 normalize each head
of q and k (``q_norm``, ``k_norm``, width head_dim) before RoPE; OLMoE normalizes the whole q
and k projections (``qk_norm_full``). An entry with a ``router`` is a mixture of experts: its
sparse layers' MLP is the router-weighted sum of top-k experts (``compress.arch.moe`` gives the
equations and reads the config fields the entry names).

A new family is an entry in :data:`ADAPTERS` plus tests (``tests/test_family_exactness.py``).
"""

from dataclasses import dataclass

from torch import nn

from compress.arch.moe import BIASED_TOPK, SIGMOID_GROUP, SOFTMAX_TOPK, TOPK_SOFTMAX
from compress.errors import CompressError


@dataclass(frozen=True)
class Adapter:
    family: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    attn: str = "self_attn"  # the attention block: (hidden_states, **layer kwargs) -> (out, ...)
    mlp: str = "mlp"  # the MLP block: x -> y
    # role -> path inside one decoder layer
    linears: tuple = (
        ("q", "self_attn.q_proj"),
        ("k", "self_attn.k_proj"),
        ("v", "self_attn.v_proj"),
        ("o", "self_attn.o_proj"),
        ("gate", "mlp.gate_proj"),
        ("up", "mlp.up_proj"),
        ("down", "mlp.down_proj"),
    )
    optional: tuple = ()  # roles some layers lack (cross-layer attention: k and v)
    # -- the norms beyond input_norm / post_norm (None: the family has none) --
    attn_out_norm: str | None = None  # on the attention's output, before the residual add
    mlp_out_norm: str | None = None  # on the MLP's output, before the residual add
    q_norm: str | None = None  # per-head RMSNorm of q before RoPE (path inside the layer)
    k_norm: str | None = None
    # -- what the HF config does not say --
    norm_offset: float = 0.0  # RMSNorm weight is (norm_offset + w): 1.0 for Gemma's (1 + w)
    act_field: str = "hidden_act"  # config field naming the MLP's activation
    qkv_bias: bool | None = None  # q/k/v biases; None: config.attention_bias
    o_bias: bool | None = None  # o_proj bias; None: config.attention_bias
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    attn_scalar: str | None = None  # config field s: attention scale s**-0.5 (None: head_dim)
    attention: str = "gqa"  # "gqa", "cla" (config.cla_share), "mla" (config.kv_lora_rank)
    bias_field: str = "attention_bias"  # config field of the attention biases (qwen2_moe: qkv_bias)
    qk_norm_full: bool = False  # q/k norms over the whole projection, not per head (olmoe)
    windowed: bool = True  # the family's attention can slide (olmoe's never does)
    # -- mixture of experts (compress.arch.moe); router None: every MLP is dense --
    router: str | None = None  # a kind of compress.arch.moe.ROUTERS
    experts_field: str = "num_experts"  # config field of the expert count
    expert_size_field: str = "moe_intermediate_size"  # config field of each expert's width
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers pick the dense layers
    # "gated": qwen2_moe's shared expert (shared_expert_intermediate_size), weighted by
    # sigmoid(shared_expert_gate(x)); "plain": deepseek_v3's n_shared_experts, one ungated MLP
    shared_expert: str | None = None
    shared_name: str = "shared_expert"  # the shared expert's module under the MLP
    dense_first: str | None = None  # config field: the count of leading dense layers
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")  # per-expert checkpoint names
    mlp_aliases: tuple = ()  # (checkpoint name, ours) of the MLP (mixtral's block_sparse_moe)
    # "fused": gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I]; "transposed":
    # gpt-oss's gate_up_proj [E, H, 2I] with gate and up columns interleaved, down_proj [E, I, H]
    expert_layout: str = "fused"
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    expert_glu: str = "gated"  # "gated": act(gate) * up; "clamped_swiglu": gpt-oss's
    sinks: bool = (
        False  # attention sinks: a learned logit per query head (gpt-oss's self_attn.sinks)
    )
    # the attention's projections on the residual stream where ``linears`` lists none (DeepSeek
    # V3): paths inside a layer of those reading the input norm's output (absent ones skipped)
    # and of those adding into the stream
    stream_reads: tuple = ()
    stream_writes: tuple = ()

    def norms(self) -> tuple[str, ...]:
        """Paths inside a layer of its hidden-width norms, in the order the forward runs them."""
        return tuple(
            n
            for n in (self.input_norm, self.attn_out_norm, self.post_norm, self.mlp_out_norm)
            if n is not None
        )

    def ours(self, name: str) -> str:
        """A checkpoint tensor's name under the module names the decoder and transformers hold
        in memory (:attr:`mlp_aliases`: Mixtral's ``block_sparse_moe`` is ``mlp``)."""
        for old, new in self.mlp_aliases:
            name = name.replace(f".{old}.", f".{new}.")
        return name

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def linear(self, layer: nn.Module, role: str) -> nn.Module:
        return layer.get_submodule(dict(self.linears)[role])

    def named_linears(self, layer: nn.Module) -> dict[str, nn.Module]:
        """``{path inside the layer: module}`` for the layer's projections; in a
        mixture-of-experts family also those of its MLP (:meth:`mlp_linears`)."""
        out = {
            path: layer.get_submodule(path)
            for role, path in self.linears
            if role not in self.optional or has_path(layer, path)
        }
        return out | self.mlp_linears(layer) if self.router else out

    def mlp_linears(self, layer: nn.Module) -> dict[str, nn.Module]:
        """A mixture-of-experts layer's MLP projections, where they are linears: a dense
        layer's gate/up/down, the shared expert's, and each expert's once they are one module
        per expert (``compress.layers.experts.unfuse_experts``; transformers' fused experts
        have none)."""
        m, names = self.mlp, ("gate_proj", "up_proj", "down_proj")
        paths = [f"{m}.{n}" for n in names] + [f"{m}.{self.shared_name}.{n}" for n in names]
        e = 0
        while has_path(layer, f"{m}.experts.{e}"):
            paths += [f"{m}.experts.{e}.{n}" for n in self.expert_names]
            e += 1
        return {p: layer.get_submodule(p) for p in paths if has_path(layer, p)}

    def linear_shapes(self, config) -> dict[str, tuple[int, int]]:
        """``{path inside a layer: (out_features, in_features)}`` of the seven projections, read
        from an HF config (no weights needed)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        D = head_dim(config)
        q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
        shapes = {
            "q": (q, hidden),
            "k": (kv, hidden),
            "v": (kv, hidden),
            "o": (hidden, q),
            "gate": (inter, hidden),
            "up": (inter, hidden),
            "down": (hidden, inter),
        }
        out = {path: shapes[role] for role, path in self.linears}
        if self.router:  # the dense layers' MLP, an expert's, the shared expert's
            m, (g, _, d) = self.mlp, self.expert_names
            width = getattr(config, self.expert_size_field)
            out.update({f"{m}.gate_proj": (inter, hidden), f"{m}.down_proj": (hidden, inter)})
            out.update(
                {f"{m}.experts.0.{g}": (width, hidden), f"{m}.experts.0.{d}": (hidden, width)}
            )
            shared = getattr(config, "shared_expert_intermediate_size", None)
            shared = shared or width * (getattr(config, "n_shared_experts", None) or 0)
            if self.shared_expert and shared:
                out[f"{m}.{self.shared_name}.gate_proj"] = (shared, hidden)
                out[f"{m}.{self.shared_name}.down_proj"] = (hidden, shared)
        return out

    def all_linears(self, model: nn.Module) -> dict[str, nn.Module]:
        """``{full module name: module}`` for every projection of every decoder layer."""
        out = {}
        for i, layer in enumerate(self.decoder_layers(model)):
            for path, mod in self.named_linears(layer).items():
                out[f"{self.layers}.{i}.{path}"] = mod
        return out


def has_path(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


LLAMA = Adapter(family="llama")
MISTRAL = Adapter(family="mistral")  # the sliding window is in the config (compress.arch.spec)
QWEN2 = Adapter(family="qwen2", qkv_bias=True, o_bias=False)
QWEN3 = Adapter(family="qwen3", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
GEMMA3 = Adapter(
    family="gemma3_text",
    post_norm="pre_feedforward_layernorm",
    attn_out_norm="post_attention_layernorm",
    mlp_out_norm="post_feedforward_layernorm",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    norm_offset=1.0,
    act_field="hidden_activation",
    embed_scale=True,
    attn_scalar="query_pre_attn_scalar",
)
# compress.methods.attn's converted Llamas: CLA layers after a group's first lack k/v; MLA (DeepSeek-like
# names) has a RoPE key projection, a latent down-projection and the K/V up-projections.
CLA = Adapter(family="compress_cla", optional=("k", "v"), attention="cla")
MLA = Adapter(
    family="compress_mla",
    attention="mla",
    linears=(
        ("q", "self_attn.q_proj"),
        ("k_rope", "self_attn.k_rope_proj"),
        ("kv_a", "self_attn.kv_a_proj"),
        ("k_b", "self_attn.k_b_proj"),
        ("v_b", "self_attn.v_b_proj"),
        ("o", "self_attn.o_proj"),
        ("gate", "mlp.gate_proj"),
        ("up", "mlp.up_proj"),
        ("down", "mlp.down_proj"),
    ),
)
# Mixture-of-experts families (compress.arch.moe): the experts are stored fused, as transformers
# holds them (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; mlp.experts.down_proj
# [E, H, I]; router mlp.gate.weight [E, H]) or per expert, as save_pretrained writes them
# (mlp.experts.{e}.gate_proj ...; mixtral: block_sparse_moe.experts.{e}.w1/w3/w2). Their
# ``linears`` are the attention's: the methods do not reach into experts yet.
ATTENTION_LINEARS = Adapter.linears[:4]
QWEN3_MOE = Adapter(
    family="qwen3_moe",
    linears=ATTENTION_LINEARS,
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    router=SOFTMAX_TOPK,
    sparse_step=True,
)
QWEN2_MOE = Adapter(
    family="qwen2_moe",
    linears=ATTENTION_LINEARS,
    bias_field="qkv_bias",
    o_bias=False,
    router=SOFTMAX_TOPK,
    sparse_step=True,
    shared_expert="gated",
)
MIXTRAL = Adapter(
    family="mixtral",
    linears=ATTENTION_LINEARS,
    qkv_bias=False,
    o_bias=False,
    router=TOPK_SOFTMAX,
    experts_field="num_local_experts",
    expert_size_field="intermediate_size",
    expert_names=("w1", "w3", "w2"),
    mlp_aliases=(("block_sparse_moe", "mlp"),),
)
OLMOE = Adapter(
    family="olmoe",
    linears=ATTENTION_LINEARS,
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_full=True,
    windowed=False,
    router=SOFTMAX_TOPK,
    expert_size_field="intermediate_size",
)
# DeepSeek V3: multi-head latent attention (compress.arch.spec.LatentSpec; q_proj, or q_a_proj ->
# q_a_layernorm -> q_b_proj with q_lora_rank; kv_a_proj_with_mqa -> [latent | shared RoPE key],
# kv_a_layernorm on the latent, kv_b_proj -> each head's [k_nope | v]), dense first layers, then
# a grouped sigmoid router with shared experts.
DEEPSEEK_V3 = Adapter(
    family="deepseek_v3",
    attention="deepseek_mla",
    linears=(),  # the decoder runs latent attention from float weights: methods reach the MLPs
    windowed=False,
    router=SIGMOID_GROUP,
    experts_field="n_routed_experts",
    shared_expert="plain",
    shared_name="shared_experts",
    dense_first="first_k_dense_replace",
    stream_reads=("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
    stream_writes=("self_attn.o_proj",),
)
# gpt-oss: attention sinks, q/k/v/o biases, alternating sliding and full layers (layer_types),
# YaRN; a biased router (mlp.router) over transposed experts with biases and the clamped SwiGLU.
GPT_OSS = Adapter(
    family="gpt_oss",
    linears=ATTENTION_LINEARS,
    router=BIASED_TOPK,
    experts_field="num_local_experts",
    expert_size_field="intermediate_size",
    mlp_aliases=(("mlp.router", "mlp.gate"),),
    expert_layout="transposed",
    expert_bias=True,
    expert_glu="clamped_swiglu",
    sinks=True,
)
ADAPTERS = {
    a.family: a
    for a in (
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        GEMMA3,
        CLA,
        MLA,
        QWEN3_MOE,
        QWEN2_MOE,
        MIXTRAL,
        OLMOE,
        DEEPSEEK_V3,
        GPT_OSS,
    )
}


def get_adapter(config) -> Adapter:
    """The adapter for an HF config (or anything with ``model_type``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise CompressError(
            f"unsupported architecture '{model_type}'. compress supports: "
            f"{', '.join(sorted(ADAPTERS))}. A new family is an Adapter entry in "
            f"compress/arch/adapters.py (its decoder layers, projections and norms by name; norm "
            f"kind and placement, q/k norms, activation field, biases, embedding and attention "
            f"scales) plus a tiny-model test against transformers in "
            f"tests/test_family_exactness.py."
        )
    return ADAPTERS[model_type]


def head_dim(config) -> int:
    """Width of one attention head: ``config.head_dim``, else hidden size / query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def layer_in_features(hf_config) -> dict[str, int]:
    """``{'model.layers.0.self_attn.q_proj [OUTxIN]': IN, ...}``: the first layer's projections."""

    adapter = get_adapter(hf_config)
    shapes = adapter.linear_shapes(hf_config)
    return {f"{adapter.layers}.0.{p} [{o}x{i}]": i for p, (o, i) in shapes.items()}
