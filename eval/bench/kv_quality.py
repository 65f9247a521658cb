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
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from compress.decoder.kv import make_cache
from compress.decoder.kv.base import Cache, hidden, masked_softmax
from compress.errors import CompressError
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
def run(model, windows: torch.Tensor, cfgs, prefill: int) -> list[dict]:
    """Lock-step teacher forcing of every cache in ``cfgs`` over ``windows [B, T]``."""
    c = model.config
    B, T = windows.shape
    caches = [
        make_cache(kind, c.num_hidden_layers, B, c.num_key_value_heads, model.head_dim, T, **opts)
        for _, kind, opts in cfgs
    ]
    kl, nll, secs = [0.0] * len(cfgs), [0.0] * len(cfgs), [0.0] * len(cfgs)
    for t in tqdm(range(prefill, T + 1), desc="kv_quality", unit="tok", mininterval=10):
        ids = windows[:, :t] if t == prefill else windows[:, t - 1 : t]
        ref = None
        for i, cache in enumerate(caches):
            t0 = time.perf_counter()
            logits = model(ids, cache, last=True)[:, -1].float()
            secs[i] += time.perf_counter() - t0
            if t == T:
                continue  # the last token only fills the caches: bytes are read at context T
            logp = torch.log_softmax(logits, -1)
            ref = logp if ref is None else ref
            kl[i] += (ref.exp() * (ref - logp)).sum().item()
            nll[i] -= logp.gather(1, windows[:, t, None]).sum().item()
    n = B * (T - prefill)
    fp16_bytes = caches[0].nbytes() / (B * caches[0].length)
    rows = []
    for (label, kind, opts), cache, k, l, s in zip(cfgs, caches, kl, nll, secs):
        bpt = cache.nbytes() / (B * cache.length)
        rows.append(
            {
                "label": label,
                "kind": kind,
                "opts": opts,
                "bytes_per_token": bpt,
                "ratio_vs_fp16": bpt / fp16_bytes,
                "kl": k / n,
                "ppl": math.exp(l / n),
                "seconds": s,
                "context": cache.length,
            }
        )
    return rows


def history_lengths(kind: str, opts: dict, T: int, prefill: int, head_dim: int) -> torch.Tensor:
    """``C [T]``: positions the cache has compressed once position t is appended (prefill, then one
    token at a time), read off a one-head cache of ``kind`` fed random K/V."""
    C = torch.zeros(T, dtype=torch.long)
    if kind == "fp16":
        return C
    cache = make_cache(kind, 1, 1, 1, head_dim, T, **opts)
    x = torch.randn(1, 1, T, head_dim, generator=torch.Generator().manual_seed(0))
    cache.append(0, x[:, :, :prefill], x[:, :, :prefill])
    for t in range(prefill, T):
        cache.append(0, x[:, :, t : t + 1], x[:, :, t : t + 1])
        C[t] = cache.ncomp[0]
    return C


class HistoryMix(Cache):
    """One causal pass that decodes as a cache of ``kind`` would, token by token (module docstring).

    ``append`` feeds each layer's K/V into a real one-layer cache of that kind, which then holds
    what decoding leaves at the end; ``attend`` lets query t read that cache's dequantized K/V at
    keys older than ``C[t]`` and the fp16 window's values after.
    """

    def __init__(self, kind: str, opts: dict, C: torch.Tensor, batch: int, layout: dict):
        T = len(C)
        layout = dict(layout)
        shape = [layout.pop(k) for k in ("n_layers", "n_kv_heads", "head_dim")]
        if any(w is not None for w in layout.pop("windows", None) or ()):
            raise CompressError(
                "kv_quality's teacher-forced pass mixes a compressed history with a window of "
                "recent tokens for global-attention layers; this model has sliding-window "
                "layers, whose caches compress nothing (compress.decoder.kv.window)."
            )
        super().__init__(
            shape[0], batch, shape[1], shape[2], T, torch.float32, torch.device("cpu"), **layout
        )
        self.kind, self.opts = kind, {**opts, "keep_perm": True} if kind == "packkv" else opts
        self.extra = {
            k: v for k, v in layout.items() if v is not None
        }  # a latent key's v_dim, scale
        self.old = (
            torch.arange(T)[None, :] < C[:, None]
        )  # [Tq, Tk]: key in query t's compressed history
        self.kv, self.held = {}, 0

    def append(self, layer, k, v, pos=None):
        T = k.shape[2]
        cache = make_cache(
            self.kind, 1, self.batch, self.n_kv_heads, self.head_dim, T, **self.extra, **self.opts
        )
        cache.append(0, k[:, :, : T - 1], None if v is None else v[:, :, : T - 1])
        cache.append(
            0, k[:, :, T - 1 :], None if v is None else v[:, :, T - 1 :]
        )  # what decoding leaves
        self.held += cache.nbytes() - (
            cache.perm[0, :, : cache.k[0].n].nbytes if self.kind == "packkv" else 0
        )
        hist = cache.history(0) if self.kind != "fp16" else None
        k16 = k.half().float()  # the fp16 window's values
        self.kv[layer] = (k16, k16[..., : self.v_dim] if v is None else v.half().float(), hist)
        self.lens[layer] = T

    def attend(self, layer, q, pos=None, start=None):
        q4, tq = self.queries(q)
        k16, v16, hist = self.kv[layer]  # cross-layer attention reads a slot more than once
        g = q4.shape[2] // tq
        old = self.old.repeat(g, 1)  # [g*Tq, Tk], queries laid out as q4's
        s = q4 @ k16.transpose(-1, -2)
        if hist is not None:
            kh, vh = hist
            n = kh.shape[2]
            s[..., :n] = torch.where(old[:, :n], q4 @ kh.transpose(-1, -2), s[..., :n])
        kpos = torch.arange(tq)[None, None]
        p = masked_softmax(s, hidden(kpos, torch.arange(tq), None), tq)
        out = (p * ~old) @ v16
        if hist is not None:
            out = out + (p[..., :n] * old[:, :n]) @ vh
        return self.heads(out, q)


def run_parallel(model, windows: torch.Tensor, cfgs, prefill: int) -> list[dict]:
    """The figures of :func:`run`, from one forward per cache."""
    B, T = windows.shape
    target = windows[:, prefill:, None]
    rows, ref = [], None
    for label, kind, opts, *other in tqdm(cfgs, desc="kv_quality --parallel", unit="cache"):
        t0 = time.perf_counter()
        m = (
            other[0] if other else model
        )  # another model (an attention conversion) with its fp16 cache
        C = history_lengths(kind, opts, T, prefill, model.head_dim)
        mix = HistoryMix(kind, opts, C, B, m.kv_layout())
        with torch.no_grad():
            logits = m(windows, mix)[:, prefill - 1 : T - 1]
        logp, held = torch.log_softmax(logits.float(), -1), mix.held
        ref = logp if ref is None else ref
        n = B * (T - prefill)
        rows.append(
            {
                "label": label,
                "kind": kind if not other else "model",
                "opts": opts,
                "bytes_per_token": held / (B * T),
                "kl": (ref.exp() * (ref - logp)).sum().item() / n,
                "ppl": math.exp(-logp.gather(-1, target).sum().item() / n),
                "seconds": time.perf_counter() - t0,
                "context": T,
            }
        )
    for r in rows:
        r["ratio_vs_fp16"] = r["bytes_per_token"] / rows[0]["bytes_per_token"]
    return rows


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


def bars(rows) -> list[str]:
    """The two bars: PackKV bytes/token <= 1/3 of fp16's; at KL <= KIVI-4's, <= 1/1.3 of KIVI-4's bytes."""
    pk = [r for r in rows if r["kind"] == "packkv"]
    kivi4 = next((r for r in rows if r["label"] == "kivi-4"), None)
    lines = [
        "PackKV bytes/token / fp16's (bar <= 0.333): "
        + ", ".join(f"{r['label']} {r['ratio_vs_fp16']:.3f}" for r in pk)
    ]
    if kivi4 and pk:
        ok = [r for r in pk if r["kl"] <= kivi4["kl"]]
        if ok:
            best = min(ok, key=lambda r: r["bytes_per_token"])
            lines.append(
                f"at KL <= kivi-4's {kivi4['kl']:.2e}: {best['label']} (KL {best['kl']:.2e}) stores "
                f"{best['bytes_per_token']:.0f} B/token, kivi-4 {kivi4['bytes_per_token']:.0f}: kivi-4 / "
                f"packkv = {kivi4['bytes_per_token'] / best['bytes_per_token']:.2f} (bar >= 1.3)"
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
        json.dumps({"args": vars(args), "rows": rows, "bars": bars(rows)}, indent=1)
    )
    plot(rows, out / "kv_quality.png")
    print(
        f"{args.windows} windows x {args.tokens} tokens, prefill {args.prefill}, residual {args.residual}, "
        f"order {args.order}{', parallel' if args.parallel else ''}"
    )
    print(table(rows))
    print("\n".join(bars(rows)))
    print(f"wrote {out / 'kv_quality.json'} and {out / 'kv_quality.png'}")


if __name__ == "__main__":
    try:
        main()
    except CompressError as e:
        raise SystemExit(f"error: {e}") from None
