"""The server against hostile and careless clients: the API key (the real ``openai`` client), the
connection timeouts (raw sockets: slowloris heads and bodies, silent connections, with the
server's file descriptors counted), tokenization off the event loop (``/health`` timed while a
10 MB prompt is refused, and while a slow tokenizer works), chat templates that raise and lone
surrogates (400, not 500), a KV pool larger than memory and a reachable ``--host`` without a key
(refused before serving), and ``--port 0`` (the bound port logged).

The CLI server runs in a subprocess with short timeouts (``HEAD``, ``IDLE``, ``BODY``) and its
key in ``COMPRESS_API_KEY``; every wait has a deadline and the server is always terminated."""

import json
import os
import queue
import re
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from compress.decoder.model import load
from compress.errors import CompressError
from compress.serve.__main__ import check_access, check_arguments, main, parse_args
from compress.serve.app import create_app
from compress.serve.engine import Engine
from compress.serve.protocol import CompletionRequest, prompt_char_limit
from compress.serve.worker import Worker
from compress.testing import random_model, run_folder, tiny_config, tiny_tokenizer
from tests.conftest import serve_in_thread

openai = pytest.importorskip("openai")

HEAD, IDLE, BODY = 1.5, 1.0, 2.0  # the CLI server's --header-, --idle- and --body-timeout
SLACK = 2.0  # seconds a loaded machine may add to a timeout
KEY = "sk-test-" + secrets.token_hex(12)
# Mistral's rule: an optional system message, then user/assistant alternating from user
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system = '' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{%- if turns | length == 0 %}"
    "{{ raise_exception('Conversation must have a user message after the system message') }}"
    "{%- endif %}"
    "{%- for m in turns %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if m['role'] == 'user' %}[INST] {% if loop.first and system %}{{ system }} {% endif %}"
    "{{ m['content'] }} [/INST]{%- else %}{{ m['content'] }}<eos>{%- endif %}"
    "{%- endfor %}"
)
BODY_OK = {"model": "tiny", "prompt": "the quick", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return run_folder(tmp_path_factory.mktemp("run") / "tiny", random_model(tiny_config()), tok)


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"], err
    return err


# --- the CLI server in a subprocess ------------------------------------------------------------


class Output:
    """A process's merged output, drained by a thread (a full pipe would block the server);
    :meth:`wait_for` waits, with a deadline, for a line matching a pattern."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._drain, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _drain(self, stream):
        for line in stream:
            self.lines.append(line)
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, pattern: str, timeout: float):
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break  # the process ended
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.lines)}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def cli_server(folder):
    """``python -m compress.serve RUN --port 0`` with the key in COMPRESS_API_KEY, short
    timeouts and a 32 MiB body limit (so a 10 MB prompt reaches the prompt check)."""
    argv = [sys.executable, "-m", "compress.serve", str(folder), "--port", "0"]
    argv += ["--num-blocks", "64", "--block-size", "4", "--device", "cpu", "--log-level", "debug"]
    argv += ["--header-timeout", str(HEAD), "--idle-timeout", str(IDLE)]
    argv += ["--body-timeout", str(BODY), "--max-body-bytes", str(32 << 20)]
    env = dict(os.environ, COMPRESS_API_KEY=KEY)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        out = Output(proc)
        m = out.wait_for(r"serving 'tiny' on http://127\.0\.0\.1:(\d+) .*API key required", 180)
        port = int(m.group(1))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # listening once logged; answered once the loop runs
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out.lines)
            time.sleep(0.1)
        yield SimpleNamespace(url=url, port=port, proc=proc, out=out, pid=proc.pid)
    finally:
        stop(proc)


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_port_0_logs_the_port_it_bound(cli_server):
    assert cli_server.port != 0
    line = next(x for x in cli_server.out.lines if "serving 'tiny'" in x)
    assert f":{cli_server.port} " in line and ":0 " not in line
    assert httpx.get(cli_server.url + "/health").json() == {"status": "ok"}


def test_a_wrong_or_missing_key_gets_401_from_the_openai_client(cli_server):
    wrong = client(cli_server.url, "sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(**BODY_OK)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    # the same key with one character changed, a lower-case scheme, no header, another scheme
    near = KEY[:-1] + ("0" if KEY[-1] != "0" else "1")
    for headers in (
        {"Authorization": f"Bearer {near}"},
        {},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
    ):
        r = httpx.post(cli_server.url + "/v1/completions", json=BODY_OK, headers=headers)
        err = openai_error(r, 401)
        assert err["code"] == "invalid_api_key" and KEY not in r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert (
        "Authorization: Bearer"
        in openai_error(httpx.get(cli_server.url + "/metrics"), 401)["message"]
    )
    openai_error(httpx.get(cli_server.url + "/v1/nothing"), 401)  # unknown routes too
    assert httpx.get(cli_server.url + "/health").status_code == 200  # the probe needs no key
    r = httpx.post(
        cli_server.url + "/v1/completions",
        json=BODY_OK,
        headers={"Authorization": f"bearer {KEY}"},  # the scheme is case-insensitive
    )
    assert r.status_code == 200, r.text


def raw_get(port: int, target: str) -> bytes:
    """The reply to ``GET target`` sent byte for byte (no client normalizing its dot segments)
    without a key, read to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("target", ["/healthx", "/health/", "/health/../v1/models"])
def test_only_the_exact_health_path_is_open(cli_server, target):
    """``/health`` is open by its exact path: a path that only starts with it gets 401 without a
    key, a dot segment through it too (the server must not match it as open, whatever a proxy
    behind it would make of ``..``)."""
    reply = raw_get(cli_server.port, target)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "invalid_api_key", body
    logged = f'"GET {target} HTTP/1.1" 401'  # the server saw the path as sent
    deadline = time.monotonic() + 10
    while not any(logged in line for line in cli_server.out.lines):
        assert time.monotonic() < deadline, logged
        time.sleep(0.05)
    assert raw_get(cli_server.port, "/health").startswith(b"HTTP/1.1 200")


def test_the_right_key_serves_with_the_openai_client(cli_server):
    c = client(cli_server.url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(**BODY_OK)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    chunks = list(c.completions.create(stream=True, **BODY_OK))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    m = httpx.get(cli_server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert m.status_code == 200 and "compress_kv_blocks_total 64" in m.text


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int, timeout: float = IDLE + SLACK + 3) -> int:
    """The server's descriptor count once it stops changing (earlier connections closed)."""
    deadline, last = time.monotonic() + timeout, fd_count(pid)
    while time.monotonic() < deadline:
        time.sleep(IDLE / 2)
        now = fd_count(pid)
        if now == last:
            return now
        last = now
    return last


def wait_fds(pid: int, at_least=None, at_most=None, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = fd_count(pid)
        if (at_least is None or n >= at_least) and (at_most is None or n <= at_most):
            return n
        assert time.monotonic() < deadline, (n, at_least, at_most)
        time.sleep(0.05)


def watch(socks: list, feed, timeout: float) -> dict:
    """Until every socket is closed by the server (EOF or reset) or ``timeout``: every 0.25 s
    ``feed(i)`` bytes (None: nothing) go to each open socket. Returns ``{i: (seconds until
    closed, bytes received)}`` for the closed ones."""
    start, closed, got = time.monotonic(), {}, {i: b"" for i in range(len(socks))}
    next_feed = start
    while len(closed) < len(socks) and time.monotonic() - start < timeout:
        now = time.monotonic()
        if now >= next_feed:
            next_feed = now + 0.25
            for i, s in enumerate(socks):
                data = feed(i)
                if i not in closed and data:
                    try:
                        s.send(data)
                    except OSError:  # reset or broken pipe: the server closed it
                        closed[i] = (time.monotonic() - start, got[i])
        open_ = [s for i, s in enumerate(socks) if i not in closed]
        readable, _, _ = select.select(open_, [], [], 0.05)
        for s in readable:
            i = socks.index(s)
            try:
                chunk = s.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                got[i] += chunk
            else:
                closed[i] = (time.monotonic() - start, got[i])
    return closed


def connect(port: int, n: int) -> list:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def test_20_slowloris_heads_are_closed_after_the_header_timeout(cli_server):
    """Each connection sends its request line, then a header byte every 0.25 s, never the end
    of the head: the idle limit never fires (bytes keep coming); the head's limit closes each."""
    base = settled_fds(cli_server.pid)
    socks = connect(cli_server.port, 20)
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        wait_fds(cli_server.pid, at_least=base + 20)  # all accepted and held
        closed = watch(socks, lambda i: b"a", HEAD + SLACK + 3)
        assert len(closed) == 20, f"{20 - len(closed)} slowloris connections still open"
        times = sorted(t for t, _ in closed.values())
        assert HEAD - 0.3 <= times[0] and times[-1] <= HEAD + SLACK, times
        assert all(data == b"" for _, data in closed.values())  # closed, nothing answered
    finally:
        for s in socks:
            s.close()
    wait_fds(cli_server.pid, at_most=base)


def test_20_silent_connections_are_closed_after_the_idle_timeout(cli_server):
    base = settled_fds(cli_server.pid)
    socks = connect(cli_server.port, 20)
    try:
        wait_fds(cli_server.pid, at_least=base + 20)
        closed = watch(socks, lambda i: None, IDLE + SLACK + 3)
        assert len(closed) == 20, f"{20 - len(closed)} silent connections still open"
        times = sorted(t for t, _ in closed.values())
        assert IDLE - 0.3 <= times[0] and times[-1] <= IDLE + SLACK, times
    finally:
        for s in socks:
            s.close()
    wait_fds(cli_server.pid, at_most=base)


def post_head(length: int, key: str | None = KEY, method: str = "POST", path="/v1/completions"):
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_trickled_body_gets_408_and_a_keyless_one_401_at_once(cli_server):
    """A body sent a byte every 0.25 s: 408 at the body timeout, then closed; without the key,
    401 before any of it is read; a body no route reads (a GET's) is cut 1 s after the timeout."""
    socks = connect(cli_server.port, 3)
    try:
        socks[0].sendall(post_head(10_000) + b"{")
        socks[1].sendall(post_head(10_000, key=None) + b"{")
        socks[2].sendall(post_head(10_000, method="GET", path="/v1/models"))
        closed = watch(socks, lambda i: b" ", BODY + 1 + SLACK + 3)
        assert len(closed) == 3, closed
        (t408, r408), (t401, r401), (tget, rget) = closed[0], closed[1], closed[2]
        assert r408.startswith(b"HTTP/1.1 408") and BODY - 0.3 <= t408 <= BODY + SLACK, closed[0]
        assert "did not arrive" in json.loads(r408.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert r401.startswith(b"HTTP/1.1 401") and t401 < 1.0, closed[1]
        assert rget.startswith(b"HTTP/1.1 200"), rget[:100]  # answered, then cut
        assert BODY + 1 - 0.3 <= tget <= BODY + 1 + SLACK, closed[2]
    finally:
        for s in socks:
            s.close()


def test_slow_but_complete_clients_and_keep_alive_are_served(cli_server):
    """A head trickled in within the header timeout is answered; a kept-alive connection serves
    a second request, then is closed after the idle timeout."""
    with socket.create_connection(("127.0.0.1", cli_server.port), timeout=10) as s:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        t = time.monotonic()
        for i in range(0, len(head), 8):  # over about HEAD / 2
            s.sendall(head[i : i + 8])
            time.sleep(HEAD / 2 / (len(head) / 8))
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - t < HEAD, reply
        time.sleep(IDLE / 2)
        s.sendall(head)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        closed = watch([s], lambda i: None, IDLE + SLACK + 3)
        assert 0 in closed and IDLE - 0.3 <= closed[0][0] <= IDLE + SLACK, closed


def test_health_answers_within_100ms_while_a_10mb_prompt_is_refused(cli_server):
    big = json.dumps(dict(BODY_OK, prompt="fox " * (10_000_000 // 4))).encode()
    assert len(big) > 10_000_000
    health = httpx.Client(base_url=cli_server.url, timeout=10)
    result = {}

    def refused():
        t = time.monotonic()
        result["r"] = httpx.post(
            cli_server.url + "/v1/completions",
            content=big,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=60,
        )
        result["took"] = time.monotonic() - t

    health.get("/health")  # connected
    latencies = []
    thread = threading.Thread(target=refused)
    thread.start()
    try:
        while thread.is_alive() or not latencies:
            t = time.monotonic()
            assert health.get("/health").status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.01)
    finally:
        thread.join(60)
        health.close()
    err = openai_error(result["r"], 400)
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    assert max(latencies) < 0.1, (latencies, result["took"])


def test_the_key_never_appears_in_the_logs(cli_server):
    """After every test above (wrong keys, right keys, 401s, timeouts) at log level debug."""
    c = client(cli_server.url)
    c.completions.create(**BODY_OK)
    with pytest.raises(openai.AuthenticationError):
        client(cli_server.url, KEY + "x").models.list()
    time.sleep(0.5)  # the log lines of those requests
    text = "".join(cli_server.out.lines)
    assert "serving 'tiny'" in text and " 401" in text  # the log is there, with the refusals
    assert KEY not in text and KEY[8:] not in text


def test_a_pool_larger_than_memory_is_refused_before_allocating(folder):
    model, tok = load(folder)
    t = time.monotonic()
    with pytest.raises(CompressError, match=r"--num-blocks [\d,]+ or fewer") as e:
        Engine(model, tok, num_blocks=10**9)
    assert time.monotonic() - t < 1.0 and "GiB" in str(e.value)
    Engine(model, tok, num_blocks=64)  # a pool that fits is allocated as before
    r = subprocess.run(
        [sys.executable, "-m", "compress.serve", str(folder), "--port", "0"]
        + ["--num-blocks", "1000000000", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "--num-blocks" in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "KV pool of 1,000,000,000 blocks" in errors[0], r.stderr


# --- access and flags, before anything is bound ------------------------------------------------


def test_a_reachable_host_without_a_key_is_refused(folder, capsys, monkeypatch):
    monkeypatch.delenv("COMPRESS_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        main([str(folder), "--host", "0.0.0.0", "--port", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "--allow-no-key" in err and "COMPRESS_API_KEY" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    for argv in (["--api-key", "k3y"], ["--allow-no-key"]):  # checked only: nothing bound
        check_access(parse_args(["run", "--host", "0.0.0.0"] + argv))
    monkeypatch.setenv("COMPRESS_API_KEY", "from-env")
    args = parse_args(["run", "--host", "0.0.0.0"])
    check_access(args)
    assert args.api_key == "from-env"
    for host in ("127.0.0.1", "localhost", "::1"):  # loopback needs no key (the default)
        monkeypatch.delenv("COMPRESS_API_KEY", raising=False)
        args = parse_args(["run", "--host", host])
        check_access(args)
        assert args.api_key is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--api-key", ""], "--api-key is empty"),
        (["--api-key", "two words"], "printable ASCII without spaces"),
        (["--api-key", "clé"], "printable ASCII without spaces"),
        (["--header-timeout", "0"], "--header-timeout 0.0"),
        (["--idle-timeout", "inf"], "--idle-timeout inf"),
        (["--body-timeout", "nan"], "--body-timeout nan"),
    ],
)
def test_bad_keys_and_timeouts_are_refused_without_echoing_the_key(argv, match):
    with pytest.raises(CompressError, match=match) as e:
        check_arguments(parse_args(["run"] + argv))
    if argv[0] == "--api-key" and argv[1]:
        assert argv[1] not in str(e.value)


# --- the app in this process: tokenization off the loop, templates, surrogates -----------------


class SlowTokenizer:
    """The tokenizer, ``delay`` seconds slower to tokenize and to apply the chat template."""

    def __init__(self, tok):
        self.tok, self.delay = tok, 0.0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kw):
        time.sleep(self.delay)
        return self.tok(*args, **kw)

    def apply_chat_template(self, *args, **kw):
        time.sleep(self.delay)
        return self.tok.apply_chat_template(*args, **kw)


@pytest.fixture(scope="module")
def app_server(folder):
    model, tok = load(folder)
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_seqs=4, max_step_tokens=64)
    slow = SlowTokenizer(tok)
    with serve_in_thread(create_app(Worker(engine), slow, "tiny"), 30, "warning") as url:
        yield SimpleNamespace(url=url, slow=slow, tok=tok, client=client(url, "none"))


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_tokenization_runs_off_the_event_loop(app_server, route):
    """A tokenizer (or chat template) taking 1.5 s: /health still answers within 100 ms."""
    if route == "chat":
        path, body = (
            "/v1/chat/completions",
            dict(BODY_OK, messages=[{"role": "user", "content": "hi"}]),
        )
    else:
        path, body = "/v1/completions", BODY_OK
    app_server.slow.delay = 1.5
    result = {}

    def request():
        t = time.monotonic()
        result["r"] = httpx.post(app_server.url + path, json=body, timeout=30)
        result["took"] = time.monotonic() - t

    thread = threading.Thread(target=request)
    health = httpx.Client(base_url=app_server.url, timeout=10)
    try:
        health.get("/health")  # connected
        thread.start()
        time.sleep(0.3)  # the request is being tokenized
        latencies = []
        for _ in range(5):
            t = time.monotonic()
            assert health.get("/health").status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.1)
        assert thread.is_alive()  # the probes ran while it was tokenized
    finally:
        thread.join(30)
        health.close()
        app_server.slow.delay = 0.0
    assert result["r"].status_code == 200 and result["took"] >= 1.5, result
    assert max(latencies) < 0.1, latencies


TWO_USERS = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
REFUSED = {
    "two user turns in a row": (TWO_USERS, "alternate"),
    "only a system message": ([{"role": "system", "content": "be brief"}], "user message"),
    "assistant first": ([{"role": "assistant", "content": "hello"}], "alternate"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_chat_template_that_raises_gets_400(app_server, case):
    messages, says = REFUSED[case]
    r = httpx.post(
        app_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages}
    )
    err = openai_error(r, 400)
    assert "chat template refused" in err["message"] and says in err["message"], err
    with pytest.raises(openai.BadRequestError, match="chat template"):
        app_server.client.chat.completions.create(model="tiny", messages=messages, stream=True)
    ok = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = app_server.client.chat.completions.create(model="tiny", messages=ok, max_tokens=2)
    assert r.choices[0].message.role == "assistant"  # the server still serves


SURROGATES = {  # field: a body with a lone surrogate in it, spelled as JSON
    "prompt": '"prompt": "a\\ud800b"',
    "prompt list": '"prompt": ["\\udfff"]',
    "model": '"model": "tiny\\ud800", "prompt": "hi"',
    "stop": '"prompt": "hi", "stop": ["\\ud800"]',
    "message": '"messages": [{"role": "user", "content": "\\ud800"}]',
    "content part": '"messages": [{"role": "user", "content": '
    '[{"type": "text", "text": "x\\udc00"}]}]',
}


@pytest.mark.parametrize("field", list(SURROGATES))
def test_a_lone_surrogate_gets_400(app_server, field):
    body = '{"model": "tiny", "max_tokens": 2, ' + SURROGATES[field] + "}"
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(
        app_server.url + path, content=body.encode(), headers={"content-type": "application/json"}
    )
    err = openai_error(r, 400)
    assert "lone UTF-16 surrogate" in err["message"] and "\\u" in err["message"], err
    pair = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    pair = pair.replace("\\udc00", "\\ud83d\\ude00")
    r = httpx.post(
        app_server.url + path, content=pair.encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == (404 if field == "model" else 200), r.text  # a pair is a character


def test_the_prompt_cap_refuses_only_prompts_longer_than_the_context(folder):
    """The cap is sound for this tokenizer: the longest token repeated to fill the context is
    under it; one character over it is refused, before tokenizing."""
    tok = tiny_tokenizer()
    limit, context = prompt_char_limit(tok, 128), 128
    longest = max(tok.get_vocab(), key=len)
    text = tok.convert_tokens_to_string([longest] * context)
    assert len(tok(text).input_ids) <= context and len(text) <= limit
    CompletionRequest(model="tiny", prompt=text).check_size(limit, context)
    with pytest.raises(CompressError, match="context of 128 tokens"):
        CompletionRequest(model="tiny", prompt="x" * (limit + 1)).check_size(limit, context)
    assert len(tok("x" * (limit + 1)).input_ids) > context  # and it would not have fitted
