"""No test blocks forever on a subprocess: the helpers that bound the waits (``tests/conftest.py``:
``stop``, ``read_until``) against live, silent processes, and an audit of every test file for
waits without a timeout."""

import ast
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import read_until, stop

TESTS = Path(__file__).resolve().parent
# a child that prints one line, starts a grandchild, then stays silent and alive
SILENT = (
    "import subprocess, sys, time; print('ready', flush=True); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
)


def silent():
    return subprocess.Popen(
        [sys.executable, "-c", SILENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_read_until_returns_the_line_or_gives_up_in_time():
    proc = silent()
    try:
        assert read_until(proc.stdout, lambda line: line.startswith("ready"), 60) == "ready\n"
        t0 = time.monotonic()
        assert read_until(proc.stdout, lambda line: "never" in line, 1.0) is None
        assert time.monotonic() - t0 < 5  # the process is alive and silent: no blocking read
    finally:
        stop(proc)


def test_stop_kills_the_process_and_what_it_started():
    proc = silent()
    assert read_until(proc.stdout, lambda line: "ready" in line, 60)
    deadline = time.monotonic() + 30
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    [grandchild] = psutil.Process(proc.pid).children()
    t0 = time.monotonic()
    stop(proc)
    assert time.monotonic() - t0 < 10
    assert proc.returncode is not None and proc.stdout.closed and proc.stderr.closed
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
    stop(proc)  # again, on a finished process: nothing to do, no error


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _exited(fn, proc: str, line: int) -> bool:
    """Whether ``fn`` waited, with a timeout, for ``proc`` to end before ``line``."""
    return any(
        ast.unparse(c.func) in (f"{proc}.wait", f"{proc}.communicate")
        and (c.args or c.keywords)
        and c.lineno < line
        for c in _calls(fn)
    )


def waits_without_timeout(source: str) -> list[str]:
    """``line what`` for each subprocess wait in ``source`` that can block forever: ``run`` and
    friends without ``timeout=``, ``wait()``/``communicate()`` without one, reading a pipe of a
    process not known to have exited, and a test that starts a process without a ``finally``
    that stops (or kills) it."""
    found = []
    tree = ast.parse(source)
    for c in _calls(tree):
        name, keys = ast.unparse(c.func), {k.arg for k in c.keywords}
        if (
            name.startswith("subprocess.")
            and name.split(".")[-1] in ("run", "check_output", "check_call", "call")
            and "timeout" not in keys
        ):
            found.append(f"{c.lineno} {name} without timeout=")
        elif name.endswith((".wait", ".communicate")) and not c.args and "timeout" not in keys:
            if not name.startswith(("psutil.", "threading.", "self.")):
                found.append(f"{c.lineno} {name}() without a timeout")
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        reads = [
            (c.lineno, ast.unparse(c.func).rsplit(".", 2)[0])
            for c in _calls(fn)
            if ast.unparse(c.func).endswith(
                (".stdout.read", ".stderr.read", ".stdout.readline", ".stderr.readline")
            )
        ] + [
            (n.lineno, ast.unparse(n.iter).rsplit(".", 1)[0])
            for n in ast.walk(fn)
            if isinstance(n, ast.For) and ast.unparse(n.iter).endswith((".stdout", ".stderr"))
        ]
        for line, proc in reads:
            if not _exited(fn, proc, line):
                found.append(f"{line} reads a pipe of {proc}, which may still run")
        starts = any(ast.unparse(c.func) == "subprocess.Popen" for c in _calls(fn))
        cleans = any(
            isinstance(t, ast.Try)
            and any(ast.unparse(c.func).endswith(("stop", ".kill")) for s in t.finalbody
                    for c in _calls(s))
            for t in ast.walk(fn)
        )  # fmt: skip
        if fn.name.startswith("test_") and starts and not cleans:
            found.append(f"{fn.lineno} {fn.name} starts a process with no finally that stops it")
    return found


def test_no_test_waits_on_a_subprocess_without_a_timeout():
    bad = {
        f.name: waits
        for f in sorted(TESTS.glob("*.py"))
        if (waits := waits_without_timeout(f.read_text(encoding="utf-8")))
    }
    assert bad == {}


def test_the_audit_finds_each_kind_of_unbounded_wait():
    src = (
        "import subprocess\n"
        "def test_x(proc):\n"
        "    subprocess.run(['x'])\n"
        "    proc.wait()\n"
        "    proc.communicate()\n"
        "    proc.stdout.read()\n"
        "    for line in proc.stderr:\n"
        "        pass\n"
        "    subprocess.Popen(['y'])\n"
        "    subprocess.run(['x'], timeout=5); proc.wait(5); proc.communicate(timeout=5)\n"
        "    proc.stdout.read()\n"  # after a wait with a timeout: the process has ended
        "def test_y():\n"
        "    p = subprocess.Popen(['y'])\n"
        "    try:\n"
        "        p.wait(timeout=5)\n"
        "    finally:\n"
        "        stop(p)\n"
    )
    assert sorted(int(w.split()[0]) for w in waits_without_timeout(src)) == [2, 3, 4, 5, 6, 7]


HOLD = (
    "import sys, time; from pathlib import Path; from compress.kernels.native import build_lock\n"
    "with build_lock(Path(sys.argv[1])):\n"
    "    (Path(sys.argv[1]) / 'lock').write_text('')  # torch's lock, as a build in flight\n"
    "    print('held', flush=True); time.sleep(600)\n"
)


def test_a_killed_kernel_build_leaves_no_wait_behind(tmp_path):
    """A build killed while it holds the lock (torch's ``lock`` file left in the build folder,
    which torch alone would wait on forever) does not block the next build: the OS drops the
    flock with its holder, and the next holder removes the stale file."""
    from compress.kernels.native import build_lock

    build = tmp_path / "ext"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(build)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert read_until(holder.stdout, lambda line: "held" in line, 60) is not None
        waiter = subprocess.Popen(
            [sys.executable, "-c", HOLD.replace("time.sleep(600)", "pass"), str(build)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        assert waiter.poll() is None  # one build at a time: it waits while the holder lives
        holder.kill()
        assert waiter.wait(timeout=60) == 0
    finally:
        stop(holder)
    assert (build / "lock").exists()  # the waiter's own torch lock, as it left it on exit
    with build_lock(build):
        assert not (build / "lock").exists()  # found under the flock: stale, removed
