"""FSDP (torch's fully_shard) distillation on 2 CPU processes over gloo, launched by
`accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2`.

Against one process that sees the same global batches, the losses agree within 1e-5 relative
and the weights within 1e-5 absolute: the arithmetic is the same, only the reduction order
differs (each rank's gradient is computed on its own sequence and the two are averaged by a
reduce-scatter, where one process sums both sequences inside one backward; the clipping norm
is the all-reduced sum of each shard's squared norm). That changes gradients by float32
rounding only; after the 2 steps the weights differ by a few 1e-7, exactly as DDP's do, while a
real fault (a gradient lost or counted twice, a shard not updated) moves weights by about lr =
1e-3 a step (AdamW's update is lr x m / sqrt(v)), so 1e-5 separates the two (DDP's test uses
the same bounds). Losses are stored rounded to 6 places. Interrupted after a checkpoint (SIGKILL of the whole launch) and resumed from each
rank's shard of the weights and the AdamW state, the run reaches the uninterrupted one's
weights and losses to the bit."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, read_until, stop

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
FSDP = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def common(teacher, student, text, tokens):
    return [
        "--student",
        str(student),
        "--teacher",
        str(teacher),
        "--data",
        str(text),
        "--tokens",
        str(tokens),
        "--seqlen",
        "32",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--no-progress",
    ]


@pytest.mark.parametrize("kl_chunk", ["0", pytest.param("16", marks=pytest.mark.slow)])
def test_fsdp_two_processes_match_one(distill_dirs, tmp_path, kl_chunk):
    """Whole logits, and the chunked loss, which applies the root unit's head after the forward
    (its gradient must reach the reduce-scatter: the head is the tied embedding)."""
    teacher, student, text = distill_dirs
    args = [*common(teacher, student, text, 256), "--kl-chunk", kl_chunk]
    two = subprocess.Popen(
        [
            *LAUNCH,
            *FSDP,
            "-m",
            "compress.cli.distill",
            *args,
            "--batch-size",
            "1",
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=ROOT,
        env=env(),
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
                *args,
                "--batch-size",
                "2",
                "--out",
                str(tmp_path / "one"),
            ],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        _, err = two.communicate(timeout=300)
    finally:
        stop(two)  # never left running, whatever failed
    assert two.returncode == 0, err[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    assert "fsdp: the student sharded over 2 processes in 3 units" in err  # not DDP
    s2 = json.loads((tmp_path / "two" / "distill.json").read_text())
    s1 = json.loads((tmp_path / "one" / "distill.json").read_text())
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    assert s2["parallel"] == "fsdp" and s1["parallel"] == "none"
    assert s2["steps"] == s1["steps"] == 2 and s2["tokens"] == s1["tokens"] == 256
    for a, b in zip(s1["losses"], s2["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-6  # losses are rounded to 6 places
    w1 = load_file(str(tmp_path / "one" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "model.safetensors"))
    base = load_file(str(student / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for name in w1:
        assert not torch.equal(w1[name], base[name]) or "norm" in name or "embed" in name
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp_kill_and_resume_reaches_the_same_weights(distill_dirs, tmp_path):
    """10 steps of 2 x 2 x 32 tokens, a checkpoint every 3; the launch is killed right after the
    first one, resumed, and compared with a launch that never checkpoints."""
    teacher, student, text = distill_dirs
    args = [
        *LAUNCH,
        *FSDP,
        "-m",
        "compress.cli.distill",
        *common(teacher, student, text, 1280),
        "--batch-size",
        "1",
    ]
    ckpt = tmp_path / "ckpt"
    killed_args = [
        *args,
        "--out",
        str(tmp_path / "b"),
        "--checkpoint-every",
        "3",
        "--checkpoint-dir",
        str(ckpt),
    ]
    killed = subprocess.Popen(
        killed_args,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # kill both ranks and the launcher after the first checkpoint
        if read_until(killed.stderr, lambda line: line.startswith("checkpoint "), 300):
            ranks = psutil.Process(killed.pid).children(recursive=True)  # own sessions (torchrun)
            for proc in [*ranks, psutil.Process(killed.pid)]:
                proc.send_signal(signal.SIGKILL)
            psutil.wait_procs(ranks, timeout=60)
        killed.wait(timeout=300)
    finally:
        stop(killed)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "b").exists()
    [step] = list(ckpt.glob("step-*"))
    shards = {p.name: p.stat().st_size for p in (step / "dcp").glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    assert not (step / "model.safetensors").exists() and not (step / "optimizer.pt").exists()
    full = 3 * 4 * sum(t.numel() for t in load_file(str(student / "model.safetensors")).values())
    assert all(size < 0.7 * full for size in shards.values())  # weights + 2 moments, ~half each

    res = subprocess.run(
        killed_args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    whole = subprocess.run(
        [*args, "--out", str(tmp_path / "a")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    b = json.loads((tmp_path / "b" / "distill.json").read_text())
    a = json.loads((tmp_path / "a" / "distill.json").read_text())
    assert b["resumed_from"] == 3 and b["steps"] == a["steps"] == 10 and a["resumed_from"] == 0
    assert a["losses"] == b["losses"]
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert not ckpt.exists()  # removed once complete


# ---- refusals before any work -------------------------------------------------------------------


@pytest.fixture
def fsdp_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.delenv("FSDP_OFFLOAD_PARAMS", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"FSDP_VERSION": "1"}, "--fsdp_version 2"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "parameter offload"),
        ({"--compile": None}, "distill.compile"),
    ],
)
def test_cli_refuses_what_fsdp_cannot_run(fsdp_env, tmp_path, capsys, setting, message):
    from compress.cli.distill import main

    argv = [
        "--student",
        str(tmp_path / "absent"),
        "--teacher",
        str(tmp_path / "absent"),
        "--data",
        str(tmp_path / "absent.txt"),
        "--out",
        str(tmp_path / "out"),
        "--tokens",
        "64",
    ]
    for key, value in setting.items():
        if key.startswith("--"):
            argv += [key] + ([value] if value is not None else [])
        else:
            fsdp_env.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        main(argv)  # refused before the (absent) models are read
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_pipeline_refuses_before_work(fsdp_env):
    from compress.errors import CompressError
    from compress.recipe.config import check_distributed
    from tests.conftest import compose

    assert check_distributed(compose("minitron_width", ["distill.kl_chunk=4096"])) == 2
    with pytest.raises(CompressError, match="distill.compile"):
        check_distributed(compose("minitron_width", ["distill.compile=true"]))
    fsdp_env.setenv("FSDP_VERSION", "1")
    with pytest.raises(CompressError, match="--fsdp_version 2"):
        check_distributed(compose("minitron_width"))
    fsdp_env.setenv("FSDP_VERSION", "2")
    with pytest.raises(CompressError, match=r"stage\(s\) \['rtn'\]"):  # as under DDP
        check_distributed(compose("rtn_int4"))


@pytest.mark.slow
def test_pipeline_distill_fsdp_matches_one(tiny_dir, tmp_path):
    """`accelerate launch --use_fsdp ... -m compress recipe=minitron_width`: every process prunes
    the same, distillation is sharded, process 0 writes the run folder; the loss curve is one
    process's with the same global batch within 1e-5 relative (module docstring)."""
    from tests.conftest import TINY_OVERRIDES

    over = [
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
    two = subprocess.run(
        [
            *LAUNCH,
            *FSDP,
            "-m",
            "compress",
            *over,
            "distill.batch_size=1",
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = [line for line in two.stderr.splitlines()  # the ranks' own messages, not torchrun's
            if line and not line.startswith((" ", "W1", "E1", "I1", "Traceback", "=", "-"))
            and "it/s]" not in line]  # fmt: skip
    assert two.returncode == 0, "\n".join(said[-40:]) + "\n" + two.stderr[-3000:]
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            *over,
            "distill.batch_size=2",
            f"hydra.run.dir={tmp_path / 'one'}",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    r2 = json.loads((tmp_path / "two" / "report.json").read_text())["distill"]
    r1 = json.loads((tmp_path / "one" / "report.json").read_text())["distill"]
    assert r2["steps"] == r1["steps"] == 2
    assert r2["parallel"] == "fsdp" and r1["parallel"] == "none"
    for key in ("loss_first", "loss_last"):
        assert abs(r1[key] - r2[key]) <= 1e-5 * abs(r1[key]) + 1e-6, key
    w1 = load_file(str(tmp_path / "one" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "model.safetensors"))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5, msg=name)
