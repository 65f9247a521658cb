"""The benchmark scripts (``eval/bench/``) stay runnable, and stay out of the tests: every script
imports and prints its ``--help`` in a subprocess, and no test file imports one."""

import ast
import subprocess
import sys

from tests.conftest import BENCH, ROOT

SCRIPTS = sorted(p for p in BENCH.glob("*.py"))
GPU_ONLY = {"bench_triton"}  # refuses to start without a CUDA device
# each script's --help in one interpreter: argparse exits 0 after printing it
HELP = """
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv, sys.path[0] = [path, "--help"], path.rsplit("/", 1)[0]  # as `python path --help`
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: no usage printed")
    except SystemExit as e:
        if e.code not in (0, None) or "usage" not in out.getvalue():
            failed.append(f"{path}: exit {e.code}")
    except Exception as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
print("\\n".join(failed))
"""


def test_every_benchmark_script_runs_its_help():
    assert len(SCRIPTS) > 10
    res = subprocess.run(
        [sys.executable, "-c", HELP, *(str(p) for p in SCRIPTS if p.stem not in GPU_ONLY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "", res.stdout


def test_no_test_imports_a_benchmark_script():
    names = {p.stem for p in SCRIPTS}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names if a.name in names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "") in names:
                found.append((path.name, node.module))
    assert not found, found


def test_no_test_puts_the_benchmarks_on_the_import_path():
    """No ``sys.path.insert/append`` in a test file names the benchmark folder (through which a
    test could import a script by its file name)."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend")
                and "sys.path" in (ast.get_source_segment(text, node.func.value) or "")
                and "bench" in (ast.get_source_segment(text, node) or "").lower()
            ):
                found.append((path.name, ast.get_source_segment(text, node)))
    assert not found, found
