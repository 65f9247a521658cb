"""Where LLM.int8's error comes from: a threshold sweep on validation text, in one run.

    python eval/bench/int8_sweep.py [--windows 8] [--seqlen 2048] [--thresholds 0 1 2 3 4 6]

Every setting quantizes the same fp32 model in memory and is scored on the same
windows of WikiText-2 *validation* text (never the test windows, so a threshold
picked here is not tuned on the test figures), against the source's log-probs:

    weights-only   W_hat = SCB * W_i8 / 127 (per-row absmax), activations in fp32
    rtn8-row       asymmetric RTN int8, one scale per row (rtn_int8 rtn.group_size=-1)
    t=a            LLM.int8 with threshold a (t=0: pure vector-wise int8)

The gap between weights-only and t=a is what per-token activation int8 costs. Each setting is
scored by ``compress.methods.quant.llm_int8.score``, as ``llm_int8.threshold=auto`` scores its candidates.
"""

import argparse

import torch

from compress.arch.adapters import get_adapter
from compress.eval.perplexity import evaluate
from compress.formats.quantizer import fake_quantize
from compress.io.data import eval_windows, read_text, wikitext_file
from compress.io.source import cache_dir, convert_default_model, load_model
from compress.layers.int8_linear import quantize_rowwise
from compress.methods.quant.llm_int8 import quantize_model, score


def weights_only(model):
    for lin in get_adapter(model.config).all_linears(model).values():
        w8, scb = quantize_rowwise(lin.weight.data)
        lin.weight.data = w8.float() * (scb / 127.0)[:, None]
    return model


def rtn8_row(model):
    for lin in get_adapter(model.config).all_linears(model).values():
        lin.weight.data = fake_quantize(lin.weight.data, 8, -1)
    return model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF folder (default: the default model)")
    p.add_argument(
        "--text", help="validation text (default: $COMPRESS_DATA_DIR/wikitext-2/wiki.valid.tokens)"
    )
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0, 1, 2, 3, 4, 6])
    args = p.parse_args(argv)
    text = read_text(args.text or str(wikitext_file("wiki.valid.tokens")), role="eval")
    source, tok, info = load_model(args.model or str(convert_default_model()), "float32", False)
    windows = eval_windows(tok, text, args.seqlen, args.windows)
    cache = cache_dir() / "logprobs" if info.sha256 else None

    settings = [("weights-only", weights_only), ("rtn8-row", rtn8_row)]
    settings += [(f"t={a:g}", lambda m, a=a: quantize_model(m, a)) for a in args.thresholds]
    rows = []
    for name, make in settings:
        f = score(source, windows, make, desc=name, cache=cache, source_sha=info.sha256)
        rows.append((name, f))
    fp = evaluate(source, windows, desc="fp32")["ppl"]
    print(f"\nWikiText-2 validation, {args.windows} windows of {args.seqlen}; fp32 ppl {fp:.3f}")
    print(f"{'setting':>14} {'ppl':>8} {'Δppl %':>8} {'KL':>10} {'top-1':>7}")
    for name, f in rows:
        print(
            f"{name:>14} {f['ppl']:8.3f} {100 * (f['ppl'] / fp - 1):8.2f} "
            f"{f['kl_vs_source']:10.5f} {f['top1_vs_source']:7.4f}"
        )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
