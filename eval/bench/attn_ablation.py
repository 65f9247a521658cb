"""Training-free attention conversions of one model, scored on the same test windows.

    python eval/bench/attn_ablation.py gqa [--windows 4]          # attn.kv_heads=1 (MQA)
    python eval/bench/attn_ablation.py cla [--windows 4]          # cla_init first vs lstsq
    python eval/bench/attn_ablation.py rope_select [--windows 4] [--d-kv 16] [--svd weights]

``gqa``: mean-pooled to one KV head; ``cla``: attn.share=2 with each initialisation; ``rope_select``: mla at ``--d-kv`` (16; 0: full
rank, which isolates partial RoPE from the low-rank K/V), 4 pairs, with 2norm, uniform, high, low,
and ``mla.svd`` = ``--svd``. Calibration: 64 x 512 tokens of WikiText-2 validation text (the
recipes' ``calib``); evaluation: the first ``--windows`` windows of 2048 test tokens. Prints one
JSON line per variant (ppl), the source first.
"""

import argparse
import copy
import json
import os
from pathlib import Path

import torch

from compress.eval.perplexity import evaluate
from compress.io.data import calib_samples, eval_windows, read_text
from compress.io.source import load_model
from compress.methods.attn.cla import convert_cla
from compress.methods.attn.gqa import mean_pool_kv
from compress.methods.attn.mla import convert_mla, full_rank


def variants(kind: str, config, d_kv: int, svd: str):
    if kind == "gqa":
        return {"gqa kv_heads=1": lambda m, t: mean_pool_kv(copy.deepcopy(m), 1)}
    if kind == "cla":
        return {
            f"cla share=2 {init}": lambda m, t, init=init: convert_cla(m, 2, init, t)
            for init in ("first", "lstsq")
        }
    d_kv = d_kv or full_rank(config, 4)
    return {
        f"mla d_kv={d_kv} pairs=4 {s} svd={svd}": lambda m, t, s=s: convert_mla(
            m, d_kv, 4, s, t, svd
        )
        for s in ("2norm", "uniform", "high", "low")
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python eval/bench/attn_ablation.py")
    p.add_argument("kind", choices=("gqa", "cla", "rope_select"))
    p.add_argument("--windows", type=int, default=4)
    p.add_argument(
        "--d-kv", type=int, default=16, help="rope_select: latent per KV head (0: full rank)"
    )
    p.add_argument("--svd", default="weights", choices=("weights", "activations"))
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    data = Path(os.environ.get("COMPRESS_DATA_DIR", "COMPRESS_DATA_DIR-unset")) / "wikitext-2"
    model, tok, _ = load_model(args.model)
    test = read_text(str(data / "wiki.test.raw"), role="eval")
    windows = eval_windows(tok, test, 2048, args.windows)
    valid = read_text(str(data / "wiki.valid.tokens"), role="calib")
    calib = None if args.kind == "gqa" else calib_samples(tok, valid, 64, 512)
    print(json.dumps({"variant": "source", **evaluate(model, windows, desc="source")}), flush=True)
    for name, convert in variants(args.kind, model.config, args.d_kv, args.svd).items():
        with torch.no_grad():
            figures = evaluate(convert(model, calib), windows, desc=name)
        print(json.dumps({"variant": name, **figures}), flush=True)


if __name__ == "__main__":
    main()
