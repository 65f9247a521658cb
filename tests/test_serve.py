"""The OpenAI-compatible server on 127.0.0.1 against the real ``openai`` client, with a tiny random
model; outputs checked against the decoder's ``generate`` run alone."""

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from compress.decoder.generate import generate
from compress.decoder.model import load
from compress.serve.app import create_app
from compress.serve.engine import Engine
from compress.serve.worker import Worker
from tests.conftest import serve_in_thread, stop
from tests.test_decoder import save, tiny_hf, tiny_tokenizer

openai = pytest.importorskip("openai")
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return save(tiny_hf(), tmp_path_factory.mktemp("tiny"), tok)


@pytest.fixture(scope="module")
def server(folder):
    model, tok = load(folder)
    engine = Engine(model, tok, num_blocks=96, block_size=4, max_seqs=8, max_step_tokens=64)
    with serve_in_thread(create_app(Worker(engine), tok, "tiny"), 30, "warning") as url:
        yield SimpleNamespace(
            url=url,
            engine=engine,
            model=model,
            tok=tok,
            client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
        )


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines())}


def settled(server, timeout: float = 10.0) -> dict:
    """The metrics once nothing runs or waits; every block is free then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server.url)
        if m["compress_requests_running"] == m["compress_requests_waiting"] == 0:
            assert m["compress_kv_blocks_free"] == m["compress_kv_blocks_total"]
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def reference(server, ids, n, **kw):
    return generate(server.model, [ids], n, server.tok, **kw)


def test_completions(server):
    prompt = "the quick brown fox"
    ids = server.tok(prompt).input_ids
    ref = reference(server, ids, 12)
    r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.texts[0] and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.tokens[0])
    assert r.choices[0].finish_reason == ("length" if len(ref.tokens[0]) == 12 else "stop")
    chunks = list(
        server.client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.tokens[0])
    # token ids as the prompt, a stop string, and seeded sampling
    r = server.client.completions.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=[ref.texts[0][4:7]]
    )
    assert r.choices[0].text == reference(server, ids, 12, stop=(ref.texts[0][4:7],)).texts[0]
    assert r.choices[0].finish_reason == "stop"
    from compress.decoder.sampling import Sampling

    r = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0.8, top_p=0.9, seed=3
    )
    assert (
        r.choices[0].text
        == reference(server, ids, 10, sampling=Sampling(0.8, None, 0.9, 3)).texts[0]
    )
    settled(server)


def test_chat(server):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the lazy dog"},
    ]
    ids = server.tok(
        server.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    ref = reference(server, ids, 10)
    r = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert r.choices[0].message.content == ref.texts[0] and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    chunks = list(
        server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.texts[0]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    settled(server)


def test_models_health_metrics(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = metrics(server.url)
    assert m["compress_kv_blocks_total"] == 96 and "compress_generation_tokens_per_second" in m


def test_load_64_requests_8_clients(server):
    """64 requests (half streamed) from 8 concurrent clients: all complete as alone, no leaks."""
    prompts = [f"the quick {'brown ' * (i % 7)}fox {i}" for i in range(64)]
    before = metrics(server.url)["compress_generated_tokens_total"]

    def one(i):
        kw = dict(model="tiny", prompt=prompts[i], max_tokens=8 + i % 9, temperature=0)
        if i % 2:
            return "".join(
                c.choices[0].text for c in server.client.completions.create(stream=True, **kw)
            )
        return server.client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(64)))
    for i in (0, 1, 17, 63):  # a sample against generate alone (greedy batched = alone)
        assert texts[i] == reference(server, server.tok(prompts[i]).input_ids, 8 + i % 9).texts[0]
    m = settled(server)
    assert m["compress_generated_tokens_total"] > before
    assert m["compress_prefix_cache_hit_tokens_total"] > 0  # prompts share "the quick brown ..."


BAD = [  # (what, method, path, body or raw bytes, status)
    ("malformed JSON", "post", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    ("body not an object", "post", "/v1/completions", [1, 2], 400),
    ("missing model", "post", "/v1/completions", {"prompt": "hi"}, 400),
    ("unknown model", "post", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("missing prompt", "post", "/v1/completions", {"model": "tiny"}, 400),
    (
        "max_tokens 0",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 0},
        400,
    ),
    (
        "temperature not a number",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "temperature": "hot"},
        400,
    ),
    (
        "top_p above 1",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "top_p": 1.5},
        400,
    ),
    ("over-long prompt", "post", "/v1/completions", {"model": "tiny", "prompt": "fox " * 200}, 400),
    (
        "prompt + max_tokens over the context",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 500},
        400,
    ),
    ("n > 1", "post", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400),
    (
        "token id outside the vocabulary",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": [5, 999]},
        400,
    ),
    (
        "five stop strings",
        "post",
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stop": list("abcde")},
        400,
    ),
    ("empty messages", "post", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
    (
        "unknown role",
        "post",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
    ),
    ("wrong method", "get", "/v1/completions", None, 405),
    ("unknown route", "get", "/v1/nothing", None, 404),
]


@pytest.mark.parametrize("what, method, path, body, status", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, what, method, path, body, status):
    kw = (
        {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    )
    if isinstance(body, bytes):
        kw["headers"] = {"content-type": "application/json"}
    r = getattr(httpx, method)(server.url + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if "context" in what or "over-long" in what:
        assert err["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_openai_client_raises_on_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 300}]
        )


@pytest.fixture
def slow_engine(server, monkeypatch):
    """Steps slowed to 20 ms, and the sequences the engine aborts recorded."""
    aborted, step, abort = [], server.engine.step, server.engine.abort

    def slow_step():
        time.sleep(0.02)
        return step()

    def recording_abort(seq):
        aborted.append(seq)
        abort(seq)

    monkeypatch.setattr(server.engine, "step", slow_step)
    monkeypatch.setattr(server.engine, "abort", recording_abort)
    return aborted


def test_disconnecting_clients_free_their_blocks(server, slow_engine):
    body = {
        "model": "tiny",
        "prompt": "the quick brown fox",
        "max_tokens": 100,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        first = next(lines)
        assert first.startswith("data: ") and "choices" in json.loads(first[6:])
        assert metrics(server.url)["compress_requests_running"] == 1
    settled(server)
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a whole response
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    settled(server)
    assert len(slow_engine) == 2 and all(
        s.finish_reason == "abort" and len(s.output) < 100 for s in slow_engine
    )


@pytest.mark.slow
def test_cli_serves(folder, tmp_path):
    """``python -m compress.serve RUN --port P --prefill-ranks 2`` in a subprocess answers on
    127.0.0.1, a long prompt prefilled by KV-Runahead over two processes. The server's output goes
    to a file (a pipe nobody reads can fill and stall it, and reading a live server's pipe
    blocks); the server and its ranks are killed whatever happens."""
    port = free_port()
    log = tmp_path / "server.log"
    args = [sys.executable, "-m", "compress.serve", str(folder), "--port", str(port),
            "--num-blocks", "64", "--log-level", "warning", "--prefill-ranks", "2",
            "--runahead-min-tokens", "16", "--kv", "full"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except (httpx.ConnectError, httpx.TimeoutException):
                pass
            up = proc.poll() is None and time.monotonic() < deadline
            assert up, f"the server exited or was not up in 120 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        )
        name = client.models.list().data[0].id
        assert name == folder.name
        model, tok = load(folder)
        prompt = "over the lazy dog, the quick brown fox jumps; the fox, the dog"
        text = (
            client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            .choices[0]
            .text
        )
        # exact K/V, summed in another order: equal unless the greedy choice is a near-tie
        assert text == generate(model, [tok(prompt).input_ids], 8, tok, kv="full").texts[0]
        assert metrics(f"http://127.0.0.1:{port}")["compress_runahead_prefills_total"] == 1
    finally:
        stop(proc)
