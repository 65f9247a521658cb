"""Run folders evaluated against their source on the same WikiText-2 test windows, side by side:
ppl, KL(source || folder) and top-1 agreement (``compress.eval.perplexity``, as the recipes'
reports compute them), and the KV bytes per token the folder's report gives. What the source
adds to KL is kept in ``~/.cache/compress/logprobs`` (``eval.cache_logprobs``), so the source
runs once for many folders. For the attention-conversion table (docs/attention.md): the same 40
windows for folders whose runs evaluated fewer::

    python eval/bench/eval_folders.py RUN [RUN ...] [--windows 40] [--source smollm2-135m]
"""

import argparse
import json
import os
from pathlib import Path

import torch

from compress.eval.perplexity import evaluate
from compress.io.checkpoint import load_run
from compress.io.data import eval_windows, read_text
from compress.io.source import cache_dir, load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--source", default="smollm2-135m", help="model.path of the runs' source")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--data", default=os.environ.get("COMPRESS_DATA_DIR", "../shared/data"))
    args = ap.parse_args()
    source, tok, info = load_model(args.source)
    source.float()
    sha = info.sha256
    text = read_text(str(Path(args.data) / "wikitext-2" / "wiki.test.raw"), role="eval")
    windows = eval_windows(tok, text, args.seqlen, args.windows)
    rows = []
    for folder in args.folders:
        model = load_run(folder)[0].float()
        with torch.no_grad():
            f = evaluate(model, windows, source, cache=cache_dir() / "logprobs", source_sha=sha)
        made = folder / "report.json"
        report = json.loads(made.read_text()) if made.is_file() else {}
        rows.append((folder, report.get("kv_bytes_per_token"), f))
        del model
    print(f"{args.windows} windows of {args.seqlen}; source ppl {rows[0][2]['source_ppl']:.3f}")
    print("| folder | KV B/token | ppl | KL | top-1 |")
    print("|---|---|---|---|---|")
    for folder, kv, f in rows:
        kv = f"{kv:,}" if isinstance(kv, int) else "-"
        print(
            f"| {folder.name} | {kv} | {f['ppl']:.3f} | {f['kl_vs_source']:.4f} | {f['top1_vs_source']:.4f} |"
        )


if __name__ == "__main__":
    main()
