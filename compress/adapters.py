"""Architecture adapters: where each family keeps its layers, projections and norms.

Methods never hard-code module names; they ask the adapter. One decoder layer
of the Llama family (llama, mistral, qwen2) looks like::

    h = x + o_proj(attn(q_proj(n1(x)), k_proj(n1(x)), v_proj(n1(x))))    n1 = input_layernorm
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))          n2 = post_attention_layernorm
"""

from dataclasses import dataclass

from torch import nn

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

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def linear(self, layer: nn.Module, role: str) -> nn.Module:
        return layer.get_submodule(dict(self.linears)[role])

    def named_linears(self, layer: nn.Module) -> dict[str, nn.Module]:
        """``{path inside the layer: module}`` for the layer's projections."""
        return {
            path: layer.get_submodule(path)
            for role, path in self.linears
            if role not in self.optional or _has(layer, path)
        }

    def linear_shapes(self, config) -> dict[str, tuple[int, int]]:
        """``{path inside a layer: (out_features, in_features)}`` of the seven projections, read
        from an HF config (no weights needed)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        shapes = {
            "q": (q, hidden),
            "k": (kv, hidden),
            "v": (kv, hidden),
            "o": (hidden, q),
            "gate": (inter, hidden),
            "up": (inter, hidden),
            "down": (hidden, inter),
        }
        return {path: shapes[role] for role, path in self.linears}

    def all_linears(self, model: nn.Module) -> dict[str, nn.Module]:
        """``{full module name: module}`` for every projection of every decoder layer."""
        out = {}
        for i, layer in enumerate(self.decoder_layers(model)):
            for path, mod in self.named_linears(layer).items():
                out[f"{self.layers}.{i}.{path}"] = mod
        return out


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


LLAMA = Adapter(family="llama")
# compress.attn's converted Llamas: CLA layers after a group's first lack k/v; MLA (DeepSeek-like
# names) has a RoPE key projection, a latent down-projection and the K/V up-projections.
CLA = Adapter(family="compress_cla", optional=("k", "v"))
MLA = Adapter(
    family="compress_mla",
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
ADAPTERS = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "compress_cla": CLA,
    "compress_mla": MLA,
}


def get_adapter(config) -> Adapter:
    """The adapter for an HF config (or anything with ``model_type``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise CompressError(
            f"unsupported architecture '{model_type}'. compress supports the Llama family: "
            f"{', '.join(sorted(ADAPTERS))}. Add an Adapter in compress/adapters.py that names "
            f"the decoder layers, projections and norms of '{model_type}'."
        )
    return ADAPTERS[model_type]


def head_dim(config) -> int:
    """Width of one attention head: ``config.head_dim``, else hidden size / query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
