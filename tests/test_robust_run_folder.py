"""Killed, concurrent and starved runs leave nothing that loads, and the next writer cleans up.

A run (``python -m compress``) killed with SIGKILL at each point of its life (``PAUSE_POINTS``:
the pipeline stops there under ``COMPRESS_TEST_PAUSE_AT``) leaves a temporary or spill folder
that no loader accepts, and the next run into the same folder removes it. A second writer of a
folder is refused by its lock; a symlinked run folder is refused before any work; a full disk
is one paragraph and leaves nothing; Hydra's own files are refused and removed. Verification
covers every file of a folder, and the Python loaders verify by default."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import compress
from compress.decoder.model import load
from compress.errors import CompressError
from compress.io.checkpoint import load_run
from compress.io.manifest import check_loadable, verify_folder
from compress.io.run_folder import (
    INCOMPLETE,
    atomic_dir,
    commit_dir,
    leftovers,
    lock_folder,
    lock_path,
)
from compress.recipe.pipeline import PAUSE_ENV, PAUSE_POINTS, run
from compress.testing import overwrite, random_model, run_folder, tiny_config, tiny_tokenizer
from tests.conftest import ROOT, TINY_OVERRIDES, compose

FAST = [*TINY_OVERRIDES, "decode.enabled=false", "eval.compare_source=false"]
W = "model.safetensors"


def rtn_cfg(tiny_dir, *extra):
    return compose("rtn_int4", [f"model.path={tiny_dir}", *FAST, *extra])


def one_paragraph(text: str) -> bool:
    return "\n" not in text.strip() and "Traceback" not in text


def refused_everywhere(folder, needle: str, capsys) -> None:
    """``verify_folder``, ``load``, ``load_run`` and the decoder CLI all refuse ``folder``."""
    from compress.decoder.__main__ import main

    for call in (verify_folder, load, load_run):
        with pytest.raises(CompressError, match=re.escape(needle)):
            call(folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(folder), "--prompt", "the", "--device", "cpu", "--dtype", "float32"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def q(tmp_path_factory):
    """A verified run folder (rtn int4) with its own tiny tokenizer."""
    root = tmp_path_factory.mktemp("robust")
    return run_folder(
        root / "q", random_model(tiny_config()), tiny_tokenizer(), rtn={"group_size": 16}
    )


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# class 1: a run killed with SIGKILL at each point


def wait_for_pause(proc, err_path: Path, point: str, deadline_s: float = 300) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        text = err_path.read_text(errors="replace") if err_path.exists() else ""
        if f"paused at {point}" in text:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {point}:\n{text[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"the run did not reach {point} within {deadline_s} s:\n{text[-3000:]}")


def start_paused(tiny_dir, out: Path, point: str, log: Path) -> subprocess.Popen:
    args = [f"model.path={tiny_dir}", f"hydra.run.dir={out}", *FAST]
    env = dict(os.environ, **{PAUSE_ENV: point})
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "compress", "recipe=rtn_int4", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_sigkill_at_each_point_leaves_nothing_loadable_and_the_next_run_removes_it(
    point, tiny_dir, tmp_path, capsys
):
    out = tmp_path / "runs" / "run"
    log = tmp_path / "stderr.txt"
    proc = start_paused(tiny_dir, out, point, log)
    try:
        wait_for_pause(proc, log, point)
        # alive, it holds the folder: a second writer is refused and removes none of its files
        before = leftovers(out)
        assert before
        with pytest.raises(
            CompressError, match=rf"being written by another run \(process {proc.pid}"
        ):
            run(rtn_cfg(tiny_dir), out)
        with pytest.raises(CompressError, match="being written by another run"):
            compress.save(random_model(tiny_config()), out)
        assert leftovers(out) == before and out.is_dir()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)

    left = leftovers(out)
    kinds = sorted({p.name.split(".")[2].split("-")[0] for p in left})
    assert (
        kinds
        == {
            "spill_made": ["layers"],
            "temp_made": ["layers", "tmp"],
            "weights_written": ["tmp"],
            "manifest_written": ["tmp"],
        }[point]
    )
    assert not any(out.iterdir())  # Hydra's placeholder: the run never committed
    for folder in left:
        refused_everywhere(folder, "is not a finished run folder", capsys)
    tmp = [p for p in left if ".tmp-" in p.name]
    if point in ("weights_written", "manifest_written"):
        assert (tmp[0] / W).is_file() and (tmp[0] / "config.json").is_file()
        assert ((tmp[0] / "manifest.json").is_file()) == (point == "manifest_written")
        renamed = copy(tmp[0], tmp_path / "renamed")  # under any name, its mark refuses it
        refused_everywhere(renamed, f"holds {INCOMPLETE}", capsys)
        load(tmp[0], verify=False)  # an explicit skip stays possible

    report = run(rtn_cfg(tiny_dir), out)  # the next run into the same folder
    assert report["ppl"] > 0
    assert leftovers(out) == [] and not lock_path(out).exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    assert verify_folder(out) is True
    load(out)


def test_a_run_refused_by_the_lock_leaves_the_other_runs_placeholder(tiny_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()  # the other run's Hydra placeholder
    spill = tmp_path / ".run.layers-abcd1234"
    spill.mkdir()
    with lock_folder(out, "run folder"):
        with pytest.raises(CompressError, match="two runs cannot write one folder") as e:
            run(rtn_cfg(tiny_dir), out)
        assert one_paragraph(str(e.value))
        assert out.is_dir() and spill.is_dir()  # neither removed: they are the live run's
    assert not lock_path(out).exists()  # released and removed


def test_a_stale_lock_file_does_not_block(tmp_path):
    final = tmp_path / "f"
    lock_path(final).write_text("999999\n")  # left by a killed writer: no process holds it
    with lock_folder(final, "the folder") as lock:
        assert lock.held and lock_path(final).read_text().strip() == str(os.getpid())
    assert not lock_path(final).exists()


def test_sweep_removes_only_this_folders_leftovers(tmp_path):
    final = tmp_path / "run"
    stale = [tmp_path / ".run.tmp-abcd_123", tmp_path / ".run.layers-zz9yy8xx"]
    kept = [
        tmp_path / ".run.distill",  # distillation's resumable checkpoints
        tmp_path / ".other.tmp-abcd1234",  # another folder's
        tmp_path / ".run.tmp-x",  # not a temporary folder's name
        tmp_path / ".run.tmp-x.tmp-abcd1234",  # the temporary folder of 'run.tmp-x'
    ]
    for p in stale + kept:
        p.mkdir()
        (p / "f").write_text("x")
    compress.save(random_model(tiny_config()), final)
    assert all(not p.exists() for p in stale)
    assert all(p.is_dir() for p in kept)


def test_save_writes_a_manifest_and_refuses_an_added_chat_template(tmp_path):
    model = random_model(tiny_config())
    folder = compress.save(model, tmp_path / "s", tokenizer=tiny_tokenizer())
    names = set(json.loads((folder / "manifest.json").read_text())["files"])
    assert {"config.json", W, "tokenizer.json"} <= names and INCOMPLETE not in names
    assert verify_folder(folder) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no lock, no temporary folder
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(CompressError, match="'chat_template.jinja' is not listed"):
        load_run(folder)
    load_run(folder, verify=False)


# a symbolic link as the run folder


def test_a_symlinked_run_folder_is_refused_before_any_work(tiny_dir, tmp_path):
    from compress.__main__ import rewrite_argv

    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(CompressError, match="symbolic link.*'.*target'") as e:
        run(rtn_cfg(tiny_dir), link)
    assert one_paragraph(str(e.value))
    with pytest.raises(CompressError, match="symbolic link"):
        rewrite_argv(["recipe=rtn_int4", f"hydra.run.dir={link}"])  # before Hydra makes it
    with pytest.raises(CompressError, match="symbolic link"):
        compress.save(random_model(tiny_config()), link)
    assert link.is_symlink() and target.is_dir() and not any(target.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_commit_keeps_the_work_when_the_folder_was_filled(tmp_path):
    final = tmp_path / "f"
    final.mkdir()
    tmp = atomic_dir(final)
    (tmp / "config.json").write_text("{}")
    (final / "other").write_text("x")
    with pytest.raises(CompressError, match="kept as") as e:
        commit_dir(tmp, final)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("f.complete-")]
    assert len(kept) == 1 and str(kept[0]) in str(e.value)
    assert sorted(p.name for p in kept[0].iterdir()) == ["config.json"]  # no mark: complete
    assert not tmp.exists() and (final / "other").read_text() == "x"


def test_commit_tolerates_a_placeholder_removed_meanwhile(tmp_path):
    final = tmp_path / "f"
    final.mkdir()
    tmp = atomic_dir(final)
    (tmp / "x").write_text("x")
    final.rmdir()  # e.g. the refused second run's cleanup
    commit_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["x"]


# a full disk


def no_space(code):
    def writer(folder, *args, **kwargs):
        path = Path(folder) / "model.safetensors"
        path.write_bytes(b"\0" * 1000)  # half-written
        raise OSError(code, os.strerror(code), str(path))

    return writer


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
def test_a_full_disk_during_a_run_is_one_paragraph_and_leaves_nothing(
    code, tiny_dir, tmp_path, monkeypatch
):
    import compress.io.checkpoint

    monkeypatch.setattr(compress.io.checkpoint, "write_sharded", no_space(code))
    out = tmp_path / "run"
    with pytest.raises(CompressError) as e:
        run(rtn_cfg(tiny_dir), out)
    msg = str(e.value)
    assert one_paragraph(msg) and f"run folder '{out}'" in msg and "model.safetensors" in msg
    assert ("disk is full" if code == errno.ENOSPC else "ulimit -f") in msg
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary, no spill, no lock


def test_a_full_disk_writing_the_manifest(tiny_dir, tmp_path, monkeypatch):
    import compress.recipe.pipeline

    def full(folder, *a, **k):
        (Path(folder) / "manifest.json").write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(compress.recipe.pipeline, "write_manifest", full)
    with pytest.raises(CompressError, match="disk is full.*Free space"):
        run(rtn_cfg(tiny_dir), tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_save(tmp_path, monkeypatch):
    import compress.io.checkpoint

    monkeypatch.setattr(compress.io.checkpoint, "write_sharded", no_space(errno.ENOSPC))
    with pytest.raises(CompressError, match=r"the folder '.*s' could not be written: the disk"):
        compress.save(random_model(tiny_config()), tmp_path / "s")
    assert list(tmp_path.iterdir()) == []


# Hydra's own files in the run folder


@pytest.mark.parametrize(
    "override, written",
    [("hydra.output_subdir=.hydra", "'.hydra'"), ("hydra/job_logging=default", ".log'")],
)
def test_hydra_files_in_the_run_folder_are_refused_and_removed(
    override, written, tiny_dir, tmp_path
):
    out = tmp_path / "run"
    args = ["recipe=rtn_int4", f"model.path={tiny_dir}", f"hydra.run.dir={out}", *FAST, override]
    r = subprocess.run(
        [sys.executable, "-m", "compress", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = (r.stdout + r.stderr).strip()  # hydra/job_logging=default logs to stdout
    assert r.returncode == 2, text[-2000:]
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert written in text and "hydra.output_subdir=null" in text
    assert list(tmp_path.iterdir()) == []  # the folder and what Hydra wrote are gone


# class 2: verification covers every file


@pytest.mark.parametrize(
    "name", ["chat_template.jinja", "tokenizer.model", "sub/extra.json", ".hidden"]
)
def test_an_unlisted_file_is_refused(q, tmp_path, name):
    d = copy(q, tmp_path / "d")
    (d / name).parent.mkdir(exist_ok=True)
    (d / name).write_text("{}")
    with pytest.raises(CompressError, match=f"'{name}' is not listed in manifest.json") as e:
        verify_folder(d)
    assert "--no-verify" in str(e.value) and one_paragraph(str(e.value))
    with pytest.raises(CompressError, match="verify=False"):
        load(d)
    load(d, verify=False)


def test_documents_and_hub_bookkeeping_are_not_checked(q, tmp_path):
    d = copy(q, tmp_path / "d")
    for name in ("README.md", "report.md", "report.json", "sub/README.md", ".gitattributes"):
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text("edited")
    hub = d / ".cache" / "huggingface" / "download"
    hub.mkdir(parents=True)
    (hub / "model.safetensors.metadata").write_text("x")
    assert verify_folder(d) is True
    load(d)


def test_a_run_folder_without_its_manifest_is_refused(q, tmp_path):
    d = copy(q, tmp_path / "d")
    (d / "report.json").write_text("{}")
    (d / "manifest.json").unlink()
    with pytest.raises(CompressError, match="report.json but no manifest.json.*--no-verify"):
        verify_folder(d)
    with pytest.raises(CompressError, match="no manifest.json.*verify=False"):
        load_run(d)
    load_run(d, verify=False)


def test_a_plain_hf_folder_loads_unverified(tiny_dir):
    assert verify_folder(tiny_dir) is False
    check_loadable(tiny_dir)  # a source model folder: no manifest, not ours


def test_loaders_verify_by_default(q, tmp_path):
    d = copy(q, tmp_path / "d")
    overwrite(d / W, "model.layers.0.mlp.up_proj.weight_packed")
    for call in (load, load_run):
        with pytest.raises(CompressError, match="up_proj.weight_packed.*verify=False"):
            call(d)
        call(d, verify=False)


def test_a_verified_folder_is_not_hashed_twice_unless_it_changed(q, tmp_path, monkeypatch):
    import compress.io.manifest as manifest

    d = copy(q, tmp_path / "d")
    assert verify_folder(d)
    calls = []
    real = manifest._check_safetensors
    monkeypatch.setattr(manifest, "_check_safetensors", lambda *a: calls.append(a[1]) or real(*a))
    check_loadable(d)  # the CLIs verify, then load: one pass of sha256
    assert calls == []
    overwrite(d / W, "model.norm.weight")  # same size; mtime and content change
    with pytest.raises(CompressError, match="model.norm.weight"):
        check_loadable(d)
    assert calls == [W]


def test_decoder_cli_no_verify_reaches_the_loader(q, tmp_path, capsys):
    """``--no-verify`` stays possible although ``load`` verifies by default."""
    from compress.decoder.__main__ import main

    d = copy(q, tmp_path / "d")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    args = [str(d), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"]
    args += ["--dtype", "float32", "--no-warmup"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "'chat_template.jinja' is not listed" in capsys.readouterr().err
    main([*args, "--no-verify"])
    assert "2 generated" in capsys.readouterr().err


def test_the_server_refuses_an_unlisted_chat_template(q, tmp_path, capsys):
    from compress.serve.__main__ import main

    d = copy(q, tmp_path / "d")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(SystemExit) as e:
        main([str(d), "--port", "0"])
    assert e.value.code == 2
    assert "'chat_template.jinja' is not listed" in capsys.readouterr().err


def test_a_leftover_as_the_source_is_refused_before_loading(tmp_path):
    fp = compress.save(random_model(tiny_config()), tmp_path / "fp", tokenizer=tiny_tokenizer())
    (fp / "manifest.json").unlink()
    leftover = fp.rename(tmp_path / ".run.tmp-abcd1234")  # a killed run's, with its weights
    with pytest.raises(CompressError, match="temporary folder of a run into 'run'"):
        run(compose("rtn_int4", [f"model.path={leftover}", *FAST]), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not lock_path(tmp_path / "out").exists()
