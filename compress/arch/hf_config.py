"""A folder's ``config.json`` read into a transformers config, with a clear error for a file
that is not JSON, has no ``model_type``, names a type transformers does not know (the nearest
known ones suggested, not transformers' list of hundreds), holds a field of the wrong kind, or
a value transformers accepts but no model can have (:func:`check_values`)."""

import difflib
import json
import math
from pathlib import Path

import compress.formats.attention  # noqa: F401  (registers the converted attentions' model types)
from compress.errors import CompressError


def read_config_json(folder) -> dict:
    """``FOLDER/config.json`` as a dict (the caller checks that it exists)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CompressError(
            f"'{path}' is not valid JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]}). "
            f"Restore the file the run or save_pretrained wrote, or fix its syntax."
        ) from None
    except OSError as e:
        raise CompressError(
            f"cannot read '{path}' ({e.strerror}); check its permissions."
        ) from None
    if not isinstance(raw, dict):
        raise CompressError(
            f"'{path}' holds a JSON {type(raw).__name__}, not an object of config fields; "
            f"restore the file the run or save_pretrained wrote."
        )
    return raw


def config_from_dict(raw: dict, where) -> object:
    """``AutoConfig.for_model(**raw)``, refusing what transformers would raise on."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = raw.get("model_type")
    path = Path(where) / "config.json"
    if not isinstance(kind, str) or not kind:
        raise CompressError(
            f"'{path}' has no model_type, so transformers cannot tell the architecture; add "
            f'"model_type" (e.g. "llama", "qwen2") or restore the file the run wrote.'
        )
    known = list(CONFIG_MAPPING.keys())
    if kind not in known:
        near = difflib.get_close_matches(kind, known, n=3)
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        raise CompressError(
            f"'{path}' has model_type '{kind}', which this transformers does not know.{hint} "
            f"Fix model_type, or upgrade transformers if the architecture is newer than it."
        )
    check_values(raw, raw, where)  # before transformers derives fields (0 heads: a division)
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(kind, **fields)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's field checks
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])[:300]
        raise CompressError(
            f"'{path}' cannot be read as a {kind} config ({detail}). Fix that field or restore "
            f"the file the run or save_pretrained wrote."
        ) from None
    check_values(config, raw, where)
    return config


COUNTS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def check_values(config, raw: dict, where) -> None:
    """Refuse the values transformers accepts but no model can run with: a count of
    ``COUNTS`` that is not a whole number >= 1 (no layers, no heads, an empty vocabulary),
    query heads that are not a multiple of the KV heads, ``hidden_size`` not divisible by the
    heads when ``head_dim`` is not given (head_dim = hidden_size / heads), and an RMSNorm
    ``rms_norm_eps`` that is not finite and > 0 (x / sqrt(mean(x^2) + eps): eps <= 0 or NaN
    gives NaN or inf, and the model decodes to nothing). Fields a config does not have pass.
    ``config`` is the transformers config, or ``raw`` itself (checked before it is built)."""
    path = Path(where) / "config.json"

    def get(name: str):
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    def refuse(field: str, value, rule: str):
        raise CompressError(
            f"'{path}' has {field}={value!r}: {rule}. Fix that field or restore the file the run "
            f"or save_pretrained wrote."
        )

    for name in COUNTS:
        v = get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            refuse(name, v, "it must be a whole number >= 1")
    eps = get("rms_norm_eps")
    if eps is not None and (
        isinstance(eps, bool)
        or not isinstance(eps, int | float)
        or not math.isfinite(eps)
        or eps <= 0
    ):
        refuse(
            "rms_norm_eps",
            eps,
            "RMSNorm divides by sqrt(mean(x^2) + eps), so eps must be a finite number > 0 "
            "(1e-5 or 1e-6 in most models)",
        )
    heads, kv = get("num_attention_heads"), get("num_key_value_heads")
    if heads and kv and heads % kv:
        refuse(
            "num_key_value_heads",
            kv,
            f"each KV head serves a whole group of query heads, so num_attention_heads={heads} "
            f"must be a multiple of num_key_value_heads",
        )
    hidden = get("hidden_size")
    if heads and hidden and raw.get("head_dim") is None and hidden % heads:
        refuse(
            "hidden_size",
            hidden,
            f"without head_dim, each head is hidden_size / num_attention_heads wide, so "
            f"hidden_size must be a multiple of num_attention_heads={heads}",
        )
