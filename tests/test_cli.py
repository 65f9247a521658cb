"""``python -m compress`` as a newcomer meets it: usage, typos caught before any work, Ctrl-C."""

import os
import signal
import subprocess
import sys
import time

import pytest

from compress.__main__ import rewrite_argv
from compress.errors import CompressError
from tests.conftest import DATA, ROOT, TINY_OVERRIDES, read_until, stop


def cli(*args, env=None, timeout=120):
    env = dict(os.environ, COMPRESS_DATA_DIR=str(DATA), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "compress", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def recipe_lines() -> dict[str, str]:
    """Each recipe's first comment line, read straight from recipes/*.yaml."""
    out = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        if path.stem != "base":
            out[path.stem] = next(
                line for line in path.read_text().splitlines() if line.startswith("#")
            )[2:]
    return out


def test_help_and_bare_invocation_print_usage():
    helped = cli("--help")
    assert helped.returncode == 0 and helped.stdout.startswith(
        "usage: python -m compress recipe=NAME"
    )
    lines = recipe_lines()
    assert len(lines) >= 9
    for name, line in lines.items():  # one line per recipe, from its YAML
        assert any(row.split() == [name, *line.split()] for row in helped.stdout.splitlines()), name
    assert "eval.windows=N" in helped.stdout and "example:" in helped.stdout
    assert "Hydra" not in helped.stdout and "== Config ==" not in helped.stdout

    bare = cli()
    assert (
        bare.returncode == 2 and bare.stderr.strip() == helped.stdout.strip() and bare.stdout == ""
    )


# the CLI's answers before a run, in one process: usage, and refusals of the recipe or an override
QUICK = """
import sys
import compress.__main__ as m
from compress.errors import CompressError
print(m.usage()[:5])
for argv in (["eval.windows=2"], ["recipe=nope"], ["recipe=fp", "eval.windowz=2"],
             ["recipe=awq_int4", "awq.bits=x"], ["recipe=fp", "hydra.run.dir=/proc/x/run"]):
    try:
        m.rewrite_argv(argv)
    except CompressError as e:
        print("refused:", str(e)[:40])
print(sorted(n for n in ("torch", "transformers", "compress.recipe.pipeline") if n in sys.modules))
"""


def test_usage_and_refusals_import_neither_torch_nor_transformers():
    """``--help`` and a refused recipe or override answer before torch and transformers load
    (8 s of imports on one core): the modules are not in ``sys.modules`` afterwards."""
    res = subprocess.run(
        [sys.executable, "-c", QUICK], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    lines = res.stdout.splitlines()
    assert res.returncode == 0, res.stderr
    assert lines[0] == "usage" and sum(line.startswith("refused:") for line in lines) == 5, lines
    assert lines[-1] == "[]", lines


def test_no_run_without_recipe(tmp_path):
    res = cli("eval.windows=2", f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2 and "no recipe given: add recipe=NAME" in res.stderr
    assert not (tmp_path / "run").exists()


def test_typo_gets_did_you_mean_before_the_model_loads(tiny_dir, tmp_path):
    t = time.time()
    res = cli(
        "recipe=fp", f"model.path={tiny_dir}", "eval.windowz=2", f"hydra.run.dir={tmp_path}/run"
    )
    assert res.returncode == 2
    assert "unknown key 'eval.windowz' in recipe fp; did you mean eval.windows?" in res.stderr
    assert "+eval" not in res.stderr + res.stdout and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists() and "Loading" not in res.stderr + res.stdout
    assert time.time() - t < 60  # no model load, no stage


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["recipe=awq_int4", "quant.group_size=128"],
            "unknown key 'quant.group_size' in recipe awq_int4; did you mean awq.group_size",
        ),
        (
            ["recipe=rtn_int4", "quant.bits=3"],
            "did you mean rtn.bits",
        ),  # RTN's group was `quant` before
        (
            ["recipe=fp", "eval.windows=abc"],
            "eval.windows=abc: eval.windows takes an integer (the recipe has eval.windows=40), "
            "not a string 'abc'",
        ),
        (["recipe=fp", "decode.enabled=maybe"], "decode.enabled takes true or false"),
        (["recipe=fp", "eval.compare_source=1"], "eval.compare_source takes true or false"),
        (
            ["recipe=minitron_width", "prune.axes=hidden_size"],
            "prune.axes takes a list [a,b] "
            "(the recipe has prune.axes=[hidden_size,intermediate_size])",
        ),
        (["recipe=fp", "eval.windows=["], "cannot read the override 'eval.windows=['"),
        (["recipe=fp", "~eval.windowz"], "unknown key 'eval.windowz'"),
        (["recipe=fp", "+eval.windowz=3"], "unknown key 'eval.windowz'"),
        (["recipe=fp", "+eval.windows=3"], "eval.windows is in the recipe already"),
        (["recipe=fp", "hydra.run.dirr=/x"], "did you mean hydra.run.dir?"),
        (
            ["recipe=rtn_int4", "llm_int8.threshold=1"],
            "unknown key 'llm_int8.threshold' in recipe rtn_int4. "
            "Recipe rtn_int4 runs the stages ['rtn']; llm_int8.* is read by the llm_int8 stage.",
        ),
        (
            ["recipe=fp", "model=llama-9t"],
            "unknown model config 'llama-9t'. Available: gemma3-270m, smollm2-135m",
        ),
        (["recipe=awq_int9"], "unknown recipe 'awq_int9'"),
    ],
)
def test_override_errors(args, message):
    with pytest.raises(CompressError) as e:
        rewrite_argv(args)
    assert message in str(e.value)


def test_good_overrides_pass():
    argv = rewrite_argv(
        [
            "recipe=rtn_int4",
            "rtn.group_size=64",
            "eval.windows=null",
            "calib.samples=8",
            "hydra.run.dir=/x",
            "++eval.seqlen=128",
            "--cfg",
            "job",
        ]
    )
    assert argv[:2] == ["--config-name", "rtn_int4"] and argv[-1] == "--resolve"
    assert "rtn.group_size=64" in argv and "recipe=rtn_int4" not in argv


def test_cfg_job_prints_the_checked_recipe():
    res = cli("recipe=awq_int4", "awq.group_size=64", "--cfg", "job")
    assert res.returncode == 0 and "group_size: 64" in res.stdout


def default_sigint() -> None:
    """In the child: SIGINT at its default, whatever this test process inherited or set (a child
    that starts with SIGINT ignored keeps it ignored, and Ctrl-C could not reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=default_sigint,
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_removes_the_temporary_folder(sig, code, tiny_dir, tmp_path):
    """SIGINT while the checkpoint is being evaluated: one line, exit 130, no folder left;
    SIGTERM unwinds the same way (exit 143)."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "compress",
        "recipe=rtn_int4",
        f"model.path={tiny_dir}",
        *TINY_OVERRIDES,
        "eval.windows=null",
        f"hydra.run.dir={out}",
    ]  # every window: an evaluation long enough to hit
    env = dict(os.environ, COMPRESS_DATA_DIR=str(DATA), OMP_NUM_THREADS="1")
    proc = start(args, env)
    try:
        deadline = time.time() + 120
        while (
            not list(tmp_path.glob(".run.tmp-*")) and proc.poll() is None and time.time() < deadline
        ):
            time.sleep(0.05)
        tmp = list(tmp_path.glob(".run.tmp-*"))
        assert tmp, "the run never wrote its temporary folder"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == code, stderr[-2000:]
    if sig == signal.SIGINT:
        assert (
            stderr.strip().splitlines()[-1] == f"interrupted; removed the temporary folder {tmp[0]}"
        )
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_anything_is_written(tiny_dir, tmp_path):
    """SIGINT while the source loads: 'nothing was written', exit 130, Hydra's placeholder gone."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-c",
        "import time, compress.io.source as s; load = s.load_model; "
        "s.load_model = lambda *a, **k: (print('loading', flush=True), time.sleep(60)); "
        "import compress.recipe.pipeline as p; p.load_model = s.load_model; "
        "import sys; sys.argv = ['compress', *sys.argv[1:]]; "
        "from compress.__main__ import main; main()",
        "recipe=fp",
        f"model.path={tiny_dir}",
        *TINY_OVERRIDES,
        f"hydra.run.dir={out}",
    ]
    env = dict(os.environ, COMPRESS_DATA_DIR=str(DATA))
    proc = start(args, env)
    try:
        assert read_until(proc.stdout, lambda line: "loading" in line, 120), "never loaded"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert (
        proc.returncode == 130
        and stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    )
    assert list(tmp_path.iterdir()) == []


def test_decoder_missing_path_does_not_exist(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "compress.decoder", str(tmp_path / "absent"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2
    assert (
        f"run folder '{tmp_path / 'absent'}' does not exist" in res.stderr
        and "Traceback" not in res.stderr
    )


NATIVE = """
import sys, time
import compress.recipe.pipeline as p

def native_write(*a, **k):  # as safetensors did: the signal comes out as another error
    print("writing", flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        raise ValueError("could not determine the shape of object type 'UntypedStorage'")

p.write_report = native_write
sys.argv = ["compress", *sys.argv[1:]]
from compress.__main__ import main
main()
"""


def test_ctrl_c_inside_a_native_call_still_exits_130(tiny_dir, tmp_path):
    """SIGINT that a native call turns into another exception (safetensors raised ValueError when
    Ctrl-C landed in a read, which once ended a run with a traceback and exit 1): the run still
    unwinds as an interrupt, removes its temporary folder and exits 130 with one line."""
    out = tmp_path / "run"
    args = [sys.executable, "-c", NATIVE, "recipe=fp", f"model.path={tiny_dir}", *TINY_OVERRIDES]
    args += ["decode.enabled=false", f"hydra.run.dir={out}"]
    proc = start(args, dict(os.environ, COMPRESS_DATA_DIR=str(DATA)))
    try:
        assert read_until(proc.stdout, lambda line: "writing" in line, 300), "never wrote"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop(proc)
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 130 and last.startswith("interrupted; removed the temporary folder")
    assert "Traceback" not in stderr and "ValueError" not in stderr
    assert list(tmp_path.iterdir()) == []
