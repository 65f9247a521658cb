"""Shared fixtures: data dir, a tiny random Llama with the real tokenizer, recipe composition."""

import os
import queue
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from compress.serve.server import make_server

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "eval" / "bench"  # the benchmark scripts: tests run them, never import them
if (
    not torch.cuda.is_available()
):  # Triton decides at import whether to interpret: before any test imports a kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `pytest -n N` (pytest-xdist, the README's test command): each worker process gets an equal
# share of the cores for torch's threads and those of the subprocesses it starts, so N workers
# do not run N x cores threads
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    _share = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    torch.set_num_threads(_share)
    os.environ["OMP_NUM_THREADS"] = str(_share)
# a compile failure of the static decode step is an error here, not an eager fallback
# (compress.decoder.compiled); set before any test, so subprocesses inherit it too
os.environ["COMPRESS_STRICT_COMPILE"] = "1"


# Tests of 15 s or more on one core (`--durations`) join the `slow` marker, which the suite
# leaves out (`pytest -m slow`); of a parametrized one, a quick case stays in the suite.
SLOW = {
    "test_decoder.py::test_compiled_step_quantized[float32]",  # bfloat16 stays
    "test_decoder_attn.py::test_compiled_step_on_converted[cla]",  # gqa stays
    "test_decoder_attn.py::test_compiled_step_on_converted[mla]",
    "test_decoder_attn.py::test_quantized_cross_layer_folder_composes",
    "test_distill_ddp.py::test_two_processes_match_one",
    "test_distill_fsdp.py::test_fsdp_two_processes_match_one[0]",
    "test_distill_resume.py::test_kill_and_resume_reaches_the_same_weights",
    "test_gptq.py::test_gptq_vs_awq_script_runs_small",
    "test_head.py::test_pipeline_evaluates_the_quantized_head",
    "test_iam.py::test_iam_recipe_self_mapped_equals_the_source",
    "test_manifest_verify.py::test_decoder_cli_refuses_a_damaged_folder_and_runs_it_with_no_verify",
    "test_minitron.py::test_width_recipe",
    "test_minitron.py::test_depth_recipe_cli",
    "test_minitron.py::test_error_resume_from_another_recipe",
    "test_moe_bench.py::test_moe_bench_folder_and_gguf",
    "test_offload.py::test_pipeline_offload_disk_run",
    "test_pipeline.py::test_recipes_compose_on_a_run_folder",
    "test_pipeline.py::test_decoder_figures_and_errors",
    "test_prune_experts.py::test_minitron_experts_recipe_prunes_then_distills",
    "test_speculative.py::test_cli",
    "test_w4a8.py::test_decoder_default_runs_the_kernel_compiled",
} | {  # one point of the SIGKILL sweep (temp_made) stays
    "test_robust_run_folder.py::test_sigkill_at_each_point_leaves_nothing_loadable_and_the_next_"
    f"run_removes_it[{point}]"
    for point in ("spill_made", "weights_written", "manifest_written")
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The tests in ``SLOW`` join the ``slow`` marker; the compiled per-family exactness runs
    (40-90 s each) other than Gemma 3's join the ``matrix`` marker (``pytest -m matrix``). The
    suite leaves both out."""
    for item in items:
        if item.nodeid.removeprefix("tests/") in SLOW:
            item.add_marker(pytest.mark.slow)
        if (
            getattr(item, "originalname", "") == "test_compiled_step_matches_transformers"
            and "gemma3_text" not in item.nodeid
        ):
            item.add_marker(pytest.mark.matrix)


def _data_dir() -> Path:
    """The exported COMPRESS_DATA_DIR when it holds WikiText-2, else the checkout's shared/data."""
    exported = os.environ.get("COMPRESS_DATA_DIR")
    if exported and (Path(exported) / "wikitext-2").is_dir():
        return Path(exported).resolve()  # tests that change folder still find it
    return (ROOT.parent / "shared" / "data").resolve()


DATA = _data_dir()
os.environ["COMPRESS_DATA_DIR"] = str(DATA)  # for subprocesses and modules read at import


@pytest.fixture(autouse=True)
def own_environment(monkeypatch, tmp_path):
    """Every test starts from the same environment, whatever the shell exports: the data folder
    above, no Hub token (a test that needs one sets it), and torch's thread count as the session
    found it (restored after each test). Hub tests turn offline mode off themselves
    (``tests/test_hub.py``)."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("COMPRESS_DATA_DIR", str(DATA))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no stored login
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_bench(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python eval/bench/SCRIPT.py ARGS`` from the checkout's root, its output captured; the
    test fails with the script's stderr unless it exits 0. Tests run the benchmark scripts this
    way, never import them (``tests/test_bench_scripts.py``)."""
    argv = [sys.executable, str(BENCH / f"{script}.py"), *map(str, args)]
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill a test's subprocess and what it started (a launcher's ranks) if still running, close
    its pipes and reap it, within ``timeout`` seconds: for ``finally`` blocks (never blocks)."""
    import psutil

    if proc.poll() is None:
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        for p in [proc, *family]:  # children first listed, then killed: none is missed
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        psutil.wait_procs(family, timeout=timeout)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass  # unkillable (D state): reported by the test's own failure, never waited on forever
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except (OSError, ValueError, RuntimeError):  # a read_until thread still on it
                pass


def read_until(stream, found, timeout: float) -> str | None:
    """The first line of the text pipe ``stream`` for which ``found(line)`` holds, read within
    ``timeout`` seconds; None at end of stream or on timeout (then the reading thread ends when
    the caller stops the process). Nothing after that line is read."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in stream:
            if found(line):
                lines.put(line)
                return
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def tiny_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    kw.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    kw.update(tie_word_embeddings=True, rope_theta=10000.0)
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_tiny_model(seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)
    with torch.no_grad():  # a little structure so quantization has something to do
        for p in model.parameters():
            p.normal_(0, 0.05)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from compress.io.source import convert_default_model

    return AutoTokenizer.from_pretrained(convert_default_model())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama saved as an HF folder, with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def compose(recipe: str, overrides=()):
    """The resolved Hydra config of a recipe, as ``python -m compress recipe=...`` builds it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        return hydra_compose(config_name=recipe, overrides=list(overrides))


TINY_OVERRIDES = [
    "eval.windows=2",
    "eval.seqlen=64",
    "calib.samples=4",
    "calib.seqlen=64",
    "decode.new_tokens=16",
]


@pytest.fixture(scope="session")
def distill_dirs(tmp_path_factory, tokenizer):
    """(teacher folder, student folder, text file) for the standalone distillation CLI."""
    from compress.methods.prune.importance import activation_importance
    from compress.methods.prune.prune import prune_model

    root = tmp_path_factory.mktemp("distill")
    small = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    teacher = make_tiny_model(**small)
    x = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    student = prune_model(
        teacher, activation_importance(teacher, x, progress=False), {"intermediate_size": 64}
    )
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    text = (DATA / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:20000]
    (root / "text.txt").write_text(text, encoding="utf-8")
    return root / "teacher", root / "student", root / "text.txt"


@contextmanager
def serve_in_thread(app, start_timeout: float = 60, log_level: str = "critical"):
    """``app`` served on 127.0.0.1 by ``compress.serve.server.make_server`` in a daemon thread:
    yields its URL once it is up (an assertion after ``start_timeout`` s), stops it on exit."""
    server = make_server(app, log_level=log_level)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, tokenizer):
    """``{family: folder}`` of the tiny random models, with SmolLM2's tokenizer."""
    from tests.family_models import FAMILIES, family_model  # after TRITON_INTERPRET is set

    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        family_model(family).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[family] = folder
    return out
