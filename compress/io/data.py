"""Text sources for calibration and evaluation.

A source is a local text file or a ``datasets`` id written
``repo[:config[:split]]`` (for example
``Salesforce/wikitext:wikitext-2-raw-v1:test``). The shipped data configs read
WikiText-2 from ``$COMPRESS_DATA_DIR/wikitext-2/``.

Eval windows: tokenize the whole text once, cut it into
non-overlapping windows of ``seqlen`` tokens. Calibration samples: random
non-overlapping blocks of ``seqlen`` tokens from the calibration text, seeded.

A process keeps the token ids of the last few (tokenizer, text) pairs it tokenized, keyed by the
sha256 of the fast tokenizer's serialized state and of the text, so that runs in one process
(the Python API, the test suite) tokenize WikiText once, not once a run.
"""

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch

from compress.errors import CompressError

_SUFFIXES = (".txt", ".raw", ".tokens", ".jsonl", ".json", ".md")


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", ".", "~")) or source.endswith(_SUFFIXES) or "\\" in source


def check_source(source: str, role: str = "data") -> None:
    """Refuse a source that names a local file which is not there (datasets ids pass)."""
    if Path(str(source)).expanduser().is_dir():
        raise CompressError(
            f"{role} source '{source}' is a folder, not a text file; set data.{role}.source to a "
            f"text file or a datasets id such as 'Salesforce/wikitext:wikitext-2-raw-v1:test'."
        )
    if _looks_like_path(str(source)) and not Path(str(source)).expanduser().is_file():
        unset = "COMPRESS_DATA_DIR-unset" in str(source)  # the data config without the variable
        why = " (COMPRESS_DATA_DIR is not set)" if unset else ""
        raise CompressError(
            f"{role} file '{source}' not found{why}. Set COMPRESS_DATA_DIR to the folder that "
            f"holds wikitext-2/ (in this repo's checkout: COMPRESS_DATA_DIR=../shared/data), or "
            f"set data.{role}.source to a local text file or a datasets id such as "
            f"'Salesforce/wikitext:wikitext-2-raw-v1:test'."
        )


def read_text(source: str, role: str = "data") -> str:
    """Whole text of a source, with CRLF line endings normalised to ``\\n``."""
    p = Path(str(source)).expanduser()
    if p.is_file():
        return p.read_text(encoding="utf-8").replace("\r\n", "\n")
    check_source(source, role)
    repo, config, split = (str(source).split(":") + [None, None])[:3]
    try:
        import datasets

        ds = datasets.load_dataset(repo, config, split=split or "test")
    except Exception as e:  # offline, unknown id, ...
        raise CompressError(
            f"could not load {role} dataset '{source}' ({type(e).__name__}). Without network "
            f"access, set COMPRESS_DATA_DIR to a folder holding wikitext-2/, or set "
            f"data.{role}.source to a local text file."
        ) from None
    return "\n\n".join(ds["text"])


def wikitext_file(name: str) -> Path:
    """``$COMPRESS_DATA_DIR/wikitext-2/NAME``, for scripts that default to WikiText-2."""
    import os

    root = os.environ.get("COMPRESS_DATA_DIR")
    if not root:
        raise CompressError(
            f"COMPRESS_DATA_DIR is not set, so wikitext-2/{name} cannot be found. Set it to the "
            f"folder that holds wikitext-2/ (in this repo's checkout: "
            f"COMPRESS_DATA_DIR=../shared/data)."
        )
    return Path(root) / "wikitext-2" / name


_TOKENIZED: "OrderedDict[str, torch.Tensor]" = OrderedDict()
_TOKENIZED_KEEP = 4


def _token_key(tokenizer, text: str) -> str | None:
    """sha256 of the tokenizer's class, its serialized state and the text; None for a tokenizer
    without one (a slow tokenizer is not kept)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    for part in (backend.to_str(), text):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, as one 1-D tensor (the tokenizer adds BOS if it does)."""
    key = _token_key(tokenizer, text)
    if key is not None and key in _TOKENIZED:
        _TOKENIZED.move_to_end(key)
        return _TOKENIZED[key].clone()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=True, verbose=False).input_ids[0]
    if key is not None:
        _TOKENIZED[key] = ids.clone()
        while len(_TOKENIZED) > _TOKENIZED_KEEP:
            _TOKENIZED.popitem(last=False)
    return ids


def eval_windows(tokenizer, text: str, seqlen: int, windows: int | None = None) -> torch.Tensor:
    """``[n, seqlen]`` non-overlapping windows from the start of the text."""
    ids = tokenize(tokenizer, text)
    n = ids.numel() // seqlen
    if n == 0:
        raise CompressError(
            f"eval text has {ids.numel()} tokens, fewer than one window of {seqlen}; "
            f"lower eval.seqlen or use a longer text."
        )
    if windows:
        n = min(n, int(windows))
    return ids[: n * seqlen].reshape(n, seqlen)


def calib_samples(tokenizer, text: str, samples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``[samples, seqlen]`` blocks drawn without replacement from the calibration text."""
    ids = tokenize(tokenizer, text)
    blocks = ids.numel() // seqlen
    if blocks < samples:
        raise CompressError(
            f"calibration text has {blocks} blocks of {seqlen} tokens, fewer than "
            f"the {samples} samples asked for; lower calib.samples or calib.seqlen."
        )
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(blocks, generator=g)[:samples].sort().values
    return ids[: blocks * seqlen].reshape(blocks, seqlen)[pick]
