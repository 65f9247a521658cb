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

    Text that could still begin a stop string, or that ends inside a UTF-8 sequence, is held
    back. Once a stop string appears, the text is cut before it and ``stopped`` is set.
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids, self.text, self.emitted, self.stopped = [], "", 0, False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        self.text = text
        hold = 0 if self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        out = text[self.emitted : max(self.emitted, len(text) - hold)]
        self.emitted += len(out)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


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
        return True, text

    def flush(self) -> str:
        """The text held back (emitted when the sequence is done; call it to end early)."""
        return self.detok.flush() if self.detok is not None else ""
