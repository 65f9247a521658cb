"""Quality of compressed KV caches on real text: each cache's next-token distributions against
the fp16 cache's (KL, top-1 agreement) and its bytes per token, token by token (:func:`run`) or
in one forward per cache (:func:`run_parallel`, through :class:`HistoryMix`, which gives every
query the history a real cache would hold at its step). ``eval/bench/kv_quality.py`` prints the
table."""

import math
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from compress.decoder.kv import make_cache
from compress.decoder.kv.base import Cache, KVLayout, hidden, masked_softmax
from compress.errors import CompressError


def run(model, windows: torch.Tensor, cfgs, prefill: int) -> list[dict]:
    """Lock-step teacher forcing of every cache in ``cfgs`` over ``windows [B, T]``."""
    B, T = windows.shape
    caches = [make_cache(kind, model.kv_layout(), B, T, **opts) for _, kind, opts in cfgs]
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
    cache = make_cache(kind, KVLayout(1, 1, head_dim), 1, T, **opts)
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

    LATENT = True  # a latent key is mixed as its kind stores it (append)

    def __init__(self, kind: str, opts: dict, C: torch.Tensor, batch: int, layout: KVLayout):
        T = len(C)
        if layout.windowed:
            raise CompressError(
                "kv_quality's teacher-forced pass mixes a compressed history with a window of "
                "recent tokens for global-attention layers; this model has sliding-window "
                "layers, whose caches compress nothing (compress.decoder.kv.window)."
            )
        super().__init__(layout, batch, T, torch.float32, torch.device("cpu"))
        self.kind, self.opts = kind, {**opts, "keep_perm": True} if kind == "packkv" else opts
        # each layer's one-layer cache: a latent key's v_dim and the scale, no windows
        self.one = replace(layout, n_layers=1, windows=None)
        self.old = (
            torch.arange(T)[None, :] < C[:, None]
        )  # [Tq, Tk]: key in query t's compressed history
        self.kv, self.held = {}, 0

    def append(self, layer, k, v, pos=None):
        T = k.shape[2]
        cache = make_cache(self.kind, self.one, self.batch, T, **self.opts)
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
        C = history_lengths(kind, opts, T, prefill, model.spec.head_dim)
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
