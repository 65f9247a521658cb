"""The built-in decoder on a run folder: the speed figures of ``report.json`` (DESIGN "Run folder contract").

The pipeline calls :func:`measure` on the folder it has just written, so every run is loaded
and run by ``compress.decoder`` (its own model and kernels, not transformers), batch 1::

    decode_tok_s        greedy decoding of ``new_tokens`` after a ``prompt_tokens``-token prompt
                        (EOS ignored), after one untimed warm-up that prepares (and compiles) kernels
    prefill_tok_s       one prefill of ``prefill_tokens`` tokens
    kv_bytes_per_token  what the ``kv`` cache holds at the end of the decode, per token held

Settings come from the recipe's ``decode`` group (``recipes/base.yaml``); the prompt is the
start of the first eval window. Absolute speeds on a shared machine are noisy: compare runs
with ``eval/bench/bench_decode.py``, which times systems side by side.
"""

import torch


def measure(folder, ids: list[int], cfg) -> dict:
    """Decode figures of the run folder ``folder``, prompting with the token ids ``ids``."""
    from compress.decoder.generate import generate
    from compress.decoder.model import load

    model, _ = load(folder, dtype=getattr(torch, cfg.dtype))
    prompt = ids[: cfg.prompt_tokens]
    kw = dict(kv=cfg.kv, max_len=len(prompt) + cfg.new_tokens, compile=cfg.compile, ignore_eos=True)
    generate(model, [prompt], 2, **kw)  # warm-up: kernel forms, compiling
    r = generate(model, [prompt], cfg.new_tokens, **kw)
    p = generate(model, [ids[: cfg.prefill_tokens]], 1, kv=cfg.kv, ignore_eos=True)
    return {"decode_tok_s": r.decode_tok_s, "prefill_tok_s": p.prefill_tok_s,
            "kv_bytes_per_token": r.kv_bytes_per_token}
