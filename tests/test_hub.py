"""Hub push against a fake Hub on 127.0.0.1 (tests/hub_server.py): what it receives equals the run folder."""

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from compress.errors import CompressError
from compress.io.manifest import write_manifest
from compress.recipe.hub import push
from compress.recipe.model_card import write_model_card
from tests.conftest import ROOT, TINY_OVERRIDES, compose
from tests.hub_server import FakeHub

TOKEN = "hf_fake_secret_0123456789"


@pytest.fixture
def online(monkeypatch):
    """Offline mode off, whatever the shell exports (huggingface_hub reads HF_HUB_OFFLINE at
    import, into its constants)."""
    import huggingface_hub.constants as constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture
def hub(monkeypatch, online):
    """A fake Hub; the client sends the token from HF_TOKEN and uses plain LFS, not Xet."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    with FakeHub() as server:
        yield server


def make_run(folder: Path, weights: bytes) -> Path:
    """A run folder as the pipeline leaves it: checkpoint, tokenizer, report, model card, manifest."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "quantization_config": {
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": 64,
                    "zero_point": True,
                    "version": "gemm",
                },
            }
        )
    )
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    report = {
        "recipe": "awq_int4",
        "model": "tiny",
        "ppl": 21.5,
        "ppl_windows": 2,
        "seqlen": 64,
        "weight_bytes": len(weights),
        "stages": {"awq": 1.0},
        "elapsed_s": 2.0,
    }
    (folder / "report.json").write_text(json.dumps(report))
    recipe = {
        "name": "awq_int4",
        "stages": ["awq"],
        "model": {"path": "Org/Base", "dtype": "float32"},
    }
    write_model_card(folder, report, recipe, {"name": "Org/Base", "path": "Org/Base"})
    write_manifest(
        folder,
        recipe,
        SimpleNamespace(name="Org/Base", path="Org/Base", sha256="0"),
        report["stages"],
        False,
    )
    return folder


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path / "awq_int4", os.urandom(300_000))


def snapshot(folder: Path) -> dict:
    """sha256 and mtime of every file, to prove a push only reads."""
    return {
        p.relative_to(folder).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def local_files(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def sent_files(folder: Path, repo_id: str) -> dict:
    """What a push of ``folder`` to ``repo_id`` uploads: its files, the card's ORG/NAME filled."""
    files = local_files(folder)
    note = b"Replace `ORG/NAME` below with this repository's id.\n\n"
    files["README.md"] = (
        files["README.md"].replace(note, b"").replace(b"ORG/NAME", repo_id.encode())
    )
    return files


def test_push_sends_the_run_folder(hub, run_dir, capsys, caplog):
    before = snapshot(run_dir)
    caplog.set_level(logging.DEBUG)
    url = push(run_dir, "org/tiny-awq", endpoint=hub.endpoint)

    repo = hub.repos["org/tiny-awq"]
    assert repo["branches"]["main"] == sent_files(run_dir, "org/tiny-awq")  # byte for byte
    assert len(repo["commits"]) == 1 and repo["commits"][0]["files"] == sorted(local_files(run_dir))
    card = repo["branches"]["main"]["README.md"].decode()
    assert 'from_pretrained("org/tiny-awq"' in card and "ORG/NAME" not in card  # filled in
    assert "Replace `" not in card
    assert "ORG/NAME" in (run_dir / "README.md").read_text()  # the local card is left as written
    assert url.endswith(repo["commits"][0]["oid"])
    weights = (run_dir / "model.safetensors").read_bytes()
    assert hub.lfs == {hashlib.sha256(weights).hexdigest(): weights}  # large file: the LFS path
    assert ("PUT", f"/lfs/{hashlib.sha256(weights).hexdigest()}") in hub.requests
    assert repo["private"] is False
    assert f"Bearer {TOKEN}" in hub.auth
    assert snapshot(run_dir) == before  # the local folder is untouched
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + caplog.text
    assert TOKEN not in (run_dir / "README.md").read_text()


def test_private_repo_and_revision(hub, run_dir):
    push(run_dir, "org/private-run", private=True, revision="int4-g64", endpoint=hub.endpoint)
    repo = hub.repos["org/private-run"]
    assert repo["private"] is True
    assert repo["branches"]["int4-g64"] == sent_files(run_dir, "org/private-run")
    assert repo["branches"]["main"] == {}
    assert [c["revision"] for c in repo["commits"]] == ["int4-g64"]


def test_private_refused_on_existing_public_repo(hub, run_dir):
    push(run_dir, "org/public", endpoint=hub.endpoint)
    with pytest.raises(CompressError, match="already exists and is public"):
        push(run_dir, "org/public", private=True, revision="other", endpoint=hub.endpoint)
    assert (
        len(hub.repos["org/public"]["commits"]) == 1
        and "other" not in hub.repos["org/public"]["branches"]
    )


def test_dry_run_lists_and_uploads_nothing(hub, run_dir, capsys):
    assert push(run_dir, "org/tiny", private=True, dry_run=True, endpoint=hub.endpoint) is None
    out = capsys.readouterr().out
    assert hub.requests == []
    assert f"{hub.endpoint}/org/tiny (private, revision main)" in out
    for name, data in sent_files(run_dir, "org/tiny").items():
        assert any(line.split() == [f"{len(data):,}", name] for line in out.splitlines()), name


def test_failure_mid_upload_says_what_the_hub_holds(hub, tmp_path, run_dir):
    push(run_dir, "org/tiny", endpoint=hub.endpoint)  # the Hub holds run A
    run_b = make_run(
        tmp_path / "run_b", os.urandom(300_000)
    )  # same tokenizer and config, other weights
    before = snapshot(run_b)
    hub.fail = ("PUT", "/lfs/", 1, 507)  # the weights' upload fails
    with pytest.raises(CompressError) as e:
        push(run_b, "org/tiny", endpoint=hub.endpoint)
    msg = str(e.value)
    assert "upload and commit" in msg and "507" in msg
    sent = sent_files(run_b, "org/tiny")
    remote = hub.repos["org/tiny"]["branches"]["main"]
    same = sorted(n for n, d in sent.items() if remote.get(n) == d)
    assert {"config.json", "tokenizer.json"} <= set(same) and "model.safetensors" not in same
    assert (
        f"holds {len(same)} of the {len(local_files(run_b))} files of the run folder ({', '.join(same)})"
        in msg
    )
    not_there = msg.split("different there: ")[1].split(".\n")[0].split(", ")
    assert set(not_there) == set(local_files(run_b)) - set(same)
    assert len(hub.repos["org/tiny"]["commits"]) == 1  # the failed push committed nothing
    assert snapshot(run_b) == before and TOKEN not in msg


def test_failure_at_commit_after_lfs_upload(hub, run_dir):
    hub.fail = ("POST", "/api/models/org/tiny/commit/", 1, 507)
    with pytest.raises(CompressError) as e:
        push(run_dir, "org/tiny", endpoint=hub.endpoint)
    assert hub.lfs  # the weights reached LFS storage, yet the repo holds none of it
    assert f"holds 0 of the {len(local_files(run_dir))} files" in str(e.value)
    assert hub.repos["org/tiny"]["commits"] == []


def test_unreachable_hub(hub, run_dir):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(CompressError, match="create the repository.*\nNothing was uploaded"):
        push(run_dir, "org/tiny", endpoint=endpoint)


def test_refuses_incomplete_folder_and_missing_token(hub, run_dir, monkeypatch, tmp_path):
    (run_dir / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(CompressError, match="changed since the run"):
        push(run_dir, "org/tiny", endpoint=hub.endpoint)
    with pytest.raises(CompressError, match="not a run folder"):
        push(tmp_path, "org/tiny", endpoint=hub.endpoint)
    import huggingface_hub.constants as constants

    good = make_run(tmp_path / "good", b"w" * 100)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(CompressError, match="HF_TOKEN"):
        push(good, "org/tiny", endpoint=hub.endpoint)
    assert hub.requests == []


def test_cli_push_with_hf_endpoint(hub, run_dir):
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress.recipe.hub",
            "push",
            str(run_dir),
            "--repo-id",
            "org/cli",
            "--revision",
            "v1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert hub.repos["org/cli"]["branches"]["v1"] == sent_files(run_dir, "org/cli")
    assert TOKEN not in out.stdout + out.stderr


def test_pipeline_writes_card_and_pushes(hub, tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from compress.recipe.pipeline import run

    with pytest.raises(CompressError, match="hub.repo_id"):  # checked before any work
        run(compose("fp", [f"model.path={tiny_dir}", "hub.push=true"]), tmp_path / "never")
    assert not (tmp_path / "never").exists()

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)  # what HF_ENDPOINT sets at import
    out = tmp_path / "run"
    run(
        compose(
            "fp", [f"model.path={tiny_dir}", *TINY_OVERRIDES, "hub.push=true", "hub.repo_id=org/fp"]
        ),
        out,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert "README.md" in manifest["files"]  # the card is hashed with the run
    meta = yaml.safe_load((out / "README.md").read_text().split("---\n")[1])
    assert meta["pipeline_tag"] == "text-generation" and "compress" in meta["tags"]
    assert hub.repos["org/fp"]["branches"]["main"] == local_files(out)


def test_xet_pipeline_path_with_regular_files(monkeypatch, online, run_dir):
    """With hf_xet installed, upload_folder takes its pipelined path; small regular files need no Xet server."""
    import huggingface_hub.constants as constants

    pytest.importorskip("hf_xet")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    with FakeHub(lfs_suffixes=()) as hub:
        push(run_dir, "org/xet", endpoint=hub.endpoint)
        assert hub.repos["org/xet"]["branches"]["main"] == sent_files(run_dir, "org/xet")
        assert not hub.lfs
        hub.fail = (
            "POST",
            "/api/models/org/xet/commit/",
            1,
            507,
        )  # a second push fails at its commit
        with pytest.raises(
            CompressError, match=f"holds {len(local_files(run_dir))} of the"
        ):  # from the first
            push(run_dir, "org/xet", endpoint=hub.endpoint)
