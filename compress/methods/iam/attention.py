"""IAM's attention kind in the decoder's one forward: a large-model layer under attention
mapping projects V only; its cache (``compress.methods.iam.cache.MappedCache``) mixes V with the
small model's attention weights,

    y_h = P_small[m(l)][head(l, h)] V_g(h)        (no q/k projection, no K cache)

so its q_proj and k_proj are loaded (the checkpoint has them) and then freed. Importing this
module registers the kind ``mapped`` with the decoder (``compress.decoder.model.register_attention``);
:func:`load_mapped` loads a folder with the chosen layers of that kind. Which layers are mapped
is the loaded model's spec (``ArchSpec.with_attention``), never the HF config.
"""

from compress.arch.spec import ArchSpec
from compress.decoder.model import Attention, load, register_attention
from compress.errors import CompressError

KIND = "mapped"


class MappedAttention(Attention):
    """A layer of attention kind ``mapped`` (see the module docstring)."""

    def __init__(self, spec: ArchSpec, layer: int):
        lay = spec.layers[layer]
        if lay.window is not None or not lay.writes_kv:
            raise CompressError(
                f"IAM maps global-attention layers that project their own K/V; layer {layer} "
                f"has " + ("a sliding window." if lay.window is not None else "no K/V (CLA).")
            )
        super().__init__(spec, layer)

    def inputs(self) -> list[str]:
        return ["v_proj"]

    def dropped(self) -> list[str]:
        return ["q_proj", "k_proj"]

    def project(self, x, cos, sin):
        B, T, _ = x.shape
        v = self.qkv_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return None, None, v


register_attention(KIND, MappedAttention)


def load_mapped(folder, layers, **load_kw):
    """``compress.decoder.model.load(folder, **load_kw)`` with ``layers`` built as
    :class:`MappedAttention`: ``(model, tokenizer)``."""
    return load(folder, attention={int(i): KIND for i in layers}, **load_kw)


__all__ = ["KIND", "MappedAttention", "load_mapped"]
