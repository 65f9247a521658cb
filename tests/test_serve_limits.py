"""The server's limits against real clients (httpx, raw sockets, the openai client): oversized
bodies get 413, a body shorter than its Content-Length gets 408 within the timeout, a non-JSON
content-type gets OpenAI's error body, out-of-range sampling settings get 400 before a stream
starts, and a stream that fails mid-way ends with an error event and ``[DONE]``."""

import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest

from compress.decoder.model import load
from compress.serve.app import create_app
from compress.serve.engine import Engine
from compress.serve.worker import Worker
from tests.conftest import serve_in_thread
from tests.test_decoder import save, tiny_hf, tiny_tokenizer

LIMIT, TIMEOUT = 4096, 0.5
BODY = {"model": "tiny", "prompt": "the quick", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save(tiny_hf(), tmp_path_factory.mktemp("tiny"), tiny_tokenizer())
    model, tok = load(folder)
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_seqs=4, max_step_tokens=64)
    app = create_app(Worker(engine), tok, "tiny", max_body_bytes=LIMIT, body_timeout_s=TIMEOUT)
    with serve_in_thread(app, 30, "warning") as url:
        yield SimpleNamespace(url=url, port=int(url.rsplit(":", 1)[1]), engine=engine)


def openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    return err


def healthy(server):
    assert httpx.get(server.url + "/health").status_code == 200


def raw(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``data``, read until the server closes; (reply, seconds until closed)."""
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        chunks = []
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # refused while the rest was still being sent
            pass
    return b"".join(chunks), time.monotonic() - t


def test_a_body_over_the_limit_gets_413(server):
    big = dict(BODY, prompt="fox " * LIMIT)
    err = openai_error(httpx.post(server.url + "/v1/completions", json=big), 413)
    assert f"{LIMIT:,}" in err["message"] and "--max-body-bytes" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b" " * 1024

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    openai_error(r, 413)
    ok = httpx.post(server.url + "/v1/completions", json=dict(BODY, prompt="fox " * 100))
    assert ok.status_code == 200, ok.text  # under the limit
    healthy(server)


def test_a_content_length_longer_than_the_body_times_out(server):
    body = json.dumps(BODY).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 50}\r\n\r\n"
    ).encode()
    reply, took = raw(server.port, head + body)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert TIMEOUT <= took < TIMEOUT + 5  # answered and closed, not held open
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "did not arrive" in err["message"]
    healthy(server)


def test_an_oversized_header_is_refused_by_h11(server):
    """h11 bounds what it buffers of an incomplete request head; uvicorn reads 64 KiB at a time,
    so a head of several reads is refused."""
    head = ("GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + "a" * (256 << 10) + "\r\n\r\n").encode()
    reply, _ = raw(server.port, head)
    assert reply == b"" or reply.split(b" ", 2)[1] in (b"400", b"431"), reply[:200]
    healthy(server)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_gets_the_openai_error(server, ctype):
    r = httpx.post(
        server.url + "/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={"content-type": ctype},
    )
    err = openai_error(r, 400)
    assert "application/json" in err["message"] and ctype in err["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_huge_seed_gets_400_before_any_stream(server, stream):
    body = dict(BODY, seed=18446744073709551616, stream=stream)
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        r.read()
    err = openai_error(r, 400)
    assert err["param"] == "seed" and "2**64-1" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json=dict(body, seed=2**64 - 1, stream=False))
    assert r.status_code == 200, r.text  # the largest seed torch takes


def test_the_openai_client_raises_bad_request_on_a_huge_seed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=2**64)


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server, monkeypatch):
    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(server.engine, "step", broken_step)
    body = dict(BODY, stream=True, max_tokens=8)
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "boom" not in err["message"]
    monkeypatch.undo()
    healthy(server)
