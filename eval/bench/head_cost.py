"""What a quantized output head costs a saved run folder: ppl, KL and top-1 per ``quant.lm_head``.

    python eval/bench/head_cost.py RUN [--heads none int8 int4] [--windows 40]
        [--seqlen 2048] [--data FILE] [--json OUT]

The pipeline's own evaluation (``compress.eval.perplexity.evaluate``, the first ``--windows``
windows of the eval text, KL and top-1 against the source named in the folder's manifest) of
the folder loaded as the pipeline loads it (``compress.io.checkpoint.load_run``), once per head
setting (``compress.layers.head.quantize_head``). A recipe run with ``quant.lm_head=int8`` reports
the same figures for its own folder; this script measures an existing folder without running
the recipe again. The table gives each setting's relative ppl change against the head as stored.
The source's log-probs are cached as the pipeline's ``eval.cache_logprobs`` does, so the source
runs once for all head settings.
"""

import argparse
import json
from pathlib import Path


def main(argv=None) -> None:
    import torch

    from compress.eval.perplexity import evaluate
    from compress.io.checkpoint import load_run, read_config
    from compress.io.data import eval_windows, read_text
    from compress.io.source import cache_dir, load_model
    from compress.layers.head import check_head, quantize_head
    from compress.recipe.config import eval_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run folder (with manifest.json)")
    p.add_argument("--heads", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--data", help="eval text (default: the manifest's data.eval.source)")
    p.add_argument("--source", help="source model (default: the manifest's source.path)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--no-logprob-cache",
        action="store_true",
        help="run the source on every head setting instead of caching its log-probs",
    )
    args = p.parse_args(argv)
    for kind in args.heads:
        check_head(kind, "--heads")
    manifest = json.loads((args.run / "manifest.json").read_text())
    recipe = manifest["recipe"]
    source, tok, info = load_model(args.source or manifest["source"]["path"], "float32")
    text = read_text(args.data or recipe["data"]["eval"]["source"], role="eval")
    windows = eval_windows(tok, text, args.seqlen, args.windows)
    device = eval_device("auto")
    source = source.to(device)
    _, qcfg = read_config(args.run)
    cache = None if args.no_logprob_cache or not info.sha256 else cache_dir() / "logprobs"
    rows = {}
    for kind in args.heads:
        model = load_run(args.run)[0]
        quantize_head(model, kind, qcfg)
        with torch.no_grad():
            rows[kind] = evaluate(
                model.to(device), windows, source, f"head {kind}", cache, info.sha256
            )
        del model
    base = rows.get("none", {}).get("ppl")
    src = next(iter(rows.values()))["source_ppl"]
    print(f"{args.run}: {len(windows)} windows of {args.seqlen} tokens, source ppl {src:.4f}")
    print("| head | ppl | vs none | KL vs source | top-1 vs source |")
    print("|---|---|---|---|---|")
    for kind, r in rows.items():
        rel = f"{r['ppl'] / base - 1:+.3%}" if base else "—"
        print(
            f"| {kind} | {r['ppl']:.4f} | {rel} | {r['kl_vs_source']:.5f} | "
            f"{r['top1_vs_source']:.4f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
