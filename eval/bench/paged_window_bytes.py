"""KV bytes of the paged serving cache for a model with sliding-window layers: what one long
sequence holds, and what the pools take, against the same model with every layer global.

    python eval/bench/paged_window_bytes.py --folder RUN [--prompt-tokens 8000]
        [--new-tokens 16] [--block-size 16] [--num-blocks 1024] [--max-seqs 32] [--json OUT]
    python eval/bench/paged_window_bytes.py --quick    # a tiny random Gemma 3: it runs

One request of ``--prompt-tokens`` seeded random ids is served by the engine
(``compress.serve.engine``, fp16 K/V) until it has ``--new-tokens`` outputs; then, with ``L``
tokens in the cache, block size ``bs`` and ``b_s`` the bytes of one slot's block:

    measured     = sum over window groups g of (blocks the sequence holds in g) x block_bytes(g)
    bound        = (global slots x ceil(L / bs) + local slots x (ceil(w / bs) + 1)) x b_s
    all global   = slots x ceil(L / bs) x b_s
    pools        = the engine's preallocated pools (``cache.nbytes()``) against one pool of
                   ``--num-blocks`` for every slot

Per token: each divided by L. Byte counts only; no timing.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def tiny_gemma(folder: Path) -> Path:
    """A random Gemma 3 of six layers (five local, window 32) saved under ``folder``."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=32,
        max_position_embeddings=1024, query_pre_attn_scalar=16, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def measure(model, prompt_tokens, new_tokens, block_size, num_blocks, max_seqs) -> dict:
    from compress.serve.engine import Engine
    from compress.serve.scheduler import Params

    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (prompt_tokens,), generator=g).tolist()
    seq = engine.add(prompt, Params(max_tokens=new_tokens + 1, ignore_eos=True))
    while len(seq.output) < new_tokens:
        engine.step()
    L, cache, bs = seq.computed, engine.cache, block_size
    slot_block = cache.block_bytes(0) // cache.group.count(0)
    windows = cache.windows
    n_global = sum(w is None for w in windows)
    local = sum(math.ceil(w / bs) + 1 for w in windows if w is not None)
    measured = engine.kv_bytes(seq)
    engine.abort(seq)
    bound = (n_global * math.ceil(L / bs) + local) * slot_block
    every = len(windows) * math.ceil(L / bs) * slot_block
    pools_global = len(windows) * num_blocks * slot_block
    return dict(
        tokens=L,
        slots=len(windows),
        global_slots=n_global,
        windows=sorted({w for w in windows if w is not None}),
        measured_bytes=measured,
        bound_bytes=bound,
        all_global_bytes=every,
        measured_per_token=measured / L,
        all_global_per_token=every / L,
        pool_bytes=cache.nbytes(),
        pool_bytes_all_global=pools_global,
        pool_blocks=[p.num_blocks for p in engine.blocks.pools],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python eval/bench/paged_window_bytes.py")
    p.add_argument("--folder", help="a run folder or HF folder of a sliding-window model")
    p.add_argument("--quick", action="store_true", help="a tiny random Gemma 3, 300 tokens")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    if not args.folder and not args.quick:
        p.error("give --folder RUN or --quick")
    from compress.decoder.model import load

    if args.quick:
        import tempfile

        folder = tiny_gemma(Path(tempfile.mkdtemp()))
        args.prompt_tokens, args.new_tokens, args.num_blocks, args.max_seqs = 300, 8, 64, 2
    else:
        folder = args.folder
    model, _ = load(folder)
    with torch.no_grad():
        res = measure(
            model,
            args.prompt_tokens,
            args.new_tokens,
            args.block_size,
            args.num_blocks,
            args.max_seqs,
        )
    for k, v in res.items():
        print(f"{k:24s} {v:,.1f}" if isinstance(v, float) else f"{k:24s} {v}")
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
