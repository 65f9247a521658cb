"""The OpenAI-compatible HTTP app (FastAPI): routes, streaming, errors.

    POST /v1/completions, /v1/chat/completions    (``"stream": true``: server-sent events, then
                                                    ``data: [DONE]``)
    GET  /v1/models, /health, /metrics             (Prometheus text: queue, running, blocks,
                                                    tokens/s)

A request is checked here (a text prompt too long for the context is refused before it is
tokenized: ``protocol.prompt_char_limit``), tokenized and templated on a worker thread, so that
a long prompt never stalls the event loop that answers everyone else, then queued to the
engine's thread (``compress.serve.worker``); its events come back through an asyncio queue. A
client that goes away (a closed stream, or a dropped connection while a full response is
pending) aborts its request, which frees its blocks. Errors have OpenAI's shape (``protocol.error_body``); nothing
here logs prompt or output text.
"""

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from compress.errors import CompressError
from compress.serve.auth import ApiKey
from compress.serve.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, RequestLimits
from compress.serve.protocol import ChatRequest, CompletionRequest, error_body, prompt_char_limit
from compress.serve.worker import Worker

log = logging.getLogger("compress.serve")
CHAT_MAX_TOKENS = 256  # chat's max_tokens when not given (within the context)
DISCONNECT_POLL_S = 0.5


def create_app(
    worker: Worker,
    tokenizer,
    model_name: str,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    api_key: str | None = None,
) -> FastAPI:
    """The app serving ``worker``'s engine as ``model_name``; the worker starts and stops
    with it. Bodies over ``max_body_bytes`` get 413, bodies not whole within ``body_timeout_s``
    408 (``compress.serve.limits``); with ``api_key``, every route but /health needs it
    (``compress.serve.auth``), checked before anything else."""

    @asynccontextmanager
    async def lifespan(app):
        if not worker.thread.is_alive():
            worker.start()
        yield
        worker.stop()

    app = FastAPI(title="compress", lifespan=lifespan)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)  # added last: runs first
    created = int(time.time())
    max_len = worker.engine.max_len
    max_chars = prompt_char_limit(tokenizer, max_len)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(error_body("the request body is not valid JSON."), 400)
        e = errors[0]
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg")
        if e.get("type") == "value_error" and "error" in e.get("ctx", {}):
            msg = str(e["ctx"]["error"])  # our validators' message, without "Value error, "
        return JSONResponse(error_body(f"{loc or 'body'}: {msg}", param=loc or None), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(CompressError)
    async def refused(request, exc: CompressError):
        code = (
            "context_length_exceeded" if "context" in str(exc) or "KV blocks" in str(exc) else None
        )
        return JSONResponse(error_body(str(exc), param=getattr(exc, "param", None), code=code), 400)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body("internal error", "server_error"), 500)

    def check_model(name: str) -> None:
        if name != model_name:
            raise HTTPException(
                404, f"model '{name}' does not exist; this server serves '{model_name}'."
            )

    @app.get("/health")
    async def health():
        if not worker.thread.is_alive():
            return JSONResponse({"status": "stopped"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "compress",
                    "max_model_len": max_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        s = worker.stats()
        rows = [
            ("compress_requests_waiting", s["waiting"] + s["queued"]),
            ("compress_requests_running", s["running"]),
            ("compress_kv_blocks_free", s["free_blocks"]),
            ("compress_kv_blocks_total", s["total_blocks"]),
            ("compress_prefix_cache_hit_tokens_total", s["prefix_hit_tokens"]),
            ("compress_preemptions_total", s["preemptions"]),
            ("compress_generated_tokens_total", s["generated_tokens"]),
            ("compress_runahead_prefills_total", s["runahead_prefills"]),
            ("compress_generation_tokens_per_second", round(s["tokens_per_s"], 3)),
        ]
        for pool in s.get("pools", ()):  # sliding-window layers' pools, per window
            if pool["window"] is not None:
                label = f'{{window="{pool["window"]}"}}'
                rows.append((f"compress_kv_local_blocks_free{label}", pool["free"]))
                rows.append((f"compress_kv_local_blocks_total{label}", pool["total"]))
        return PlainTextResponse("".join(f"{k} {v}\n" for k, v in rows))

    async def run(request: Request, body, chat: bool):
        check_model(body.model)
        body.check_size(max_chars, max_len)
        prompt = await asyncio.to_thread(body.prompt_ids, tokenizer)
        params = body.params(min(CHAT_MAX_TOKENS, max(1, max_len - len(prompt))))
        events = Events(request)
        rid = worker.submit(prompt, params, events.sink)
        reply = Reply(body, chat, model_name, len(prompt))
        if body.stream:
            return StreamingResponse(stream(rid, events, reply), media_type="text/event-stream")
        done = False
        try:
            texts = []
            while not done:
                ev = await events.next()
                if ev is None:
                    return JSONResponse(error_body("client disconnected"), 499)
                if isinstance(ev, Exception):
                    done = True
                    raise ev
                texts.append(ev.text)
                done = ev.finished
            return reply.full("".join(texts), ev.seq)
        finally:
            if not done:
                worker.abort(rid)

    async def stream(rid: int, events: "Events", reply: "Reply"):
        done = False
        try:
            if reply.chat:
                yield reply.sse(reply.chunk(None, None, first=True))
            while not done:
                ev = await events.next()
                if ev is None:
                    return
                if isinstance(ev, Exception):
                    done = True
                    msg = str(ev) if isinstance(ev, CompressError) else "internal error"
                    yield reply.sse(error_body(msg, "server_error"))
                    yield "data: [DONE]\n\n"
                    return
                done = ev.finished
                if ev.text or done:
                    yield reply.sse(reply.chunk(ev.text, ev.seq.finish_reason if done else None))
            if reply.body.include_usage:
                yield reply.sse(
                    dict(reply.chunk(None, None, usage_only=True), usage=reply.usage(ev.seq))
                )
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                worker.abort(rid)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await run(request, body, chat=True)

    return app


class Events:
    """A request's engine events, as an asyncio queue the engine's thread fills; :meth:`next`
    also notices, every ``DISCONNECT_POLL_S``, a client that has gone away."""

    def __init__(self, request: Request):
        self.request, self.queue = request, asyncio.Queue()
        self.loop, self.checked = asyncio.get_running_loop(), time.monotonic()

    def sink(self, event) -> None:
        """Called on the engine's thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self):
        """The next engine event, or None once the client has disconnected."""
        while True:
            if time.monotonic() - self.checked > DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass


class Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, body, chat: bool, model: str, n_prompt: int):
        self.body, self.chat, self.model, self.n_prompt = body, chat, model, n_prompt
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, seq) -> dict:
        n = len(seq.output)
        return {
            "prompt_tokens": self.n_prompt,
            "completion_tokens": n,
            "total_tokens": self.n_prompt + n,
        }

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, seq) -> dict:
        reason = seq.finish_reason
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
            return dict(self.head("chat.completion"), choices=[choice], usage=self.usage(seq))
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return dict(self.head("text_completion"), choices=[choice], usage=self.usage(seq))

    def chunk(self, text, reason, first: bool = False, usage_only: bool = False) -> dict:
        if self.chat:
            head = self.head("chat.completion.chunk")
            if usage_only:
                return dict(head, choices=[])
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text else {})
            )
            return dict(
                head,
                choices=[{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}],
            )
        head = self.head("text_completion")
        if usage_only:
            return dict(head, choices=[])
        return dict(
            head,
            choices=[{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}],
        )

    @staticmethod
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"
