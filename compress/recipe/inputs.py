"""Every text a run will read, checked before the model loads.

``check_inputs(cfg)`` reads the evaluation text, the calibration text when a stage calibrates
(``config.needs_calibration``) and the distillation text, and refuses one that is empty, not
UTF-8, or too short for what the recipe asks: ``eval.windows`` windows of ``eval.seqlen``
tokens (one window when ``eval.windows`` is null), ``calib.samples`` blocks of ``calib.seqlen``
(the prune stage's own ``prune.calib`` sizes where set). Tokens are counted with the source
model's tokenizer, a chunk of text at a time, stopping once there are enough; a hub id's
tokenizer is not fetched for this (its texts are checked for being non-empty only).
"""

from pathlib import Path

from compress.errors import CompressError
from compress.io.data import read_text
from compress.io.source import resolve_path
from compress.io.tokenizer import check_ids, load_tokenizer
from compress.recipe.config import needs_calibration

CHUNK_CHARS = 1 << 17
KEYS = {"eval": "data.eval.source", "calib": "data.calib.source", "distill": "distill.data"}


def count_tokens(tokenizer, text: str, need: int) -> int:
    """Tokens in ``text`` (the tokenizer's BOS included), counted until ``need`` are reached;
    chunks are cut at line ends, so the count matches the whole text's to a token or two."""
    n = len(tokenizer("", add_special_tokens=True).input_ids)  # BOS, if the tokenizer adds it
    pos = 0
    while pos < len(text) and n < need:
        end = text.find("\n", pos + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        n += len(tokenizer(text[pos:end], add_special_tokens=False, verbose=False).input_ids)
        pos = end
    return n


def _read(source: str, role: str) -> str:
    p = Path(str(source)).expanduser()
    if p.is_dir():
        raise CompressError(
            f"{role} source '{source}' is a folder; set {KEYS[role]} to a text file or a "
            f"datasets id such as 'Salesforce/wikitext:wikitext-2-raw-v1:test'."
        )
    try:
        text = read_text(source, role=role)
    except UnicodeDecodeError as e:
        raise CompressError(
            f"{role} file '{source}' is not UTF-8 text (byte {e.start} cannot be decoded); "
            f"convert it to UTF-8 or point {KEYS[role]} at a text file."
        ) from None
    except OSError as e:
        raise CompressError(f"cannot read {role} file '{source}' ({e.strerror}).") from None
    if not text.strip():
        raise CompressError(
            f"{role} source '{source}' is empty (no text but whitespace); set {KEYS[role]} "
            f"to a text with enough tokens for the run."
        )
    return text


def _tokenizer(cfg):
    """The source model's tokenizer when it is local (or the default model), else None."""

    where, _ = resolve_path(str(cfg.model.path))
    if not isinstance(where, Path):
        return None
    return load_tokenizer(where, cfg.model.trust_remote_code, name=cfg.model.path)


def needs(cfg) -> list[tuple[str, str, int, str]]:
    """``(role, source, tokens needed, what for)`` of each text the run reads."""

    out = []
    windows, seqlen = cfg.eval.windows, cfg.eval.seqlen
    out.append(
        (
            "eval",
            cfg.data.eval.source,
            (windows or 1) * seqlen,
            f"eval.windows={windows} windows of eval.seqlen={seqlen} tokens"
            if windows
            else f"one window of eval.seqlen={seqlen} tokens",
        )
    )
    if needs_calibration(cfg):
        samples, clen, where = cfg.calib.samples, cfg.calib.seqlen, "calib"
        p = (cfg.get("prune") or {}).get("calib") or {}
        if "prune" in cfg.stages and (p.get("samples") or p.get("seqlen")):
            samples, clen = p.get("samples") or samples, p.get("seqlen") or clen
            where = "prune.calib"
        out.append(
            (
                "calib",
                cfg.data.calib.source,
                samples * clen,
                f"{where}.samples={samples} blocks of {where}.seqlen={clen} tokens",
            )
        )
    if "distill" in cfg.stages and (cfg.get("distill") or {}).get("data"):
        out.append(("distill", cfg.distill.data, 1, "distillation"))
    return out


def check_inputs(cfg, tokenizer=None, roles=None) -> None:
    """Refuse a text the run would fail on later (after the stages, for the eval text).
    ``tokenizer`` counts the tokens (default: the source model's); ``roles`` limits the check
    to those texts (``("calib",)`` for ``compress.quantize``)."""
    todo = [t for t in needs(cfg) if roles is None or t[0] in roles]
    texts = {}
    for role, source, _, _ in todo:
        if (role, source) not in texts:
            texts[(role, source)] = _read(source, role)
    tok = tokenizer if tokenizer is not None else _tokenizer(cfg) if todo else None
    if tok is None:
        return
    for role, source, need, what in todo:
        have = count_tokens(tok, texts[(role, source)], need)
        if have < need:
            fix = (
                "lower eval.windows (null: all the text holds) or eval.seqlen"
                if role == "eval"
                else "lower calib.samples or calib.seqlen"
                if role == "calib"
                else "use a longer text"
            )
            raise CompressError(
                f"{role} text '{source}' has {have:,} tokens, fewer than the {need:,} the run "
                f"reads ({what}); {fix}, or set {KEYS[role]} to a longer text."
            )


def check_token_ids(tokens, vocab_size: int, what: str = "calibration") -> None:
    """Given calibration token ids: an integer tensor ``[samples, seqlen]`` of ids in the
    vocabulary."""
    import torch

    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise CompressError(
            f"{what} token ids must be an integer tensor [samples, seqlen], got "
            f"{getattr(tokens, 'dtype', '')} {shape}; e.g. tokenizer(texts, "
            f"return_tensors='pt').input_ids, or pass a text file instead."
        )
    if tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise CompressError(
            f"{what} token ids have shape {tuple(tokens.shape)}: give at least one sample of "
            f"two or more tokens."
        )
    check_ids(tokens, vocab_size, what)
