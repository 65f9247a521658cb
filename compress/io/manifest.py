"""``manifest.json``: what a run folder holds and how it was made, and the check that a folder
still holds it.

Keys: recipe (resolved config), source {name, path, sha256}, version, git_commit,
files {name: {bytes, sha256}} for every other file, stages (seconds), created (UTC),
trust_remote_code. A ``*.safetensors`` entry also has ``header_sha256`` and
``tensors`` {tensor name: sha256 of its data bytes}, so a damaged file is refused by the
name of the tensor that changed.

A safetensors file is laid out as (the format's spec)::

    u64 little-endian N | N bytes of JSON header | data
    header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}

with offsets relative to the start of the data and the tensors covering it without holes; so
the header's hash and every tensor's hash together cover every byte of the file.

Loading checks a folder first (``check_loadable``: ``decoder.model.load``, ``checkpoint.load_run``;
the CLIs call ``verify_folder``): every file of the folder must be listed, except the documents
in ``UNCHECKED`` and the Hub's own bookkeeping (``HUB_FILES``), which no loader reads. A folder
without a manifest passes (a plain HF checkpoint) unless it is one of ours: a run's temporary
or spill folder, a folder holding ``run_folder.INCOMPLETE``, or one with a run's report.
"""

import hashlib
import json
import mmap
import os
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from compress.errors import CompressError
from compress.io.run_folder import INCOMPLETE, incomplete, own_temporary, sha256_file
from compress.version import __version__

MANIFEST = "manifest.json"
# documents a person may edit (the model card, the report); loading reads none of them
UNCHECKED = ("README.md", "report.md", "report.json")
# what the Hub adds to a folder it pushed and downloaded again (``hf download --local-dir``);
# no loader reads them
HUB_FILES = (".gitattributes",)
HUB_FOLDERS = (".cache/huggingface/",)
_VERIFIED: dict[str, tuple] = {}  # folder -> the stat of its files when it last verified
_SKIPPED: set[str] = set()  # folders the user chose to load unverified (--no-verify)


def git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent.parent  # compress/io/ -> the checkout
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=40"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _safetensors_layout(buf) -> tuple[int, dict] | None:
    """``(data start, {tensor: (begin, end)})`` of a safetensors file's bytes, or None when its
    header cannot be read (then only the whole-file hash applies)."""
    if len(buf) < 8:
        return None
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        return None
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
        spans = {
            k: tuple(int(x) for x in v["data_offsets"])
            for k, v in header.items()
            if k != "__metadata__"
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return 8 + n, spans


def _sha(view) -> str:
    return hashlib.sha256(view).hexdigest()  # hashlib releases the GIL: threads hash in parallel


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def safetensors_hashes(path: Path) -> dict:
    """``{"header_sha256", "tensors": {name: sha256}}`` of a safetensors file ({} if unreadable)."""
    if path.stat().st_size == 0:
        return {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            layout = _safetensors_layout(view)
            if layout is None:
                return {}
            start, spans = layout
            with ThreadPoolExecutor(_threads()) as pool:
                header = pool.submit(_sha, view[:start])
                names = sorted(spans)
                digests = pool.map(
                    lambda k: _sha(view[start + spans[k][0] : start + spans[k][1]]), names
                )
                out = {"header_sha256": header.result(), "tensors": dict(zip(names, digests))}
        finally:
            view.release()
    return out


def file_entry(path: Path) -> dict:
    entry = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    if path.suffix == ".safetensors":
        entry.update(safetensors_hashes(path))
    return entry


def write_manifest(
    folder: Path, recipe: dict, source, stages: dict, trust_remote_code: bool
) -> dict:
    files = {
        str(p.relative_to(folder)): file_entry(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in (MANIFEST, INCOMPLETE)
    }
    manifest = {
        "recipe": recipe,
        "source": {"name": source.name, "path": source.path, "sha256": source.sha256},
        "version": __version__,
        "git_commit": git_commit(),
        "files": files,
        "stages": stages,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trust_remote_code": trust_remote_code,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _refuse(folder: Path, what: str, skip: str) -> CompressError:
    return CompressError(
        f"run folder '{folder}': {what}, so the folder was damaged or edited after the run that "
        f"wrote it (a bad copy, a full disk, a changed file). Re-run the recipe or copy the folder "
        f"again; if you edited it on purpose, skip this check with {skip}."
    )


def _check_safetensors(folder: Path, name: str, entry: dict, skip: str) -> None:
    path = folder / name
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise _refuse(
                folder, f"'{name}' is empty (the manifest records {entry['bytes']:,} bytes)", skip
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                _compare_tensors(folder, name, entry, view, skip)
            finally:
                view.release()


def _compare_tensors(folder: Path, name: str, entry: dict, view, skip: str) -> None:
    recorded = entry["tensors"]
    layout = _safetensors_layout(view)
    if layout is None:
        raise _refuse(folder, f"the header of '{name}' cannot be read", skip)
    start, spans = layout
    missing = sorted(set(recorded) - set(spans))
    if missing:
        raise _refuse(folder, f"tensor '{missing[0]}' is missing from '{name}'", skip)
    extra = sorted(set(spans) - set(recorded))
    if extra:
        raise _refuse(
            folder, f"'{name}' holds tensor '{extra[0]}', which the manifest does not list", skip
        )
    names = sorted(spans)
    size = len(view)

    def digest(k):
        b, e = spans[k]
        return None if start + e > size or b > e else _sha(view[start + b : start + e])

    with ThreadPoolExecutor(_threads()) as pool:
        header = pool.submit(_sha, view[:start])
        digests = dict(zip(names, pool.map(digest, names)))
        header = header.result()
    bad = sorted((k for k in names if digests[k] != recorded[k]), key=lambda k: spans[k])
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise _refuse(
            folder,
            f"tensor '{bad[0]}'{more} in '{name}' does not match the sha256 the manifest "
            f"recorded for it",
            skip,
        )
    if header != entry.get("header_sha256"):
        raise _refuse(
            folder,
            f"the header of '{name}' (tensor names, dtypes, shapes) differs from the one recorded",
            skip,
        )
    if size != entry["bytes"]:
        raise _refuse(
            folder,
            f"'{name}' has {size:,} bytes where the manifest records {entry['bytes']:,}",
            skip,
        )


def _listed_or_exempt(name: str, files: dict) -> bool:
    return (
        name in files
        or name == MANIFEST
        or Path(name).name in UNCHECKED
        or name in HUB_FILES
        or name.startswith(HUB_FOLDERS)
    )


def _stats(folder: Path) -> tuple:
    """What changes when a file of ``folder`` is written, replaced, added or removed."""
    out = []
    for p in folder.rglob("*"):
        try:
            st = p.stat()
        except OSError:  # a dangling link
            st = p.lstat()
        out.append((p.relative_to(folder).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out))


def _ours_without_manifest(folder: Path, skip: str) -> None:
    """Refuse a folder that one of our runs made but that has no manifest."""
    for report in ("report.json", "report.md"):
        if (folder / report).is_file():
            raise CompressError(
                f"run folder '{folder}' has a run's {report} but no {MANIFEST}: the manifest was "
                f"removed, or the folder was copied without it, so what it holds cannot be "
                f"checked. Copy the folder again or re-run the recipe; to load it unverified "
                f"anyway, use {skip}."
            )


def verify_folder(folder, skip: str = "--no-verify") -> bool:
    """Check ``folder``'s files against its ``manifest.json``. Returns whether there was a
    manifest to check (a plain HF checkpoint has none).

    Refused: an unfinished run's folder (``run_folder.incomplete``: a temporary or spill folder,
    or one holding the incomplete mark), even with a manifest; a folder of ours without a
    manifest (``_ours_without_manifest``); a file the manifest does not list (anything a loader
    may read: weights, a chat template, tokenizer files), but for ``UNCHECKED`` documents and
    the Hub's bookkeeping; every listed file but the ``UNCHECKED`` documents must exist with its
    recorded size and sha256; a safetensors file with per-tensor hashes is checked tensor by
    tensor (in threads) so that the refusal names the tensor. ``skip`` names how to turn the
    check off, for the message. A folder this process is writing (``own_temporary``) passes.
    """
    folder = Path(folder)
    if not folder.is_dir() or own_temporary(folder):
        return False
    why = incomplete(folder)
    if why:
        raise CompressError(
            f"'{folder}' is not a finished run folder: {why}. It is incomplete and does not "
            f"load; the next run (or compress.save) into the same place removes it once its "
            f"writer is gone, or delete it yourself."
        )
    path = folder / MANIFEST
    if not path.is_file():
        _ours_without_manifest(folder, skip)
        return False
    before = _stats(folder)
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise _refuse(
            folder, f"{MANIFEST} cannot be read (it has no 'files' table)", skip
        ) from None
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in present:
        if not _listed_or_exempt(name, files):
            raise _refuse(folder, f"'{name}' is not listed in {MANIFEST}", skip)
    for name, entry in sorted(files.items()):
        if Path(name).name in UNCHECKED:
            continue
        if not isinstance(entry, dict):
            raise _refuse(folder, f"{MANIFEST}'s entry for '{name}' cannot be read", skip)
        p = folder / name
        if not p.is_file():
            raise _refuse(folder, f"'{name}', listed in {MANIFEST}, is missing", skip)
        if name.endswith(".safetensors") and isinstance(entry.get("tensors"), dict):
            _check_safetensors(folder, name, entry, skip)
            continue
        if p.stat().st_size != entry.get("bytes"):
            raise _refuse(
                folder,
                f"'{name}' has {p.stat().st_size:,} bytes where the manifest records "
                f"{entry.get('bytes'):,}"
                if isinstance(entry.get("bytes"), int)
                else f"'{name}' has no recorded size",
                skip,
            )
        if sha256_file(p) != entry.get("sha256"):
            raise _refuse(folder, f"'{name}' does not match the sha256 the manifest recorded", skip)
    _VERIFIED[os.path.realpath(folder)] = before
    return True


def skip_verification(folder) -> None:
    """The user chose to load ``folder`` unverified (``--no-verify``): ``check_loadable`` lets
    it through in this process."""
    _SKIPPED.add(os.path.realpath(folder))


def check_loadable(folder, skip: str = "verify=False") -> None:
    """What a loader runs first: ``verify_folder``, unless this process verified ``folder``
    already and none of its files changed since (same names, sizes, mtimes and inodes: the
    CLIs verify, then load), or the user chose to skip it (``skip_verification``)."""
    folder = Path(folder)
    key = os.path.realpath(folder)
    if key in _SKIPPED:
        return
    if key in _VERIFIED and folder.is_dir() and _VERIFIED[key] == _stats(folder):
        return
    verify_folder(folder, skip)
