"""IAM attention mapping against the large model alone: quality, prefill time and KV bytes.

    (a) ppl, KL(large || IAM), top-1 agreement and KV bytes/token against the fraction of the large
        model's layers mapped (default 0, 25, 50, 75%: the first round(f L) layers of the mapping's
        ranking), on the first ``--windows`` WikiText-2 test windows of ``--seqlen`` tokens; a table
        and a plot (``--out``/iam_quality.png)
    (b) net prefill time, the small model's pass included, at ``--prompts`` tokens (default 512,
        2048, 8000) for ``--prefill-fractions`` against the large model alone, in one run (both
        prefill in chunks of ``--chunk`` tokens, the way IAM does)
    (c) net KV bytes at those prompts: the small model's fp16 K/V + the large model's (K/V of the
        unmapped layers, V of the mapped ones), against the large model's fp16 K/V

Everything runs the decoder's own forward (``compress.methods.iam.decode``) in float32, ``--threads``
torch threads (default 1). The mapping is read from ``--map`` (default: beside the large folder,
made there on first use).

    python eval/bench/bench_iam.py --small outputs/minitron_quarter --json iam.json
    python eval/bench/bench_iam.py --small outputs/minitron_quarter --quick   # smoke run
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.io.data import eval_windows, read_text, tokenize, wikitext_file
from compress.methods.iam.decode import load_iam


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[T - 1, V]`` log-probs of ``ids [T]`` through ``model`` over a fresh ``full`` cache."""
    cache = new_cache(model, "full", 1, ids.numel())
    return torch.log_softmax(model(ids[None], cache)[0, :-1].float(), -1)


def quality(large, models: dict, windows: torch.Tensor) -> dict:
    """Per label: ppl, KL(large || model) and top-1 agreement (``eval/perplexity``'s formulas)."""
    sums = {k: [0.0, 0.0, 0] for k in models}
    count = 0
    for w in tqdm(windows, desc="iam quality", unit="window"):
        lp, target = log_probs(large, w), w[1:, None]
        for label, m in models.items():
            lq = log_probs(m, w)
            s = sums[label]
            s[0] += -lq.gather(1, target).sum().item()
            s[1] += (lp.exp() * (lp - lq)).sum().item()
            s[2] += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        count += target.numel()
    return {
        k: {"ppl": math.exp(s[0] / count), "kl": s[1] / count, "top1": s[2] / count}
        for k, s in sums.items()
    }


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int) -> tuple[float, int]:
    """Seconds to prefill ``ids [T]`` in chunks of ``chunk`` (fp16 cache), and the cache's bytes."""
    cache = new_cache(model, "fp16", 1, ids.numel() + 1)
    t = time.perf_counter()
    for s in range(0, ids.numel(), chunk):
        model(ids[None, s : s + chunk], cache, last=True)
    return time.perf_counter() - t, cache.nbytes()


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [100 * r["fraction"] for r in rows]
    ax[0].plot(x, [r["ppl"] for r in rows], "o-")
    ax[0].set_xlabel("large layers mapped (%)")
    ax[0].set_ylabel("perplexity")
    ax2 = ax[0].twinx()
    ax2.plot(x, [r["kl"] for r in rows], "s--", color="C1")
    ax2.set_ylabel("KL vs large", color="C1")
    ax[1].plot(x, [r["kv_bytes_per_token"] for r in rows], "o-", color="C2")
    ax[1].axhline(rows[0]["large_kv_bytes_per_token"], color="gray", ls="--", label="large alone")
    ax[1].set_xlabel("large layers mapped (%)")
    ax[1].set_ylabel("KV bytes/token (both models)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--large", help="large model folder (default: the default model)")
    ap.add_argument("--small", required=True, help="small model folder, same tokenizer")
    ap.add_argument("--map", help="mapping file (default: beside the large folder)")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0, 0.25, 0.5, 0.75])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--prompts", type=int, nargs="*", default=[512, 2048, 8000])
    ap.add_argument("--prefill-fractions", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (both models)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="outputs/bench_iam", help="folder for the plot")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 window of 256, prompts 256")
    args = ap.parse_args(argv)
    if args.quick:
        args.windows, args.seqlen, args.prompts = 1, 256, [256]
    torch.set_num_threads(args.threads)
    try:
        run(args)
    except CompressError as e:
        raise SystemExit(f"error: {e}")


def run(args) -> None:
    from compress.io.source import resolve_path

    large_dir = Path(args.large) if args.large else Path(resolve_path("smollm2-135m")[0])
    large, tok = load(large_dir)
    L = large.config.num_hidden_layers
    pairs = {}
    for f in sorted(set(args.fractions) | set(args.prefill_fractions)):
        n = round(f * L)
        pairs[f] = load_iam(large_dir, args.small, n, args.map, chunk=args.chunk, log=print)[0]
        pairs[f].fraction, pairs[f].n = f, n
    text = read_text(str(wikitext_file("wiki.test.raw")), role="eval")
    windows = eval_windows(tok, text, args.seqlen, args.windows)

    # (a) quality and KV bytes against the fraction mapped
    q = quality(large, {f: pairs[f] for f in args.fractions}, windows)
    probe = windows[0][:512]
    large_kv = prefill(large, probe, args.chunk)[1] / probe.numel()
    rows = []
    for f in args.fractions:
        kv = prefill(pairs[f], probe, args.chunk)[1] / probe.numel()
        rows.append({"fraction": f, "layers": pairs[f].n, **q[f], "kv_bytes_per_token": kv,
                     "large_kv_bytes_per_token": large_kv})  # fmt: skip
    print(f"\n(a) {args.windows} windows of {args.seqlen} tokens, KL against the large model alone")
    print("| mapped | layers | ppl | KL | top-1 | KV bytes/token | vs large |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {100 * r['fraction']:.0f}% | {r['layers']} | {r['ppl']:.3f} | {r['kl']:.4f} | "
              f"{r['top1']:.3f} | {r['kv_bytes_per_token']:.0f} | "
              f"{r['kv_bytes_per_token'] / large_kv - 1:+.1%} |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (p := plot(rows, out / "iam_quality.png")) is not None:
        print(f"plot: {p}")

    # (b), (c): prefill time and KV bytes at each prompt length, one run
    ids = tokenize(tok, text)
    speed = []
    print(
        f"\n(b, c) prefill in chunks of {args.chunk}, {torch.get_num_threads()} thread(s), fp16 KV"
    )
    print("| prompt | model | prefill s | vs large | KV bytes | vs large |")
    print("|---|---|---|---|---|---|")
    for T in args.prompts:
        if T > ids.numel() or T > large.config.max_position_embeddings:
            print(f"| {T} | skipped: longer than the text or the model's positions | | | | |")
            continue
        prompt = ids[:T]
        prefill(large, prompt[: min(T, 64)], args.chunk)  # warm-up
        base_s, base_b = prefill(large, prompt, args.chunk)
        print(f"| {T} | large alone | {base_s:.2f} | | {base_b:,} | |")
        speed.append({"prompt": T, "fraction": None, "seconds": base_s, "kv_bytes": base_b})
        for f in args.prefill_fractions:
            prefill(pairs[f], prompt[: min(T, 64)], args.chunk)  # warm-up
            s, b = prefill(pairs[f], prompt, args.chunk)
            print(f"| {T} | IAM {100 * f:.0f}% ({pairs[f].n} layers) | {s:.2f} | "
                  f"{s / base_s - 1:+.1%} | {b:,} | {b / base_b - 1:+.1%} |")  # fmt: skip
            speed.append({"prompt": T, "fraction": f, "seconds": s, "kv_bytes": b})
    if args.json:
        Path(args.json).write_text(json.dumps({"quality": rows, "prefill": speed}, indent=1))
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
