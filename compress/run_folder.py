"""The run folder on disk: written under a temporary name, renamed into place when complete,
and its files identified by sha256.

``atomic_dir(final)`` makes a temporary sibling ``.NAME.tmp-XXXX``; ``commit_dir(tmp, final)``
fsyncs every file and renames it to ``final``. ``sha256_file``/``sha256_files`` hash files,
``weights_sha256`` hashes in-memory weights.
"""

import hashlib
import os
import tempfile
from pathlib import Path

import torch


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
