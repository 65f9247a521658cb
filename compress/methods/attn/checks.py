"""What every attention conversion refuses: converted folders, RoPE it cannot re-split, and
families whose layers the converted Llama models cannot represent.

Per family (read from the architecture spec, ``compress.arch.spec``):

- ``gqa`` mean-pools K/V heads in place, so the model stays of its own family and works on
  every one. With per-head k-norms (Qwen3, Gemma 3) the pooled head is ``k_norm(mean_i W_k,i x)``:
  the norm (head_dim wide, shared by the heads) re-normalizes the mean of the group's pre-norm
  keys, so a pooled key keeps the direction of the mean key at the norm's scale rather than the
  mean's shrunken length; like mean-pooling without norms it is an initialisation for
  uptraining, not an exact map. Windows and RoPE per layer are untouched.
- ``cla`` and ``mla`` produce ``compress_cla`` / ``compress_mla`` models, Llama layers with
  shared or latent K/V (``compress.formats.attention``). They refuse (``check_llama_layers``,
  before any weight is read) a source whose layers a Llama layer does not compute: per-head
  q/k norms (CLA would share post-norm keys the Llama layer cannot re-normalize; MLA's SVD of
  W_k would cut through the norm), Gemma's four (1 + w) norms, GELU, embedding or attention
  scales, q/k/v biases without an o bias (Qwen2), and sliding windows (the converted Llama
  attends globally; a CLA group must anyway share one window, ``compress.arch.spec.spec_of``).
"""

from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.formats.attention import KINDS

ROPE_TYPES = ("default", "linear", "llama3")  # the RoPE kinds the converted models compute


def check_source(config, method: str) -> None:
    """Refuse a model a conversion does not handle, naming the fix."""
    if config.model_type in KINDS or config.model_type == "deepseek_v3":
        raise CompressError(
            f"the model is already converted ({config.model_type}); {method} converts a plain "
            f"Llama-family checkpoint. Set model.path to the source model (a gqa run folder, being "
            f"plain Llama, can be converted further)."
        )


def check_rope(config, method: str) -> None:
    """Refuse a model without RoPE, or with a RoPE variant whose pairs cannot be re-selected."""
    rope = getattr(config, "rope_parameters", None) or {}
    if not rope.get("rope_theta") and not getattr(config, "rope_theta", None):
        raise CompressError(
            f"{method} needs a model with rotary position embeddings (RoPE); "
            f"this config has no rope_theta."
        )
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise CompressError(
            f"{method} handles RoPE types {', '.join(ROPE_TYPES)}; this model uses "
            f"'{kind}'. Convert a model with one of those."
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CompressError(
            f"{method} needs RoPE on the whole head (partial_rotary_factor 1); "
            f"this model rotates {rope['partial_rotary_factor']} of each head."
        )


def check_llama_layers(config, method: str) -> None:
    """Refuse a family whose layers ``method``'s converted Llama model cannot compute."""

    spec = spec_of(config)
    found = []
    if spec.qk_norm:
        found.append("per-head q/k RMSNorm before RoPE")
    if spec.sandwich or spec.norm_offset:
        found.append("(1 + w) norms after attention and MLP as well as before")
    if spec.activation != "silu":
        found.append(f"a {spec.activation} MLP")
    if spec.embed_scale is not None:
        found.append("embeddings scaled by sqrt(hidden_size)")
    if abs(spec.attn_scale - spec.head_dim**-0.5) > 1e-12:
        found.append("an attention scale other than head_dim**-0.5")
    if spec.qkv_bias != spec.o_bias:
        found.append("q/k/v biases without an o_proj bias")
    if spec.final_softcap is not None:
        found.append("a final logit softcap")
    windows = sorted({layer.window for layer in spec.layers if layer.window is not None})
    if windows:
        found.append(f"sliding-window attention (window {windows[0]}) on some layers")
    if found:
        raise CompressError(
            f"{method} converts into a Llama model with {method.upper()} attention, and this "
            f"'{spec.family}' model has {'; '.join(found)}, which that model does not compute. "
            f"Convert a llama-family model (llama, or mistral/qwen2 with sliding windows off), "
            f"or use the gqa recipe, which keeps the model's own family."
        )
