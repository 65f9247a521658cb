"""Kill distillation mid-way (SIGKILL after a checkpoint), resume, reach the uninterrupted weights."""

import json
import os
import signal
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, read_until, stop


def cli(teacher, student, text, out, ckpt, *extra):
    return [
        sys.executable,
        "-m",
        "compress.cli.distill",
        "--student",
        str(student),
        "--teacher",
        str(teacher),
        "--data",
        str(text),
        "--out",
        str(out),
        "--tokens",
        "384",
        "--seqlen",
        "32",
        "--batch-size",
        "1",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--checkpoint-every",
        "3",
        "--checkpoint-dir",
        str(ckpt),
        "--no-progress",
        *extra,
    ]


def test_kill_and_resume_reaches_the_same_weights(distill_dirs, tmp_path):
    teacher, student, text = distill_dirs
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # 6 steps of 2 x 32 tokens, a checkpoint after step 3; the uninterrupted run and the one to
    # kill run side by side (test_distill.py checks that other settings refuse a checkpoint)
    whole = subprocess.Popen(
        cli(teacher, student, text, tmp_path / "a", tmp_path / "ckpt_a"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        args = cli(teacher, student, text, tmp_path / "b", tmp_path / "ckpt_b")
        killed = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:  # kill right after the first checkpoint is complete
            if read_until(killed.stderr, lambda line: line.startswith("checkpoint "), 300):
                killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=300)
        finally:
            stop(killed)
        assert killed.returncode == -signal.SIGKILL
        assert not (tmp_path / "b").exists() and list((tmp_path / "ckpt_b").glob("step-*"))

        res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        _, err = whole.communicate(timeout=300)
        assert whole.returncode == 0, err[-3000:]
    finally:
        stop(whole)
    stats = json.loads((tmp_path / "b" / "distill.json").read_text())
    assert stats["resumed_from"] >= 3 and stats["steps"] == 6
    assert json.loads((tmp_path / "a" / "distill.json").read_text())["losses"] == stats["losses"]
    a, b = (
        load_file(str(tmp_path / "a" / "model.safetensors")),
        load_file(str(tmp_path / "b" / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not (tmp_path / "ckpt_b").exists()  # removed once complete
