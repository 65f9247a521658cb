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

from compress.errors import CompressError


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


def check_writable(final, what: str) -> None:
    """Refuse a folder that cannot be made where ``final`` names it: a path through a file, an
    existing file, or a place this process cannot write (``/proc``, a read-only mount, another
    user's folder). Probes the nearest existing ancestor of ``final`` by making a temporary
    folder there: ``atomic_dir`` writes beside ``final``, and a probe inside ``final`` would make
    it non-empty for a moment, to another process checking it (``accelerate launch``'s ranks)."""
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise CompressError(
            f"{what} '{final}' is a file, not a folder; pick a folder path that does not exist."
        )
    up = final.parent
    while not up.exists():
        if up.parent == up:
            break
        up = up.parent
    if not up.is_dir():
        raise CompressError(
            f"{what} '{final}' lies under '{up}', which is a file, so no folder can be made "
            f"there; pick another path."
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".compress-probe-", dir=up))
    except OSError as e:
        raise CompressError(
            f"{what} '{final}' cannot be written: making a folder in '{up}' fails "
            f"({e.strerror}). Pick a path in a folder you can write, e.g. outputs/NAME."
        ) from None


def atomic_dir(final: Path):
    """A temporary sibling of ``final``; call ``commit(tmp, final)`` when it is complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def commit_dir(tmp: Path, final: Path) -> None:
    """fsync every file in ``tmp``, then rename it to ``final`` (which must not hold files).

    Every file gets the mode a plain write gives (0644 under umask 022): safetensors writes its
    file through a private temporary (0600), mkdtemp makes the folder private."""
    mask = _umask()
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            p.chmod(0o666 & ~mask)
        elif p.is_dir():
            p.chmod(0o777 & ~mask)
    tmp.chmod(0o777 & ~mask)
    if final.exists():
        final.rmdir()  # only an empty placeholder may stand in the way
    os.replace(tmp, final)
