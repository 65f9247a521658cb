"""The OpenAI request bodies the server accepts, and their errors' shape.

Fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``; unknown fields are
ignored as OpenAI ignores them; supported-but-unused ones must keep their neutral value
(``n`` 1, ``echo`` false, no ``logprobs``, zero penalties), else the request is refused. ``top_k``
and ``ignore_eos`` are vLLM's extensions. Errors are ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status for the client's mistakes.

Text fields must be Unicode text: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which
no encoding can write, so it is refused with the rest of the validation. A text prompt longer
than :func:`prompt_char_limit` characters is refused before it is tokenized: a token covers at
most ``longest`` characters of the vocabulary's spelling (a byte-level BPE: bytes, >= characters),
so such a prompt has more tokens than the context holds,

    tokens >= characters / longest   and   characters > SLACK * longest * context
                                     =>    tokens > context     (SLACK for normalizers that shrink)
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from compress.decoder.sampling import Sampling, check_sampling
from compress.errors import CompressError
from compress.serve.scheduler import Params

SLACK = 2  # characters a normalizer may fold into one (NFKC, whitespace runs), beyond the spelling


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unicode_text(value):
    """``value`` (a string, or a list or dict holding strings) unchanged, or ValueError naming
    the first lone surrogate (the message shows it escaped: it cannot be encoded either)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"has a lone UTF-16 surrogate (\\u{ord(value[e.start]):04x} at character "
                    f"{e.start}), which is not a character; send the character itself, or both "
                    f"halves of its surrogate pair"
                ) from None
    elif isinstance(value, list | tuple):
        for v in value:
            unicode_text(v)
    elif isinstance(value, dict):
        for v in value.values():
            unicode_text(v)
    return value


def prompt_char_limit(tokenizer, max_len: int) -> int | None:
    """The most characters a text prompt may have (module docstring); None without a
    tokenizer."""
    if tokenizer is None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return SLACK * max(longest, 1) * max_len


class Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    # ranges of the sampling fields and max_tokens: ``sampling.check_sampling`` (in ``params``),
    # the one validation the decoder CLI and the API share
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def as_list(cls, v):
        return [v] if isinstance(v, str) else v or []

    @field_validator("model", "stop")
    @classmethod
    def model_stop_text(cls, v):
        return unicode_text(v)

    def check_size(self, max_chars: int | None, context: int) -> None:
        """Refuse a text prompt of more than ``max_chars`` characters, before tokenizing it."""
        n = self.prompt_chars()
        if max_chars is not None and n > max_chars:
            raise CompressError(
                f"the prompt has {n:,} characters, more than this model's context of {context:,} "
                f"tokens can hold (at most {max_chars:,} characters with this tokenizer); "
                f"shorten the prompt."
            )

    def prompt_chars(self) -> int:
        raise NotImplementedError

    def params(self, default_max: int) -> Params:
        check_sampling(
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.max_tokens,
            stop=self.stop,
            names={"max_new_tokens": "max_tokens"},
        )
        s = Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p if self.top_p < 1 else None,
            seed=self.seed,
        )
        return Params(
            max_tokens=self.max_tokens or default_max,
            sampling=s,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def prompt_text(cls, v):
        return unicode_text(v)

    def prompt_chars(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))

    def prompt_ids(self, tokenizer) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise CompressError(
                    "this server takes one prompt per request; send a list of "
                    "prompts as separate requests."
                )
            p = p[0]
        if isinstance(p, str):
            return tokenizer(p).input_ids
        return list(p)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def content_text(cls, v):
        return unicode_text(v)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(
            part.get("type") != "text" or not isinstance(part.get("text"), str)
            for part in self.content
        ):
            raise CompressError(
                'message content parts must be text parts {"type": "text", "text": ...}.'
            )
        return "".join(part["text"] for part in self.content)


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: Literal[False] | None = None

    def prompt_chars(self) -> int:
        return sum(len(m.text()) for m in self.messages)

    def prompt_ids(self, tokenizer) -> list[int]:
        """The messages through the model's chat template, tokenized. A template that refuses
        the messages (``raise_exception``: roles that do not alternate, no user turn) or fails
        on them is the client's 400; a template that is not valid Jinja is the server's."""
        if not getattr(tokenizer, "chat_template", None):
            raise CompressError("this model's tokenizer has no chat template; use /v1/completions.")
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]
        import jinja2  # optional: transformers' chat templates need it, plain completions do not

        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateSyntaxError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
            raise CompressError(
                f"this model's chat template refused these messages: {str(e) or type(e).__name__}. "
                f"Send the roles in the order the model's template takes (often: an optional "
                f"system message, then user and assistant turns alternating, ending with user)."
            ) from None
        return tokenizer(text, add_special_tokens=False).input_ids

    def params(self, default_max: int) -> Params:
        if self.max_completion_tokens is not None:
            check_sampling(
                max_new_tokens=self.max_completion_tokens,
                names={"max_new_tokens": "max_completion_tokens"},
            )
            self.max_tokens = self.max_completion_tokens
        return super().params(default_max)
