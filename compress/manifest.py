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
from compress.run_folder import sha256_file
from compress.version import __version__

MANIFEST = "manifest.json"
# documents a person may edit (the model card, the report); loading reads none of them
UNCHECKED = ("README.md", "report.md", "report.json")


def git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
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
        if p.is_file() and p.name != MANIFEST
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


def verify_folder(folder, skip: str = "--no-verify") -> bool:
    """Check ``folder``'s files against its ``manifest.json`` (a folder without one passes: a
    plain HF checkpoint). Returns whether there was a manifest to check.

    Every listed file but the documents in ``UNCHECKED`` must exist with its recorded size and
    sha256; a safetensors file with per-tensor hashes is checked tensor by tensor (in threads)
    so that the refusal names the tensor; a ``*.safetensors`` file the manifest does not list is
    refused (the loader would read it). ``skip`` names how to turn the check off, for the message.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise _refuse(
            folder, f"{MANIFEST} cannot be read (it has no 'files' table)", skip
        ) from None
    for name in sorted(p.name for p in folder.glob("*.safetensors")):
        if name not in files:
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
    return True
