"""The HTTP server under the app: uvicorn's h11 protocol with connection timeouts, and the address
it actually bound.

uvicorn (0.55) closes a keep-alive connection that stays silent after a response, but puts no
time limit on a connection before its first request, nor on a request head or body that
arrives a byte at a time (slowloris), so each could hold a file descriptor indefinitely. Here
every connection is, at any moment, in one of these states, each with its limit:

    waiting for a request   no byte for ``idle_timeout`` s           -> closed   (default 5)
    reading the head        head not whole ``head_timeout`` s after  -> closed   (default 10)
                            the connection became ready (accepted,
                            or its previous response sent)
    reading the body        not whole within ``body_timeout`` s      -> 408, closed (default 30;
                                                                        RequestLimits answers it,
                                                                        the connection is cut
                                                                        1 s later if no route
                                                                        reads the body)
    computing, answering    no limit (a long generation is not a stalled client)

The head is also bounded in size (``H11_MAX_HEADER_BYTES``: larger gets 400 from h11).
"""

import asyncio
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from compress.serve.limits import (
    BODY_TIMEOUT_S,
    H11_MAX_HEADER_BYTES,
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
)

log = logging.getLogger("compress.serve")
BODY_GRACE_S = 1.0  # after body_timeout, RequestLimits' 408 goes first


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head, body and idle limits of the module docstring
    (``timeout_keep_alive`` of the config is the idle limit, here from the accept on too)."""

    head_timeout: float = HEAD_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S + BODY_GRACE_S

    def connection_made(self, transport) -> None:
        self.timers: dict[str, asyncio.TimerHandle] = {}
        super().connection_made(transport)
        self._ready()

    def _ready(self) -> None:
        """Waiting for a request: the idle limit (uvicorn's keep-alive timer, cancelled by any
        byte) and the head's deadline."""
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._arm("head", self.head_timeout)

    def _arm(self, name: str, delay: float) -> None:
        self._cancel(name)
        self.timers[name] = self.loop.call_later(delay, self._expired, name, delay)

    def _cancel(self, name: str) -> None:
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _expired(self, name: str, delay: float) -> None:
        self.timers.pop(name, None)
        if not self.transport.is_closing():
            log.debug(
                "closed a connection whose request %s did not arrive within %g s", name, delay
            )
            self.transport.abort()  # nothing to flush; frees the descriptor at once

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._cancel("head")
            if "body" not in self.timers:
                self._arm("body", self.body_timeout)
        elif state is h11.IDLE:
            if "body" in self.timers:  # a body that ended after its response: ready again
                self._cancel("body")
                self._ready()
        else:  # the request is whole (or the connection is done)
            self._cancel("head")
            self._cancel("body")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm("head", self.head_timeout)  # the next request's head (pipelined or not)

    def connection_lost(self, exc) -> None:
        for name in list(self.timers):
            self._cancel(name)
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server; ``on_listening(host, port)`` is called once the socket is bound, with
    the port the system picked for port 0."""

    def __init__(self, config: uvicorn.Config, on_listening=None):
        super().__init__(config)
        self.on_listening = on_listening
        self.port: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            if self.on_listening is not None:
                self.on_listening(self.config.host, self.port)


def make_server(
    app,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "info",
    head_timeout: float = HEAD_TIMEOUT_S,
    body_timeout: float = BODY_TIMEOUT_S,
    idle_timeout: float = IDLE_TIMEOUT_S,
    on_listening=None,
) -> Server:
    """The server ``python -m compress.serve`` runs ``app`` on (``.run()`` blocks): h11 (whose
    header bound httptools would ignore) with the limits of the module docstring."""
    protocol = type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"head_timeout": head_timeout, "body_timeout": body_timeout + BODY_GRACE_S},
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES,
        timeout_keep_alive=idle_timeout,
    )
    return Server(config, on_listening)
