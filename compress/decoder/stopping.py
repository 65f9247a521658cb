"""When one generated sequence is done, and the text it emits: the one stop/EOS/detokenize path
that plain (``compress.decoder.generate``), speculative (``compress.decoder.speculative``) and
batched generation (``compress.serve.engine``) feed their sampled tokens into.

Per sampled token ``t``, in order:

    t in eos             -> done ("stop"); t is not kept
    keep t; text so far  =  decode(kept ids), cut before the first stop string -> done ("stop")
    len(kept) == max     -> done ("length")

Text is emitted incrementally: what could still begin a stop string, or ends inside a UTF-8
sequence (the decoded text ends in U+FFFD), is held back until it is final; when the sequence
is done the rest is emitted with the token that ended it.
"""


class Detokenizer:
    """Incremental text of one generated row; ``push(id)`` returns the text that became final.

    Each push decodes a window of a few ids, not the whole row (O(1) amortized per token): with
    ``p <= r <= n`` (``ids[p:r]`` the ids decoded last, ``ids[r:]`` the new ones)::

        piece = decode(ids[p:]) minus its prefix decode(ids[p:r]);   then p, r = r, n

    Decoding the window together with the ids before the new ones keeps what depends on a
    neighbour (a SentencePiece word's leading space) as ``decode(ids)`` gives it. A window whose
    text ends in U+FFFD ends inside a UTF-8 sequence: nothing is final until a later id
    completes it, or until :meth:`flush` (the row ends there: its text ends in U+FFFD, as
    ``decode(ids)``'s does). Text that could still begin a stop string (the last
    ``max(len(stop)) - 1`` characters) is held back; once a stop string appears, the text is cut
    before it and ``stopped`` is set. A stop string can only end in the new piece, and then
    begins within the held-back text, so only ``held + piece`` is searched.

    Each window starts where the text before it ended on a whole character, so its text is
    the continuation ``decode(ids)`` has there: the streamed pieces concatenate to
    ``decode(ids, skip_special_tokens=True)`` (for a tokenizer whose decode does not rewrite
    text across a window's start: ``clean_up_tokenization_spaces`` off, as for every family
    here).
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.stopped = False
        self._p = self._r = 0  # the window: ids[_p:_r] decoded last, ids[_r:] not yet text
        self._final: list[str] = []  # text returned so far
        self._held = ""  # text decoded, held back for the stop strings
        self._keep = max((len(s) - 1 for s in self.stop), default=0)

    @property
    def text(self) -> str:
        """The row's text so far: returned and held back (cut before a stop string)."""
        return "".join(self._final) + self._held

    def _piece(self, last: bool = False) -> str | None:
        """The text of the ids not yet text, or None while it ends inside a character (``last``:
        the row ends here, so whatever it ends in is its text)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._p : self._r], skip_special_tokens=True)
        full = decode(self.ids[self._p :], skip_special_tokens=True)
        if full.endswith("\ufffd") and not last:
            return None
        self._p, self._r = self._r, len(self.ids)
        return full[len(prefix) :]

    def _take(self, piece: str, last: bool = False) -> str:
        """Add ``piece`` to the held-back text; return what is final (all of it when ``last``)."""
        window = self._held + piece
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if hits:
            window, self.stopped = window[: min(hits)], True
        cut = len(window) if self.stopped or last else max(0, len(window) - self._keep)
        out, self._held = window[:cut], window[cut:]
        self._final.append(out)
        return out

    def push(self, token: int) -> str:
        self.ids.append(token)
        piece = None if self.stopped else self._piece()
        return "" if piece is None else self._take(piece)

    def flush(self) -> str:
        """The rest of the text: what was held back, and the ids still ending inside a
        character (their U+FFFD, as ``decode`` gives it)."""
        if self.stopped or self._r == len(self.ids):
            return self._take("", last=True)
        return self._take(self._piece(last=True), last=True)


class Stopping:
    """One sequence's stop state: ``feed(token) -> (kept, text)`` per sampled token (module
    docstring); ``tokens`` (kept ids, EOS excluded), ``text`` (cut before a stop string; "" without
    a tokenizer), ``finish_reason`` (None while running, ``"stop"`` or ``"length"``)."""

    def __init__(self, max_tokens: int, eos=(), tokenizer=None, stop=()):
        self.max_tokens, self.eos = max_tokens, frozenset(eos)
        self.detok = Detokenizer(tokenizer, stop) if tokenizer is not None else None
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def feed(self, token: int) -> tuple[bool, str]:
        """``(kept, text final now)``; a token fed after the sequence is done is ignored."""
        if self.done:
            return False, ""
        if len(self.tokens) >= self.max_tokens:  # max_tokens 0
            self.finish_reason = "length"
            return False, ""
        if token in self.eos:
            self.finish_reason = "stop"
            return False, self.flush()
        self.tokens.append(token)
        text = ""
        if self.detok is not None:
            text = self.detok.push(token)
            if self.detok.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        if self.done:
            text += self.flush()
            if self.detok is not None and self.detok.stopped:  # a stop string in the last piece
                self.finish_reason = "stop"
        return True, text

    def flush(self) -> str:
        """The text held back (emitted when the sequence is done; call it to end early)."""
        return self.detok.flush() if self.detok is not None else ""
