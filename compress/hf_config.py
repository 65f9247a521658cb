"""A folder's ``config.json`` read into a transformers config, with a clear error for a file
that is not JSON, has no ``model_type``, names a type transformers does not know (the nearest
known ones suggested, not transformers' list of hundreds), or holds a field of the wrong kind."""

import difflib
import json
from pathlib import Path

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
    if kind not in CONFIG_MAPPING and "auto_map" in raw:  # a converted attention (cla, mla)
        import compress.formats.attention  # noqa: F401  (registers its model types)
    known = list(CONFIG_MAPPING.keys())
    if kind not in known:
        near = difflib.get_close_matches(kind, known, n=3)
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        raise CompressError(
            f"'{path}' has model_type '{kind}', which this transformers does not know.{hint} "
            f"Fix model_type, or upgrade transformers if the architecture is newer than it."
        )
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(kind, **fields)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's field checks
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])[:300]
        raise CompressError(
            f"'{path}' cannot be read as a {kind} config ({detail}). Fix that field or restore "
            f"the file the run or save_pretrained wrote."
        ) from None
