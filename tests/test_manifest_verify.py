"""A run folder is checked against its manifest's sha256 when it is loaded: a damaged tensor is
refused by name (the decoder, the server, the pipeline's model.path), a skip flag lets an edited
folder through, and the per-tensor hashes match hashlib over the bytes the safetensors header
points at (the format's layout, read here independently)."""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from compress.errors import CompressError
from compress.io.manifest import verify_folder
from compress.testing import (
    overwrite,
    random_model,
    run_folder,
    tiny_config,
    tiny_tokenizer,
)
from tests.conftest import run_bench

W = "model.safetensors"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    tok = tiny_tokenizer()
    q = run_folder(root / "q", random_model(tiny_config()), tok, rtn={"group_size": 16})
    fp = run_folder(root / "fp", random_model(tiny_config(), seed=1), tok)
    return root, q, fp


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def test_manifest_holds_each_tensors_sha256(folders):
    _, q, _ = folders
    entry = json.loads((q / "manifest.json").read_text())["files"][W]
    start, h = header(q / W)
    data = (q / W).read_bytes()
    names = [k for k in h if k != "__metadata__"]
    assert sorted(entry["tensors"]) == sorted(names)
    for k in names:
        b, e = h[k]["data_offsets"]
        assert entry["tensors"][k] == hashlib.sha256(data[start + b : start + e]).hexdigest()
    assert entry["header_sha256"] == hashlib.sha256(data[:start]).hexdigest()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert verify_folder(q) is True


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.0.self_attn.k_proj.weight_packed",
        "model.layers.1.mlp.down_proj.weight_scale",
        "model.layers.1.mlp.gate_proj.weight_zero_point",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ],
)
def test_a_damaged_tensor_is_refused_by_name(folders, tmp_path, tensor):
    _, q, _ = folders
    bad = copy(q, tmp_path / "bad")
    overwrite(bad / W, tensor, b"\x01\x02", at=0)
    with pytest.raises(CompressError) as e:
        verify_folder(bad)
    msg = str(e.value)
    assert f"tensor '{tensor}'" in msg and "--no-verify" in msg and "\n" not in msg
    others = json.loads((q / "manifest.json").read_text())["files"][W]["tensors"]
    assert not any(f"'{k}'" in msg for k in others if k != tensor)


def test_other_damage_is_named(folders, tmp_path):
    _, q, _ = folders
    cases = {
        "truncated": lambda d: (d / W).write_bytes((d / W).read_bytes()[:-100]),
        "missing": lambda d: (d / "tokenizer.json").unlink(),
        "extra": lambda d: shutil.copyfile(d / W, d / "model-2.safetensors"),
        "config": lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().replace("1e5", "2e5").replace("100000.0", "2e5")
        ),
        "manifest": lambda d: (d / "manifest.json").write_text("{"),
        "header": lambda d: _rename_metadata(d / W),
    }
    _, h = header(q / W)
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    expect = {
        "truncated": f"tensor '{last}'",  # the last tensor in the file loses its bytes
        "missing": "'tokenizer.json', listed in manifest.json, is missing",
        "extra": "'model-2.safetensors' is not listed",
        "config": "'config.json' (does not match|has [0-9,]+ bytes where)",
        "manifest": "manifest.json cannot be read",
        "header": "the header of 'model.safetensors'",
    }
    for name, edit in cases.items():
        d = copy(q, tmp_path / name)
        edit(d)
        with pytest.raises(CompressError, match=expect[name]):
            verify_folder(d)


def _rename_metadata(path):
    """Same tensors and bytes, a different header (the metadata changed, same length)."""
    data = bytearray(path.read_bytes())
    i = data.index(b'"pt"')
    data[i : i + 4] = b'"PT"'
    path.write_bytes(bytes(data))


def test_a_manifest_without_tensor_hashes_still_refuses_the_file(folders, tmp_path):
    _, q, _ = folders
    d = copy(q, tmp_path / "old")
    m = json.loads((d / "manifest.json").read_text())
    for k in ("tensors", "header_sha256"):
        m["files"][W].pop(k)
    (d / "manifest.json").write_text(json.dumps(m))
    assert verify_folder(d)
    overwrite(d / W, "model.layers.0.self_attn.q_proj.weight_packed")
    with pytest.raises(CompressError, match="'model.safetensors' does not match"):
        verify_folder(d)


def test_a_folder_without_manifest_passes(folders, tmp_path):
    _, q, _ = folders
    d = copy(q, tmp_path / "plain")
    (d / "manifest.json").unlink()
    assert verify_folder(d) is False


def test_run_folder_files_are_0644(folders):
    _, q, _ = folders
    mask = os.umask(0)
    os.umask(mask)
    for p in q.iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p.name
    assert q.stat().st_mode & 0o777 == 0o777 & ~mask


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", *args], check=False, capture_output=True, text=True, timeout=300
    )


def test_decoder_cli_refuses_a_damaged_folder_and_runs_it_with_no_verify(folders, tmp_path):
    _, q, _ = folders
    bad = copy(q, tmp_path / "bad")
    overwrite(bad / W, "model.layers.1.self_attn.o_proj.weight_packed")
    args = ["compress.decoder", str(bad), "--prompt", "the quick", "--max-new-tokens", "2"]
    args += ["--device", "cpu", "--dtype", "float32", "--no-warmup"]
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "tensor 'model.layers.1.self_attn.o_proj.weight_packed'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli(*args, "--no-verify")
    assert r.returncode == 0, r.stderr


def test_server_cli_refuses_a_damaged_folder_before_loading(folders, tmp_path):
    from compress.serve.__main__ import main

    _, q, _ = folders
    bad = copy(q, tmp_path / "bad")
    overwrite(bad / W, "model.layers.0.mlp.up_proj.weight_packed")
    with pytest.raises(SystemExit) as e:
        main([str(bad), "--port", "0"])
    assert e.value.code == 2


def test_pipeline_refuses_a_damaged_source_unless_told(folders, tmp_path):
    from compress.recipe.overrides import compose
    from compress.recipe.pipeline import check_run, run

    _, _, fp = folders
    bad = copy(fp, tmp_path / "bad")
    overwrite(bad / W, "model.layers.0.self_attn.v_proj.weight")
    over = [f"model.path={bad}", "eval.windows=1", "eval.seqlen=16"]
    out = tmp_path / "out"
    with pytest.raises(CompressError, match="v_proj.weight.*model.verify=false"):
        run(compose("fp", over), out)
    assert not out.exists()
    check_run(compose("fp", over + ["model.verify=false"]), out)  # passes every check


def test_bench_verify_runs_at_a_tiny_size(tmp_path):
    """``eval/bench/bench_verify.py`` on a tiny model (the real figures: see the README)."""
    out = tmp_path / "verify.json"
    argv = ["--models", "tiny", "--rounds", 1, "--rtn", "--keep", tmp_path / "f", "--json", out]
    run_bench("bench_verify", *argv)
    r = json.loads(out.read_text())["tiny"]
    assert r["folder_bytes"] == sum(p.stat().st_size for p in (tmp_path / "f" / "tiny").iterdir())
    assert 0 < r["verify_s"] < r["verify_and_load_s"] and r["load_s"] > 0
