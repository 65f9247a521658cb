"""What every attention conversion refuses: converted folders, and RoPE it cannot re-split."""

from compress.formats.attention import KINDS
from compress.errors import CompressError

ROPE_TYPES = ("default", "linear", "llama3")  # one frequency per pair, rotate_half layout


def check_source(config, method: str) -> None:
    """Refuse a model a conversion does not handle, naming the fix."""
    if config.model_type in KINDS:
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
