"""The engine's thread: requests come in through a queue, events go out through each request's sink.

Only this thread touches the engine's state (scheduler, block manager, cache); the HTTP side
submits and aborts through :meth:`Worker.submit` and :meth:`Worker.abort`, which only enqueue.
A step that raises fails the requests it ran (their sinks get the error) and the worker goes on.
"""

import collections
import itertools
import logging
import queue
import threading
import time

from compress.serve.engine import Engine
from compress.serve.scheduler import Params

log = logging.getLogger("compress.serve")


class Worker:
    """Runs ``engine`` in a daemon thread; ``sink(event_or_exception)`` is called on that thread."""

    def __init__(self, engine: Engine, rate_window_s: float = 10.0):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[int, callable] = {}
        self.seqs: dict[int, object] = {}
        self.ids = itertools.count()
        self.window = rate_window_s
        self.recent: collections.deque = collections.deque()  # (time, tokens sampled that step)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="compress-engine", daemon=True)

    def start(self) -> "Worker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(("wake", None, None))
        self.thread.join()

    def submit(self, prompt: list[int], params: Params, sink) -> int:
        """Check the request here (raises ``CompressError``), queue it, and return its id."""
        self.engine.check(prompt, params)
        rid = next(self.ids)
        self.inbox.put(("add", rid, (prompt, params, sink)))
        return rid

    def abort(self, rid: int) -> None:
        self.inbox.put(("abort", rid, None))

    def tokens_per_s(self) -> float:
        """Tokens sampled per second over the last ``rate_window_s`` seconds."""
        now, recent = time.monotonic(), list(self.recent)
        return sum(n for t, n in recent if t > now - self.window) / self.window

    def stats(self) -> dict:
        return dict(
            self.engine.stats(), tokens_per_s=self.tokens_per_s(), queued=self.inbox.qsize()
        )

    def _handle(self, kind, rid, payload) -> None:
        if kind == "add":
            prompt, params, sink = payload
            try:
                self.seqs[rid] = self.engine.add(prompt, params, seq_id=rid)
                self.sinks[rid] = sink
            except Exception as e:  # noqa: BLE001 - the request fails, the server stays up
                sink(e)
        elif kind == "abort" and rid in self.seqs:
            self.engine.abort(self.seqs.pop(rid))
            self.sinks.pop(rid, None)

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                item = self.inbox.get(timeout=None if not self.engine.has_work() else 0)
            except queue.Empty:
                item = None
            while item is not None:
                self._handle(*item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self.engine.has_work():
                self._step()

    def _step(self) -> None:
        before = self.engine.generated
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed; failing the running requests")
            for rid in list(self.seqs):
                self.engine.abort(self.seqs.pop(rid))
                self.sinks.pop(rid)(e)
            return
        now = time.monotonic()
        self.recent.append((now, self.engine.generated - before))
        while self.recent and self.recent[0][0] < now - self.window:
            self.recent.popleft()
        for ev in events:
            sink = self.sinks.get(ev.seq.id)
            if sink is not None:
                sink(ev)
            if ev.finished:
                self.seqs.pop(ev.seq.id, None)
                self.sinks.pop(ev.seq.id, None)
