"""KV-cache quality: KL and perplexity of compressed caches against the fp16 cache, per byte stored.

Teacher-forced decoding on WikiText-2 test windows of ``--tokens`` tokens (batched, one row a
window): prefill the first ``--prefill`` tokens, then feed the true tokens one at a time, every
cache in lock step, so each decoded position t has next-token distributions from every cache::

    KL  = mean_t sum_v p_fp16,t(v) (log p_fp16,t(v) - log p_cache,t(v))
    ppl = exp(mean_t -log p_cache,t(x_{t+1}))            over the decoded part
    bytes/token = cache.nbytes() / (windows * tokens)     at the end, after the last token is fed

PackKV's fp16 window always holds --residual tokens; KIVI's holds up to 31 more, waiting for a
K group to fill ((--tokens - --residual) a multiple of 32 puts it at exactly --residual at the end).

``--parallel`` gives the same figures from one forward pass per cache instead of one per token:
a compressed token's K/V never change once written (per-token codes; KIVI quantizes a K group
once, whole), so decoding position t over the history compressed by then equals one causal pass
in which query t reads the cache's own dequantized K/V at keys older than ``C(t)`` and the exact
fp16 ones after. ``C(t)`` is read off the cache kind itself, fed one token at a time; the
compressed K/V come from a cache of that kind holding the whole window. It is about 8x faster,
for sweeps, and equal up to rounding: projecting one token or a whole window rounds differently,
so a few codes flip (SmolLM2, 1,536 tokens: KL within 2% of the token-by-token figure).

Both run the decoder's own model forward (``compress.decoder.model``): token by token through
the caches themselves, ``--parallel`` through :class:`HistoryMix`, a cache-shaped view that
gives each query its history. Prints a table, writes ``kv_quality.json`` and a plot of KL
against bytes/token to ``--out``.

    python eval/bench/kv_quality.py                       # defaults, about 10 minutes on 2 cores
    python eval/bench/kv_quality.py --parallel --windows 4 --tokens 1536 --packkv 0.04:0.1 0.03:0.08
    python eval/bench/kv_quality.py --tokens 1536 --packkv 0.1:0.2 0.05:0.1 0.03:0.1 0.025:0.1 0.025:0.05
    python eval/bench/kv_quality.py --parallel --tokens 1536 --models outputs/gqa outputs/cla outputs/mla

``--models`` puts other models with the same tokenizer (attention conversions) on the same plot:
each decoded teacher-forced with its own fp16 cache, KL against the source's fp16-cache decoding.
"""

import argparse
import json
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.eval.kv_quality import run, run_parallel
from compress.io.data import read_text, tokenize, wikitext_file


def configs(args) -> list[tuple[str, str, dict]]:
    """``(label, kind, options)``; the fp16 cache first (the reference)."""
    out = [("fp16", "fp16", {})]
    out += [(f"kivi-{b}", "kivi", {"bits": b, "residual": args.residual}) for b in args.kivi]
    for kr, vr in args.packkv:
        out.append(
            (
                f"packkv-{kr:g}:{vr:g}",
                "packkv",
                {
                    "k_rel": kr,
                    "v_rel": vr,
                    "order": args.order,
                    "residual": args.residual,
                    "keep_perm": False,
                },
            )
        )
    return out


@torch.no_grad()
def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("kivi", "s"), ("packkv", "o")):
        pts = sorted((r["bytes_per_token"], r["kl"], r["label"]) for r in rows if r["kind"] == kind)
        if pts:  # every setting a marker; the line joins those no other beats on both bytes and KL
            front = [p for i, p in enumerate(pts) if all(q[1] > p[1] for q in pts[:i])]
            line = ax.plot([p[0] for p in front], [p[1] for p in front], marker=marker, label=kind)[
                0
            ]
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], marker, color=line.get_color(), mfc="none"
            )
            for x, y, label in pts:
                ax.annotate(label.split("-", 1)[1], (x, y), fontsize=6)
    for r in rows:  # other models (attention conversions), each with its fp16 cache
        if r["kind"] == "model":
            ax.plot(r["bytes_per_token"], r["kl"], "^", color="black")
            ax.annotate(r["label"], (r["bytes_per_token"], r["kl"]), fontsize=6)
    fp16 = next(r["bytes_per_token"] for r in rows if r["kind"] == "fp16")
    ax.axvline(fp16, color="gray", ls="--", label="fp16 cache")
    ax.set_xlabel("KV bytes per token (all layers, metadata and fp16 window included)")
    ax.set_ylabel("KL(fp16 cache || cache), nats/token")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows) -> str:
    lines = [
        "| cache | bytes/token | vs fp16 | KL vs fp16 | ppl | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['bytes_per_token']:.0f} | {r['ratio_vs_fp16']:.3f} | "
            f"{r['kl']:.2e} | {r['ppl']:.3f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def ratios(rows) -> list[str]:
    """PackKV's bytes/token against fp16's; the smallest PackKV at KL <= KIVI-4's against KIVI-4."""
    pk = [r for r in rows if r["kind"] == "packkv"]
    kivi4 = next((r for r in rows if r["label"] == "kivi-4"), None)
    lines = [
        "PackKV bytes/token / fp16's: "
        + ", ".join(f"{r['label']} {r['ratio_vs_fp16']:.3f}" for r in pk)
    ]
    if kivi4 and pk:
        ok = [r for r in pk if r["kl"] <= kivi4["kl"]]
        if ok:
            best = min(ok, key=lambda r: r["bytes_per_token"])
            lines.append(
                f"at KL <= kivi-4's {kivi4['kl']:.2e}: {best['label']} (KL {best['kl']:.2e}) stores "
                f"{best['bytes_per_token']:.0f} B/token, kivi-4 {kivi4['bytes_per_token']:.0f}: kivi-4 / "
                f"packkv = {kivi4['bytes_per_token'] / best['bytes_per_token']:.2f}"
            )
        else:
            lines.append(f"no PackKV setting reached kivi-4's KL {kivi4['kl']:.2e}")
    return lines


def rel_pair(s: str) -> tuple[float, float]:
    k, _, v = s.partition(":")
    return float(k), float(v or k)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--windows", type=int, default=1, help="WikiText-2 test windows, decoded as one batch"
    )
    ap.add_argument(
        "--tokens", type=int, default=1024, help="tokens per window (prefill + decoded)"
    )
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument(
        "--residual", type=int, default=128, help="fp16 window of the compressed caches"
    )
    ap.add_argument("--kivi", type=int, nargs="*", default=[2, 4], help="KIVI bit widths")
    ap.add_argument(
        "--packkv",
        type=rel_pair,
        nargs="*",
        default=[(0.1, 0.2), (0.05, 0.1), (0.03, 0.1)],
        help="PackKV k_rel:v_rel pairs",
    )
    ap.add_argument("--order", default="greedy", choices=["greedy", "median", "none"])
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="one forward per cache instead of one per token: the same figures up to rounding, ~8x faster",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)"
    )
    ap.add_argument("--data", help="text (default: $COMPRESS_DATA_DIR/wikitext-2/wiki.test.raw)")
    ap.add_argument(
        "--model", default=None, help="a run folder or HF folder (default: the default model)"
    )
    ap.add_argument(
        "--models",
        nargs="*",
        default=[],
        help="other folders with the same tokenizer (e.g. attention conversions of --model), "
        "each decoded with its own fp16 cache; KL against --model's fp16 cache (--parallel)",
    )
    ap.add_argument("--out", default="outputs/kv_quality")
    args = ap.parse_args(argv)

    from compress.decoder.model import load
    from compress.io.source import convert_default_model

    data = args.data or str(wikitext_file("wiki.test.raw"))  # checked before the model loads
    torch.set_num_threads(args.threads)
    if args.models and not args.parallel:
        raise CompressError("--models compares other models through --parallel; add --parallel.")
    model, tok = load(args.model or convert_default_model())
    others = [(Path(m).name, "fp16", {}, load(m)[0]) for m in args.models]
    for label, *_, m in others:
        if m.config.vocab_size != model.config.vocab_size:
            raise CompressError(
                f"--models {label}: vocabulary of {m.config.vocab_size} tokens, "
                f"--model has {model.config.vocab_size}; give folders with the same tokenizer."
            )
    ids = tokenize(tok, read_text(data))
    windows = ids[: args.windows * args.tokens].view(args.windows, args.tokens)
    rows = (run_parallel if args.parallel else run)(
        model, windows, configs(args) + others, args.prefill
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_quality.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "ratios": ratios(rows)}, indent=1)
    )
    plot(rows, out / "kv_quality.png")
    print(
        f"{args.windows} windows x {args.tokens} tokens, prefill {args.prefill}, residual {args.residual}, "
        f"order {args.order}{', parallel' if args.parallel else ''}"
    )
    print(table(rows))
    print("\n".join(ratios(rows)))
    print(f"wrote {out / 'kv_quality.json'} and {out / 'kv_quality.png'}")


if __name__ == "__main__":
    try:
        main()
    except CompressError as e:
        raise SystemExit(f"error: {e}") from None
