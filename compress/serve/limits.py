"""Request limits the server enforces before a route sees a request (a pure ASGI middleware).

- A body larger than ``max_body_bytes`` gets 413 (as vLLM's server answers it): at once when
  ``Content-Length`` says so, else as soon as the bytes read pass the limit; the rest is not read.
- A body that has not arrived whole within ``body_timeout_s`` (a ``Content-Length`` longer than
  what the client sends, a client that stalls) gets 408 and the connection is closed.
- A POST whose ``content-type`` is not JSON gets 400 with OpenAI's error body.

The request head's size and time, an idle connection's time, and a body no route reads are
bounded at the connection (``compress.serve.server``). The body read here is handed to the app whole; later ``receive`` calls go to the
client's connection, so the app still notices a disconnect.
"""

import asyncio
import json
import time

from compress.serve.protocol import error_body

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 30.0
# at the connection (compress.serve.server): the head's size and time, an idle connection's time
H11_MAX_HEADER_BYTES = 16 << 10  # request line and headers: larger ones get 400 (h11)
HEAD_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 5.0
_JSON = (b"application/json",)


class RequestLimits:
    def __init__(
        self, app, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S
    ):
        self.app, self.max_bytes, self.timeout = app, max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype and ctype not in _JSON and not ctype.endswith(b"+json"):
            return await send_error(
                send,
                400,
                f"the request body must be JSON, sent with content-type: application/json "
                f"(got content-type: {ctype.decode('latin-1')}).",
                close=True,
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, self._too_large(int(length)), close=True)
        body, deadline = bytearray(), time.monotonic() + self.timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await send_error(
                    send,
                    408,
                    f"the request body did not arrive within {self.timeout:g} s (received "
                    f"{len(body):,} bytes{f' of {int(length):,}' if length and length.isdigit() else ''}); "
                    f"send a Content-Length that matches the body.",
                    close=True,
                )
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.max_bytes:
                return await send_error(
                    send, 413, self._too_large(len(body), at_least=True), close=True
                )
            if not msg.get("more_body", False):
                break
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_large(self, n: int, at_least: bool = False) -> str:
        return (
            f"the request body has {'more than ' if at_least else ''}{n:,} bytes, over this "
            f"server's limit of {self.max_bytes:,} (python -m compress.serve --max-body-bytes); "
            f"send a shorter prompt."
        )


async def send_error(
    send,
    status: int,
    message: str,
    close: bool = False,
    kind: str = "invalid_request_error",
    code: str | None = None,
    headers: tuple = (),
) -> None:
    """Answer ``status`` with OpenAI's error body, from ASGI middleware (before any route);
    ``close``: ask the server to close the connection after it (the body is left unread)."""
    body = json.dumps(error_body(message, kind, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
