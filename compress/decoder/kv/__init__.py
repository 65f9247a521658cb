"""KV caches of the decoder, one file per kind, and the one registry every caller reads.

    fp16     the baseline (``fp16.py``)          full    fp16's layout in the model's dtype: exact
    kivi     KIVI 2-/4-bit (``kivi.py``)         packkv  PackKV (``packkv.py``)

Every kind is built from the model's :class:`KVLayout` (``kv/base.py``) and its own options.
A method may bring caches of its own (IAM's, ``compress.methods.iam.cache``: not ``--kv``
kinds), built by its model's ``make_cache`` (:func:`new_cache`). The CLI's ``--kv``, the
pipeline's ``decode.kv`` check and ``eval/bench/kv_quality.py`` take their names from
:data:`KV_KINDS`; ``base.py`` has the interface.
"""

import torch

from compress.decoder.kv.base import Cache, KVLayout
from compress.decoder.kv.fp16 import FP16Cache, FullCache, static_cache
from compress.decoder.kv.kivi import KIVICache
from compress.decoder.kv.packkv import PackKVCache
from compress.errors import CompressError

CACHES = {"fp16": FP16Cache, "kivi": KIVICache, "packkv": PackKVCache, "full": FullCache}
KV_KINDS = tuple(CACHES)


def parse_options(pairs: list[str], what: str = "--kv-opt") -> dict:
    """``["bits=2", "k_rel=0.05"]`` -> ``{"bits": 2, "k_rel": 0.05}`` (values parsed as JSON when
    they can be)."""
    import json

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CompressError(f"{what} takes KEY=VALUE, got '{pair}'.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


__all__ = [
    "CACHES",
    "KV_KINDS",
    "Cache",
    "FP16Cache",
    "FullCache",
    "KIVICache",
    "KVLayout",
    "PackKVCache",
    "make_cache",
    "new_cache",
    "static_cache",
]


def make_cache(
    kind: str,
    layout: KVLayout,
    batch: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    lookahead: int = 0,
    **opts,
) -> Cache:
    """A cache of ``kind`` (one of :data:`KV_KINDS`) holding ``layout`` per token for ``batch``
    rows of up to ``max_len`` tokens; ``opts`` are that kind's options.

    ``lookahead``: the most tokens a caller appends beyond one and then rolls back (speculative
    decoding's gamma). See ``kv/base.py``.
    """
    if kind not in CACHES:
        raise CompressError(f"unknown KV cache kind '{kind}'. Use one of {list(KV_KINDS)}.")
    cls = CACHES[kind]
    cls.check_layout(layout)
    unknown = set(opts) - set(cls.OPTIONS)
    if unknown:
        raise CompressError(
            f"KV cache '{kind}' has no option(s) {sorted(unknown)}; its options are "
            f"{list(cls.OPTIONS) or 'none'}."
        )
    return cls(layout, batch, max_len, dtype, torch.device(device), lookahead, **opts)


def new_cache(model, kind: str, batch: int, max_len: int, lookahead: int = 0, **opts) -> Cache:
    """A preallocated cache of ``kind`` for the decoder's ``model``, of its ``kv_layout()``
    (``lookahead`` as :func:`make_cache`'s). A model that builds its own caches (a pair of
    models: ``compress.methods.iam``) has ``make_cache(kind, batch, max_len, **opts)``.

    Attention computes in fp32 on the CPU, whose bfloat16 matmuls are slow, and in the
    model's dtype on a GPU; the ``full`` cache also stores K and V in that dtype.
    """
    if hasattr(model, "make_cache"):  # a model of two models builds its own pair of caches
        return model.make_cache(kind, batch, max_len, **opts)
    device = model.device
    dtype = torch.float32 if device.type == "cpu" else model.dtype
    return make_cache(
        kind, model.kv_layout(), batch, max_len, dtype, device, lookahead=lookahead, **opts
    )
