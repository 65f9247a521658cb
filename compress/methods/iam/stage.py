"""The pipeline stage ``iam``: map the model onto a small one and run the report through both.

Recipe keys (``recipes/iam.yaml``)::

    iam.small:           folder of the small model (same tokenizer), e.g. a minitron_quarter run
    iam.layers:          large layers mapped: auto | a count (compress.methods.iam.map.select)
    iam.tokens:          calibration tokens for the similarity (WikiText-2 validation)
    iam.seqlen:          tokens per calibration sample
    iam.skip_first:      first layers never mapped
    iam.min_similarity:  the ``auto`` threshold

Families: IAM maps global-attention layers onto global-attention layers; a large or small model
with sliding-window layers (mistral's window, qwen2's windowed layers, Gemma 3's local layers)
is refused from its config.json before any weight loads (``check_windows``): the attention
maps are recorded over every key, which a windowed layer does not attend. Every other family
(llama, qwen2 without windows, qwen3 with its q/k norms) is mapped as it is: the similarity
compares attention weights, whatever computed them.

The model itself is unchanged; the run folder gets ``iam_map.json`` (and its heat map
``iam_map.png``), and the report's ppl, KL, decode/prefill tok/s and KV bytes are those of the
large model decoding with the small one alongside (``compress.methods.iam.decode``; the KV bytes count
both caches). report.json gets ``iam`` (the small model and its file bytes, which ``weight_bytes`` does not
count, the mapped layers and their similarity).
"""

import logging
import shutil
from pathlib import Path

from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.io.checkpoint import save_checkpoint
from compress.io.source import cache_dir, resolve_path
from compress.methods.iam import map as iam_map
from compress.methods.iam.decode import Logits, load_iam
from compress.methods.iam.map import check_pair, vocab_sha

log = logging.getLogger(__name__)


def check_small(small) -> Path:
    if not small or not (Path(str(small)) / "config.json").is_file():
        raise CompressError(
            f"iam.small={small!r}: give the folder of the small model (same tokenizer), e.g. "
            f"the run folder of recipe=minitron_quarter."
        )
    return Path(str(small))


def check_windows(folder, role: str) -> None:
    """Refuse a model with sliding-window layers (see the module docstring)."""
    import json

    from transformers import AutoConfig

    raw = json.loads((Path(folder) / "config.json").read_text())
    raw.pop("quantization_config", None)
    spec = spec_of(AutoConfig.for_model(**raw))
    windowed = [layer.index for layer in spec.layers if layer.window is not None]
    if windowed:
        raise CompressError(
            f"iam: the {role} model ('{spec.family}', {folder}) has sliding-window attention on "
            f"layers {windowed}; IAM records and maps attention over every key, so it maps "
            f"global-attention models only. Use a model without sliding windows (for mistral or "
            f"qwen2, one whose config turns them off)."
        )


def check_settings(c, model_path=None) -> None:
    """``iam.*`` before the model loads (``compress.recipe.config.validate``), the small model's
    tokenizer against ``model_path``'s when that is a local folder."""
    small = check_small(c.get("small"))
    layers = c.get("layers", "auto")
    if layers != "auto" and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise CompressError(f"iam.layers={layers!r}: use auto or a number of layers >= 0.")
    for key in ("tokens", "seqlen"):
        if not isinstance(c.get(key), int) or c.get(key) < 1:
            raise CompressError(f"iam.{key}={c.get(key)!r}: use a whole number >= 1.")
    if c.tokens < c.seqlen:
        raise CompressError(f"iam.tokens={c.tokens} is less than one sample of iam.seqlen tokens.")
    check_windows(small, "small")
    if model_path is not None and (Path(model_path) / "config.json").is_file():
        check_windows(model_path, "large")
    if model_path is not None and (Path(model_path) / "tokenizer_config.json").is_file():
        check_pair({"vocab_sha": vocab_sha(model_path)}, {"vocab_sha": vocab_sha(small)},
                   model_path, small)  # fmt: skip


def iam(model, ctx):
    """Compute the mapping of the (saved) model onto ``iam.small`` and set the report's loaders."""
    from functools import partial

    c = ctx.cfg.iam
    small = check_small(c.small)
    layers = c.get("layers", "auto")
    work = cache_dir() / "iam" / f"run{id(ctx)}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        # the folder the pipeline will save
        save_checkpoint(model, ctx.tokenizer, work / "large", ctx.quantization_config)
        m = iam_map.build_map(
            work / "large", small, int(c.tokens), int(c.seqlen), int(c.skip_first),
            float(c.min_similarity),
        )  # fmt: skip
        chosen = iam_map.select(m, layers)
        iam_map.save_map(m, work / iam_map.MAP_NAME)
        keep = cache_dir() / "iam" / f"{m['large']['embed_sha']}-{m['small']['embed_sha']}"
        keep.mkdir(parents=True, exist_ok=True)
        for name in (iam_map.MAP_NAME, Path(iam_map.MAP_NAME).with_suffix(".png").name):
            if (work / name).is_file():
                shutil.copyfile(work / name, keep / name)
                ctx.files[name] = keep / name
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("iam: %d of %d layers mapped onto %s", len(chosen), m["large"]["layers"], small)
    ctx.record["iam"] = {
        "small": str(small),
        "layers": chosen,
        "layer_map": {ly: m["layer_map"][ly] for ly in chosen},
        "similarity": {ly: round(m["similarity"][ly], 4) for ly in chosen},
        "small_layers": m["small"]["layers"],
        "small_weight_bytes": sum(f.stat().st_size for f in small.glob("*.safetensors")),
        "calibration": m["calibration"],
    }
    ctx.eval_loader = partial(_eval_model, small=small, layers=layers)
    ctx.decode_loader = partial(_decode_model, small=small, layers=layers)
    return model


def _decode_model(folder, small, layers, dtype=None, **kw):

    return load_iam(folder, small, layers, **({"dtype": dtype} if dtype is not None else {}), **kw)


def _eval_model(folder, small, layers):

    model, tok = _decode_model(folder, small, layers)
    return Logits(model), tok


def check(cfg, hf_config=None) -> None:
    """Refuse ``iam.*`` before the model loads."""
    check_settings(cfg.iam, resolve_path(str(cfg.model.path))[0])
