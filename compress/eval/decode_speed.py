"""The built-in decoder on a run folder: the speed figures of ``report.json``.

The pipeline calls :func:`measure` on the folder it has just written, so every run is loaded
and run by ``compress.decoder`` (its own model and kernels, not transformers), batch 1::

    decode_tok_s        greedy decoding of ``new_tokens`` after a ``prompt_tokens``-token prompt
                        (EOS ignored), after one untimed warm-up that prepares (and compiles) kernels
    prefill_tok_s       one prefill of ``prefill_tokens`` tokens
    kv_bytes_per_token  what the ``kv`` cache holds at the end of the decode, per token held
    decode_config       the configuration measured: dtype, qdtype (the int layers' dtype), lean,
                        kernel (exact, or w4a8: int8 activations, compress.kernels.w4a8_cpu),
                        compile, head (the output head's load-time quantization), kv, threads

Settings come from the recipe's ``decode`` group (``recipes/base.yaml``); the prompt is the
start of the first eval window. ``decode.threads`` (default 1) is torch's thread count for the
measurement, restored afterwards: one thread is steadier than torch's default on a busy machine
(BENCHMARKS.md).
Each phase logs a line as it starts. Absolute speeds on a shared machine are noisy: compare runs
with ``eval/bench/bench_decode.py``, which times systems side by side.
"""

import contextlib
import logging
import time

import torch

from compress.decoder.generate import generate
from compress.decoder.model import load
from compress.errors import CompressError

log = logging.getLogger(__name__)


def check_threads(n) -> None:
    """``decode.threads``: a whole number >= 1, or None (torch's default)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise CompressError(
            f"decode.threads={n!r}: use a whole number of threads >= 1 (1 is "
            f"fastest for batch-1 decoding on a busy machine), or null for "
            f"torch's default."
        )


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op thread count set to ``n`` (None: left as it is), restored on exit."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(folder, ids: list[int], cfg, loader=None, head: str = "none") -> dict:
    """Decode figures of the run folder ``folder``, prompting with the token ids ``ids``;
    ``loader(folder, dtype, **load_kw) -> (model, tokenizer)`` replaces the decoder's ``load``;
    the output head quantized at load as ``head`` (none, int8, int4: ``compress.layers.head``)."""

    start = time.perf_counter()

    def phase(text: str, *args) -> None:
        log.info("decoder [%.0fs]: " + text, time.perf_counter() - start, *args)

    with torch_threads(cfg.get("threads", 1)):
        phase("loading the run folder (%d torch threads)", torch.get_num_threads())
        lean = bool(cfg.get("lean", False))
        kernel = cfg.get("kernel", "exact")
        load_kw = {"kernel": kernel} if kernel != "exact" else {}  # custom loaders need not know it
        model, _ = (loader or load)(
            folder, dtype=getattr(torch, cfg.dtype), lean=lean, head=head, **load_kw
        )
        prompt = ids[: cfg.prompt_tokens]
        kw = dict(
            kv=cfg.kv, max_len=len(prompt) + cfg.new_tokens, compile=cfg.compile, ignore_eos=True
        )
        phase("warm-up, 2 tokens%s", " (compiling the decode step)" if cfg.compile else "")
        generate(model, [prompt], 2, **kw)  # a prefill and a decode step: kernel forms, compiling
        phase("decoding %d tokens after a %d-token prompt", cfg.new_tokens, len(prompt))
        r = generate(model, [prompt], cfg.new_tokens, **kw)
        phase("prefill of %d tokens", len(ids[: cfg.prefill_tokens]))
        p = generate(model, [ids[: cfg.prefill_tokens]], 1, kv=cfg.kv, ignore_eos=True)
        phase("done: %.1f tok/s decode, %.0f tok/s prefill", r.decode_tok_s, p.prefill_tok_s)
        threads = torch.get_num_threads()
    return {
        "decode_tok_s": r.decode_tok_s,
        "prefill_tok_s": p.prefill_tok_s,
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "decode_threads": threads,
        "decode_config": {
            "dtype": cfg.dtype,
            "qdtype": cfg.dtype,
            "lean": lean,
            "compile": bool(cfg.compile),
            "head": head,
            "kernel": kernel,
            "kv": cfg.kv,
            "threads": threads,
        },
    }
