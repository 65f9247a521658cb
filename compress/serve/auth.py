"""The server's API key: every request but ``GET /health`` must carry ``Authorization: Bearer KEY``
(as OpenAI's API and vLLM's ``--api-key`` take it), else 401 in OpenAI's error shape, before
the body is read.

The key is compared in constant time (``hmac.compare_digest`` of the SHA-256 digests, so neither
the content nor the length of the key leaks through timing), is never logged, and never appears
in a reply. :func:`check_key` refuses keys an HTTP header cannot carry.
"""

import hashlib
import hmac

from compress.errors import CompressError
from compress.serve.limits import send_error

OPEN_PATHS = ("/health",)  # a load balancer's probe needs no key


def check_key(key: str, source: str = "--api-key") -> None:
    """Refuse a key that is empty or that an ``Authorization`` header cannot carry as sent
    (spaces, control or non-ASCII characters); the message never repeats the key."""
    if not key:
        raise CompressError(f"{source} is empty; give a key (any string of letters and digits).")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise CompressError(
            f"{source}: a key travels in the header 'Authorization: Bearer KEY', so it must be "
            f"printable ASCII without spaces; pick another key."
        )


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKey:
    """Pure ASGI middleware: 401 unless the request carries ``Authorization: Bearer <key>``
    (the scheme case-insensitive, as RFC 7235 has it); ``OPEN_PATHS`` are let through."""

    def __init__(self, app, key: str):
        check_key(key)
        self.app, self.digest = app, _digest(key.encode("ascii"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization")
        scheme, _, token = (given or b"").strip().partition(b" ")
        if given is None or scheme.lower() != b"bearer":
            message = (
                "this server needs an API key: send the header 'Authorization: Bearer KEY' "
                "(the openai client: api_key=KEY), with the key the server was started with "
                "(--api-key or COMPRESS_API_KEY)."
            )
        elif hmac.compare_digest(_digest(token.strip()), self.digest):
            return await self.app(scope, receive, send)
        else:
            message = (
                "the API key sent is not this server's (the one given to python -m "
                "compress.serve by --api-key or COMPRESS_API_KEY)."
            )
        return await send_error(
            send,
            401,
            message,
            close=True,  # the body is not read
            code="invalid_api_key",
            headers=((b"www-authenticate", b"Bearer"),),
        )
