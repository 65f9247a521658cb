"""The run folder on disk: written under a temporary name, renamed into place when complete,
claimed by a lock while it is written, and its files identified by sha256.

Beside a run folder ``NAME`` (in its parent) a run or ``compress.save`` keeps::

    .NAME.lock            fcntl.flock'ed while the folder is written (``lock_folder``); holds the
                          writer's pid. The kernel drops the lock when the process dies, however
                          it dies (SIGKILL too), so a held lock means a live writer.
    .NAME.tmp-XXXXXXXX    the folder being written (``atomic_dir``); ``commit_dir`` renames it to
                          NAME. It holds ``.compress-incomplete`` (a token of the writing process)
                          until then, so it is recognised as incomplete even under another name.
    .NAME.layers-XXXXXXXX the source's layers spilled during a disk-backed run (``spill_dir``).

``sweep(final)``, called with the lock held, removes the ``tmp``/``layers`` folders a killed
writer left: with the lock held no live writer of NAME owns one. ``sha256_file``/``sha256_files``
hash files, ``weights_sha256`` hashes in-memory weights. ``no_space`` turns a full disk
(ENOSPC, EDQUOT, EFBIG) into one paragraph.
"""

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from compress.errors import CompressError, Interrupted

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INCOMPLETE = ".compress-incomplete"  # inside a folder being written: "pid token"
_OWN: set[str] = set()  # tokens of the folders this process is writing
# mkdtemp's names: PREFIX + 8 characters of [a-z0-9_]
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|layers)-[a-z0-9_]{8}")


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


def weights_sha256(model: "torch.nn.Module") -> str:
    """sha256 over a model's state (names, dtypes, shapes, bytes): identifies in-memory weights.

    Tensors that share storage (tied embeddings) are hashed once.
    """
    import torch  # heavy: the CLI checks run folders before it loads

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
    existing file, a symbolic link (the folder is renamed into place, which would replace the
    link, not fill its target), or a place this process cannot write (``/proc``, a read-only
    mount, another user's folder). Probes the nearest existing ancestor of ``final`` by making a
    temporary folder there: ``atomic_dir`` writes beside ``final``, and a probe inside ``final``
    would make it non-empty for a moment, to another process checking it (``accelerate
    launch``'s ranks)."""
    final = Path(final)
    if final.is_symlink():
        target = os.path.realpath(final)
        raise CompressError(
            f"{what} '{final}' is a symbolic link (to '{target}'): a run folder is written "
            f"under a temporary name beside it and renamed into place, which cannot go through a "
            f"link. Pass the folder itself ('{target}', if it is empty or does not exist), or "
            f"another path."
        )
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


class FolderLock:
    """The writer's claim on a folder: an exclusive ``flock`` on ``.NAME.lock`` beside it.

    ``held`` is False where the filesystem has no locks (some network mounts): the run goes on
    unguarded and ``sweep`` removes nothing."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Remove the lock file, then drop the lock (a process that opened the old file before
        the removal sees, once it holds the lock, that the path is gone, and tries again)."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.lock"


def lock_folder(final, what: str) -> FolderLock:
    """Claim ``final`` for writing; refuse it (a ``CompressError`` naming the other process) when
    another live process holds the claim. Makes ``final``'s parent folders."""
    final = Path(os.path.abspath(final))
    if not final.name:
        raise CompressError(f"{what} '{final}' is the root folder; pick a folder path in it.")
    final.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(final)
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in NO_SPACE:
                raise
            raise CompressError(
                f"{what} '{final}' cannot be claimed: making '{path}' fails ({e.strerror}). "
                f"Pick a path in a folder you can write, e.g. outputs/NAME."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CompressError(
                f"{what} '{final}' is being written by another run (process {holder}, which "
                f"holds '{path.name}' beside it); two runs cannot write one folder. Wait for it "
                f"to finish, or pick another folder."
            ) from None
        except OSError as e:  # no locks on this filesystem
            os.close(fd)
            log.warning(
                "cannot lock '%s' (%s): concurrent runs into '%s' are not detected, and "
                "folders left by killed runs are not removed",
                path,
                e.strerror,
                final,
            )
            return FolderLock(path, None)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return FolderLock(path, fd)
        os.close(fd)  # the previous holder removed the file as we opened it: take the new one
    raise CompressError(f"could not claim '{path}': it is created and removed over and over.")


def leftovers(final) -> list[Path]:
    """The temporary (``.NAME.tmp-*``) and spill (``.NAME.layers-*``) folders beside ``final``."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    return sorted(
        p
        for p in final.parent.iterdir()
        if (m := _LEFTOVER.fullmatch(p.name))
        and m["name"] == final.name
        and p.is_dir()
        and not p.is_symlink()
    )


def sweep(final, lock: FolderLock) -> list[Path]:
    """Remove the folders that killed writers of ``final`` left (``leftovers``); ``lock`` must
    be this process's claim on ``final``, so no live writer owns any of them. Returns them."""
    if not lock.held:
        return []
    gone = []
    for p in leftovers(final):
        shutil.rmtree(p, ignore_errors=True)
        if p.exists():
            log.warning("could not remove '%s', left by a run that did not finish", p)
        else:
            log.warning("removed '%s', left by a run that was killed before it finished", p)
            gone.append(p)
    return gone


def _mark(folder: Path) -> None:
    token = uuid.uuid4().hex
    (folder / INCOMPLETE).write_text(f"{os.getpid()} {token}\n")
    _OWN.add(token)


def _token(folder: Path) -> str | None:
    try:
        parts = (Path(folder) / INCOMPLETE).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return parts[1] if len(parts) == 2 else ""


def own_temporary(folder) -> bool:
    """Whether ``folder`` is a temporary folder this process is writing (its own evaluation and
    decode read it before the manifest exists)."""
    return _token(folder) in _OWN


def incomplete(folder) -> str | None:
    """Why ``folder`` is an unfinished run folder (a temporary or spill folder by its name, or
    one holding the ``INCOMPLETE`` mark under any name), or None."""
    folder = Path(folder)
    m = _LEFTOVER.fullmatch(folder.name)
    if m:
        what = "temporary" if m["kind"] == "tmp" else "layer spill"
        return (
            f"it is the {what} folder of a run into '{m['name']}' that did not finish (killed, "
            f"or still running)"
        )
    if (folder / INCOMPLETE).exists():
        return (
            f"it holds {INCOMPLETE}: a run wrote it and did not finish (killed, or still running)"
        )
    return None


def atomic_dir(final: Path) -> Path:
    """A temporary sibling of ``final``, marked incomplete; ``commit_dir(tmp, final)`` when it
    is complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _mark(tmp)
    except BaseException as e:  # Ctrl-C while marking: the caller never saw the folder
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(tmp) from None
        raise
    return tmp


def spill_dir(final: Path) -> Path:
    """A folder beside ``final`` for the source's layers during a disk-backed run."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.layers-", dir=final.parent))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _keep(tmp: Path, final: Path, what: str) -> None:
    """Keep a complete folder that cannot take ``final``'s place under a name of its own."""
    kept = Path(tempfile.mkdtemp(prefix=f"{final.name}.complete-", dir=final.parent))
    os.replace(tmp, kept)
    raise CompressError(
        f"'{final}' {what} while the run wrote it, so the complete folder was kept as '{kept}'; "
        f"rename it where you want it."
    )


def commit_dir(tmp: Path, final: Path) -> None:
    """fsync every file in ``tmp``, then rename it to ``final`` (which must not hold files).

    Every file gets the mode a plain write gives (0644 under umask 022): safetensors writes its
    file through a private temporary (0600), mkdtemp makes the folder private."""
    token = _token(tmp)
    (tmp / INCOMPLETE).unlink(missing_ok=True)
    mask = _umask()
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            p.chmod(0o666 & ~mask)
        elif p.is_dir():
            p.chmod(0o777 & ~mask)
    tmp.chmod(0o777 & ~mask)
    if final.is_symlink():
        _keep(tmp, final, "became a symbolic link")
    if final.exists():
        try:
            final.rmdir()  # only an empty placeholder may stand in the way
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            _keep(tmp, final, "was filled by something else")
    os.replace(tmp, final)
    _OWN.discard(token)
    with contextlib.suppress(OSError):  # the rename itself, durable
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


NO_SPACE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file grew beyond the size this filesystem (or `ulimit -f`) allows",
}


@contextlib.contextmanager
def no_space(final, what: str):
    """Turn ENOSPC, EDQUOT and EFBIG raised inside into a ``CompressError`` about ``final``.
    The writer removes what it had written (its own ``except``) before this sees the error."""
    try:
        yield
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        where = f" writing '{e.filename}'" if e.filename else ""
        raise CompressError(
            f"{what} '{final}' could not be written: {NO_SPACE[e.errno]}{where} "
            f"({e.strerror}). Nothing half-written was kept. Free space on that disk "
            f"(`df -h {Path(final).parent}`) or pick a folder on another disk, and run again."
        ) from None
