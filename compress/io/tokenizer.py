"""A model folder's tokenizer, read and checked against its model, with one paragraph instead of
transformers' traceback: tokenizer files that are missing or do not parse, token ids the model's
vocabulary does not hold, and a chat template that is not valid Jinja or refuses the messages.

A model of vocabulary V embeds the ids 0 .. V-1; an id >= V indexes past the embedding (an
``IndexError`` deep in the forward). Ordinary text tokenizes to ids of the tokenizer's base
vocabulary and to the special tokens it adds (BOS, EOS, padding), so :func:`check_vocabulary`
requires those to be < V when the model loads. Added tokens beyond V (a placeholder a text model
never embeds) are refused only where a text spells them, by :func:`check_ids` on the ids.
"""

import json
from pathlib import Path

from compress.errors import CompressError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(where, trust_remote_code: bool = False, name=None):
    """``AutoTokenizer.from_pretrained(where)``; a folder whose tokenizer transformers cannot read
    (``tokenizer.json`` missing or not JSON, ...) is a CompressError naming ``name`` (default
    ``where``)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a folder whose tokenizer transformers cannot read
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # one line
        if isinstance(where, Path):
            why = _folder_problem(where) or why
        raise CompressError(
            f"the tokenizer of model '{name or where}' cannot be loaded ({why}); the folder "
            f"needs the tokenizer files save_pretrained writes (tokenizer.json, "
            f"tokenizer_config.json): copy them from the source model."
        ) from None


def _folder_problem(folder: Path) -> str | None:
    """What is wrong with a local folder's tokenizer files, when it is one of the usual: no
    tokenizer file at all, or a ``tokenizer.json`` that is not JSON."""
    path = folder / "tokenizer.json"
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return f"'{folder}' has no tokenizer.json"
    if path.is_file():
        try:
            json.loads(path.read_bytes())
        except (ValueError, OSError) as e:
            return f"'{path}' is not valid JSON: {str(e).splitlines()[0][:120]}"
    return None


def check_ids(ids, vocab_size: int, what: str = "prompt") -> None:
    """Refuse token ids (a list, or an integer tensor) outside the model's vocabulary
    ``[0, vocab_size)``; empty ``ids`` pass (their callers refuse an empty prompt)."""
    if hasattr(ids, "min"):  # a tensor
        if ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
    else:
        if not len(ids):
            return
        low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise CompressError(
            f"{what} token ids run from {low} to {high}, outside the model's vocabulary "
            f"[0, {vocab_size}); tokenize with the model's own tokenizer."
        )


def check_vocabulary(tokenizer, vocab_size: int, where) -> None:
    """Refuse a tokenizer whose base vocabulary or special tokens reach past the model's
    ``vocab_size`` (the module docstring): its ids would index past the embedding."""
    if tokenizer is None:
        return
    base = int(getattr(tokenizer, "vocab_size", 0) or 0)
    special = [
        i
        for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        if isinstance(i, int)
    ]
    high = max([base - 1, *special])
    if high >= vocab_size:
        raise CompressError(
            f"the tokenizer of '{where}' produces token ids up to {high} ({base} tokens in its "
            f"vocabulary), but the model's vocabulary holds {vocab_size} (config.json "
            f"vocab_size, the embedding's rows): those ids index past the embedding. The "
            f"tokenizer files belong to another model; copy in the model's own tokenizer."
        )


def chat_text(tokenizer, messages: list[dict], where, fix: str = "") -> str:
    """``messages`` through the tokenizer's chat template (generation prompt added), as text; a
    template that is not valid Jinja, or that refuses the messages (``raise_exception``: roles
    that do not alternate, no user turn), is a CompressError; ``fix`` ends its message."""
    import jinja2  # transformers' chat templates need it

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise CompressError(
            f"the chat template of '{where}' is not valid Jinja (line {e.lineno}: {e.message}); "
            f"fix chat_template in its tokenizer_config.json (or its chat_template.jinja), or "
            f"copy the template of the source model{fix}."
        ) from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
        raise CompressError(
            f"the chat template of '{where}' refused the messages "
            f"({str(e).strip()[:300] or type(e).__name__}){fix}."
        ) from None
