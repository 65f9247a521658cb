"""The distillation CLI on 2 CPU processes (DDP over gloo) matches one process that sees the
same global batches.

accelerate 1.15's `accelerate launch --cpu --num_processes 2` starts a single process unless an
MPI hostfile is given (its "simple launcher"); `--multi_gpu --num_processes 2` starts two through
torchrun, and on a machine without CUDA the trainer's Accelerator(cpu=True) joins them into a
MULTI_CPU group over gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, stop

ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def test_two_processes_match_one(distill_dirs, tmp_path):
    teacher, student, text = distill_dirs
    common = [
        "--student",
        str(student),
        "--teacher",
        str(teacher),
        "--data",
        str(text),
        "--tokens",
        "256",
        "--seqlen",
        "32",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--no-progress",
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""
    )  # the CPU path, also on a GPU machine
    two = subprocess.Popen(
        [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "compress.cli.distill",
            *common,
            "--batch-size",
            "1",
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        one = subprocess.run(
            [
                sys.executable,
                "-m",
                "compress.cli.distill",
                *common,
                "--batch-size",
                "2",
                "--out",
                str(tmp_path / "one"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        out, err = two.communicate(timeout=300)
    finally:
        stop(two)  # never left running, whatever failed
    assert two.returncode == 0, err[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    s2 = json.loads((tmp_path / "two" / "distill.json").read_text())
    s1 = json.loads((tmp_path / "one" / "distill.json").read_text())
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    assert s2["steps"] == s1["steps"] == 2 and s2["tokens"] == s1["tokens"] == 256
    for a, b in zip(s1["losses"], s2["losses"]):
        assert abs(a - b) < 1e-4 * abs(a)
    w1 = load_file(str(tmp_path / "one" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "model.safetensors"))
    base = load_file(str(student / "model.safetensors"))
    for name in w1:
        assert not torch.equal(w1[name], base[name]) or "norm" in name or "embed" in name
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_pipeline_distill_two_processes_match_one(tiny_dir, tmp_path):
    """`accelerate launch -m compress recipe=minitron_width` with 2 gloo processes: every process
    prunes the same, distillation splits the global batch, process 0 writes the run folder; the
    loss curve equals one process's with the same global batch within 1e-5 relative."""
    from tests.conftest import TINY_OVERRIDES

    common = [
        "recipe=minitron_width",
        f"model.path={tiny_dir}",
        *TINY_OVERRIDES,
        "decode.enabled=false",
        "distill.tokens=256",
        "distill.seqlen=32",
        "distill.grad_accum=2",
        "distill.lr=1e-3",
        "distill.tokens_per_step=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    two = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "compress",
            *common,
            "distill.batch_size=1",
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        one = subprocess.run(
            [
                sys.executable,
                "-m",
                "compress",
                *common,
                "distill.batch_size=2",
                f"hydra.run.dir={tmp_path / 'one'}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        _, err = two.communicate(timeout=600)
    finally:
        stop(two)  # never left running, whatever failed
    assert two.returncode == 0, err[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    r2 = json.loads((tmp_path / "two" / "report.json").read_text())["distill"]
    r1 = json.loads((tmp_path / "one" / "report.json").read_text())["distill"]
    assert r2["steps"] == r1["steps"] == 2  # 256 tokens, 2 x 2 x 32 a step
    for key in ("loss_first", "loss_last"):
        assert abs(r1[key] - r2[key]) <= 1e-5 * abs(r1[key]), key
    for (s1, a), (s2, b) in zip(r1["curve"], r2["curve"]):
        assert (
            s1 == s2 and abs(a - b) <= 1e-5 * abs(a) + 1e-4
        )  # curve points are rounded to 4 places
