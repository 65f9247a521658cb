"""KV caches of the decoder, one file per kind, and the one registry every caller reads.

    fp16     the baseline (``fp16.py``)          full    fp16's layout in the model's dtype: exact
    kivi     KIVI 2-/4-bit (``kivi.py``)         packkv  PackKV (``packkv.py``)

``mapped.py`` holds the two caches of IAM decoding (``compress.methods.iam.decode`` builds them; they
are not ``--kv`` kinds). The CLI's ``--kv``, the pipeline's ``decode.kv`` check and
``eval/bench/kv_quality.py`` take their names from :data:`KV_KINDS`; ``base.py`` has the interface.
"""

import torch

from compress.decoder.kv.base import Cache
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
    "PackKVCache",
    "make_cache",
    "new_cache",
    "static_cache",
]


def make_cache(
    kind: str,
    n_layers: int,
    batch: int,
    n_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    windows=None,
    lookahead: int = 0,
    scale: float | None = None,
    **opts,
) -> Cache:
    """A cache of ``kind`` (one of :data:`KV_KINDS`); ``opts`` are that kind's options.

    ``windows``: each slot's sliding window (None: global); ``lookahead``: the most tokens a caller
    appends beyond one and then rolls back (speculative decoding's gamma); ``scale``: the
    attention's softmax scale (None: head_dim**-0.5). See ``kv/base.py``.
    """
    if kind not in CACHES:
        raise CompressError(f"unknown KV cache kind '{kind}'. Use one of {list(KV_KINDS)}.")
    cls = CACHES[kind]
    unknown = set(opts) - set(cls.OPTIONS)
    if unknown:
        raise CompressError(
            f"KV cache '{kind}' has no option(s) {sorted(unknown)}; its options are "
            f"{list(cls.OPTIONS) or 'none'}."
        )
    return cls(
        n_layers,
        batch,
        n_kv_heads,
        head_dim,
        max_len,
        dtype,
        torch.device(device),
        scale=scale,
        windows=windows,
        lookahead=lookahead,
        **opts,
    )


def new_cache(model, kind: str, batch: int, max_len: int, lookahead: int = 0, **opts) -> Cache:
    """A preallocated cache of ``kind`` for the decoder's ``model`` (its slots' sliding windows and
    attention scale from ``model.kv_layout()``; ``lookahead`` as :func:`make_cache`'s).

    Attention computes in fp32 on the CPU, whose bfloat16 matmuls are slow, and in the
    model's dtype on a GPU; the ``full`` cache also stores K and V in that dtype.
    """
    if hasattr(model, "make_cache"):  # a model of two models (IAM) builds its own pair of caches
        return model.make_cache(kind, batch, max_len, **opts)
    device = model.device
    dtype = torch.float32 if device.type == "cpu" else model.dtype
    layout = model.kv_layout()
    shape = [layout.pop(k) for k in ("n_layers", "n_kv_heads", "head_dim")]
    windows, scale = layout.pop("windows", None), layout.pop("scale", None)
    extra = {k: v for k, v in layout.items() if v is not None}
    if extra and kind not in ("fp16", "full"):
        raise CompressError(
            f"this model's latent (MLA) attention caches one key per token whose first "
            f"channels are also the value; the {kind} cache does not store that yet: "
            f"use --kv fp16 or full."
        )
    return make_cache(
        kind,
        shape[0],
        batch,
        shape[1],
        shape[2],
        max_len,
        dtype=dtype,
        device=device,
        windows=windows,
        lookahead=lookahead,
        scale=scale,
        **extra,
        **opts,
    )
