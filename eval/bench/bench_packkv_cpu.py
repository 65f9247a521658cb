"""Time one decode attend of PackKV (and KIVI-4) on the CPU: the C++ kernels against the
references (dequantize into scratch, then matmul) and against the fp16 cache.

One layer of the default model's shape (3 KV heads, 9 query heads, head_dim 64, batch 1), a
history of random K and V of ``--tokens`` compressed tokens behind the 128-token fp16 window,
one query token. Rows: the two products alone (``packkv_qk`` + ``packkv_pv``) and a whole
``cache.attend``; KIVI-4 and the fp16 cache attend over the same number of tokens. Median
milliseconds of ``--reps`` runs, the variants taking turns.

    python eval/bench/bench_packkv_cpu.py [--tokens 1408 7872] [--threads 2]
"""

import argparse
import os
import statistics
import time
from contextlib import contextmanager

import torch

from compress.decoder.kv import KVLayout, make_cache
from compress.kernels import native, packkv_cpu, packkv_ref

HKV, H, D, RESIDUAL = 3, 9, 64, 128


@contextmanager
def kernels(mode: str | None):
    """``COMPRESS_KERNELS=mode`` (None: unset) inside the block."""
    old = os.environ.pop("COMPRESS_KERNELS", None)
    if mode:
        os.environ["COMPRESS_KERNELS"] = mode
    try:
        yield
    finally:
        os.environ.pop("COMPRESS_KERNELS", None)
        if old is not None:
            os.environ["COMPRESS_KERNELS"] = old


def filled(kind: str, n: int, g: torch.Generator, **opts):
    """A one-layer cache of ``kind`` holding ``n`` random tokens (K and V ~ N(0, 1)), whose
    history is compressed as in decoding."""
    cache = make_cache(kind, KVLayout(1, HKV, D), 1, n + 1, **opts)
    k, v = torch.randn(2, 1, HKV, n, D, generator=g)
    cache.append(0, k[..., :-1, :], v[..., :-1, :])
    cache.append(0, k[..., -1:, :], v[..., -1:, :])  # the prefill's tokens leave the window now
    return cache


def run(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench(tokens: int, reps: int, g: torch.Generator) -> dict:
    """Median ms of each variant for a history of ``tokens`` compressed tokens."""
    pk = filled("packkv", tokens + RESIDUAL, g)
    fp = filled("fp16", tokens + RESIDUAL, g)
    kivi = filled("kivi", tokens + RESIDUAL, g, bits=4)
    n = pk.k[0].n
    q4 = torch.randn(1, H, 1, D, generator=g)
    q = q4.view(HKV, H // HKV, D)
    p = torch.rand(HKV, H // HKV, n, generator=g).softmax(-1)

    def products(ops):
        return lambda: ops.pv(p, pk.v[0]) + ops.qk(q, pk.k[0]).sum()

    def attend(cache, mode=None):
        def f():
            with kernels(mode):
                cache.attend(0, q4)

        return f

    variants = {
        "qk+pv reference": products(packkv_ref),
        "qk+pv kernel": products(packkv_cpu),
        "attend packkv reference": attend(pk, "ref"),
        "attend packkv kernel": attend(pk),
        "attend kivi-4 reference": attend(kivi, "ref"),
        "attend kivi-4 kernel": attend(kivi),
        "attend fp16": attend(fp),
    }
    return {"packed": n, **{name: run(f, reps) for name, f in variants.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1408, 7872],
        help="compressed tokens of the history (context minus the fp16 window)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if native.library() is None:
        raise SystemExit("the PackKV CPU kernel did not build (see the warning above)")
    g = torch.Generator().manual_seed(0)
    rows = [(t, bench(t, args.reps, g)) for t in args.tokens]
    names = [k for k in rows[0][1] if k != "packed"]
    print(
        f"PackKV CPU attention, one layer ({HKV} KV / {H} query heads, head_dim {D}), "
        f"{args.threads} threads, vector bits {native.simd()}; "
        f"median ms of {args.reps}"
    )
    print(f"{'variant':<26}" + "".join(f"{t:>10}" for t, _ in rows))
    for name in names:
        print(f"{name:<26}" + "".join(f"{r[name]:>10.3f}" for _, r in rows))
    for kind in ("packkv", "kivi-4"):
        ratio = [r["attend fp16"] / r[f"attend {kind} kernel"] for _, r in rows]
        print(f"{f'fp16 / {kind} kernel':<26}" + "".join(f"{x:>10.2f}" for x in ratio))


if __name__ == "__main__":
    main()
