"""Serving throughput and latency of the continuous-batching engine; KV-Runahead's TTFT.

    python eval/bench/bench_serve.py --folder fp32=RUN --folder bf16=RUN:bfloat16 \\
        --folder awq_int4=outputs/awq_int4 [--batch 1 2 4 8 16 32] [--requests 32] [--json OUT]
    python eval/bench/bench_serve.py --folder fp32=RUN --ttft 2048 8000 --ranks 1 2
    python eval/bench/bench_serve.py --folder tiny=FOLDER --quick    # a check that it runs
    python eval/bench/bench_serve.py --folder int4=outputs/awq_int4:bfloat16 \
        --folder w4a8=outputs/awq_int4:bfloat16:w4a8 --folder inv=outputs/awq_int4:bfloat16:invariant

A folder's third field picks how its quantized layers compute: ``w4a8`` (the W4A8 kernel,
``--kernel w4a8``) or ``invariant`` (batch-invariant serving: W4A8 at every M, lean, int8 head,
fixed-order attention; ``python -m compress.serve --batch-invariant``).

Throughput: for each folder and each batch size B, the same ``--requests`` seeded requests
(prompts of 16-256 tokens of WikiText-2, or seeded random ids without the data; 64-128 new
tokens, EOS ignored) all arrive at once and the engine (``compress.serve.engine``, in this
process, no HTTP) runs at most B of them at a time:

    output tok/s = new tokens of all requests / wall time from the first arrival to the last token
    latency      = each request's time to its last token; TTFT to its first (p50, p90, p99)

B = 1 serves them one at a time, so ``speed-up`` = tok/s at B / tok/s at 1 of the same run.

TTFT (``--ttft``): a prompt of each length prefilled in one process (in forwards of ``--chunk``
tokens, default 1024, which keeps the attention scores small; 0: one forward), and with ``--ranks``
N > 1 by KV-Runahead (``compress.serve.runahead``) over N processes with balanced and with even
chunks; ``--threads`` (default 1) threads in every process, so N ranks use N times the cores.
Medians of ``--rounds`` after one warm-up. Wall-clock figures on a shared machine are noisy.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from compress.errors import CompressError

KERNELS = {}  # label -> "w4a8" or "invariant" (the folder's third field)


def parse_folder(spec: str) -> tuple[str, str, str]:
    """``LABEL=PATH[:DTYPE[:KERNEL]]`` -> (label, path, dtype name); KERNEL (w4a8, invariant) is
    kept in ``KERNELS``."""
    label, sep, rest = spec.partition("=")
    if not sep:
        raise CompressError(f"--folder takes LABEL=PATH[:DTYPE[:KERNEL]], got '{spec}'.")
    path, _, dtype = rest.partition(":")
    dtype, _, kernel = dtype.partition(":")
    if kernel and kernel not in ("w4a8", "invariant"):
        raise CompressError(f"--folder '{spec}': the kernel is w4a8 or invariant.")
    if kernel:
        KERNELS[label] = kernel
    if dtype and dtype not in ("float32", "bfloat16", "float16"):
        raise CompressError(f"--folder '{spec}': the dtype is float32, bfloat16 or float16.")
    if not Path(path).exists():
        raise CompressError(f"--folder '{spec}': '{path}' does not exist.")
    return label, path, dtype or "float32"


def corpus_ids(tok, vocab: int, n: int, seed: int) -> list[int]:
    """``n`` token ids of WikiText-2's test split (``$COMPRESS_DATA_DIR``), or seeded random ids."""
    import os

    f = Path(os.environ.get("COMPRESS_DATA_DIR", "")) / "wikitext-2" / "wiki.test.raw"
    if tok is not None and f.is_file():
        ids = tok(f.read_text(encoding="utf-8")[: n * 8]).input_ids
        if len(ids) >= n:
            return ids[:n]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def requests(tok, vocab: int, n: int, prompt_lens, new_lens, seed: int):
    """``n`` (prompt ids, new tokens) pairs, seeded; prompts are windows of the corpus."""
    rng = random.Random(seed)
    text = corpus_ids(tok, vocab, prompt_lens[1] * 4 + 1, seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_lens)
        at = rng.randint(0, len(text) - length)
        out.append((text[at : at + length], rng.randint(*new_lens)))
    return out


def percentiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def serve_once(model, tok, reqs, batch: int, block_size: int, invariant: bool = False) -> dict:
    from compress.serve.engine import Engine
    from compress.serve.scheduler import Params

    need = sum(-(-(len(p) + n) // block_size) for p, n in reqs)
    engine = Engine(
        model, tok, num_blocks=need, block_size=block_size, max_seqs=batch,
        batch_invariant=invariant,
    )  # fmt: skip
    t0 = time.perf_counter()
    seqs = [engine.add(p, Params(max_tokens=n, ignore_eos=True)) for p, n in reqs]
    first, last = {}, {}
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None:
                now = time.perf_counter()
                first.setdefault(ev.seq.id, now)
                last[ev.seq.id] = now
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output) for s in seqs)
    return {
        "batch": batch,
        "requests": len(reqs),
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "latency_s": percentiles([last[s.id] - t0 for s in seqs]),
        "ttft_s": percentiles([first[s.id] - t0 for s in seqs]),
        "preemptions": engine.stats()["preemptions"],
    }


def throughput(label, path, dtype, args) -> list[dict]:
    from compress.decoder.model import load

    kernel = KERNELS.get(label)
    invariant = kernel == "invariant"
    kw = dict(kernel="w4a8") if kernel else {}
    if invariant:
        from compress.decoder.runtime import fast_head

        kw.update(lean=True, head=fast_head(path))
    model, tok = load(path, dtype=getattr(torch, dtype), **kw)
    if invariant:
        from compress.kernels.w4a8_cpu import use

        use(model, "w4a8", every_m=True)
    reqs = requests(
        tok, model.config.vocab_size, args.requests, args.prompt_lens, args.new_lens, args.seed
    )
    serve_once(model, tok, reqs[:2], 2, args.block_size, invariant)  # warm-up
    rows = []
    for b in args.batch:
        r = serve_once(model, tok, reqs, b, args.block_size, invariant)
        r.update(label=label, dtype=dtype, kernel=kernel or "exact")
        rows.append(r)
        base = rows[0]["tok_s"] if rows[0]["batch"] == 1 else float("nan")
        print(
            f"{label:>10} B={b:>2}  {r['tok_s']:8.1f} tok/s  x{r['tok_s'] / base:5.2f}  "
            f"latency p50 "
            f"{r['latency_s']['p50']:.2f} s p99 {r['latency_s']['p99']:.2f} s  TTFT p50 "
            f"{r['ttft_s']['p50']:.2f} s  preemptions {r['preemptions']}",
            flush=True,
        )
    return rows


def ttft(label, path, dtype, args) -> list[dict]:
    from compress.decoder.kv import new_cache
    from compress.decoder.model import load
    from compress.serve.runahead import RunaheadPrefill

    torch.set_num_threads(args.threads)
    model, tok = load(path, dtype=getattr(torch, dtype))
    rows = []

    def timed(fn) -> float:
        times = []
        for _ in range(args.rounds + 1):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    for T in args.ttft:
        ids = corpus_ids(tok, model.config.vocab_size, T, args.seed)
        step = args.chunk or T

        def single():
            cache = new_cache(model, "full", 1, T)
            with torch.no_grad():
                for c in range(0, T, step):
                    model(torch.tensor([ids[c : c + step]]), cache, last=True)

        one = timed(single)
        how = f"chunks of {step}" if step < T else "one forward"
        rows.append(
            {"label": label, "tokens": T, "ranks": 1, "chunk": step, "balance": None, "ttft_s": one}
        )
        print(f"{label:>10} T={T:>5} 1 rank ({how})  {one:7.2f} s", flush=True)
        for n in (r for r in args.ranks if r > 1):
            for balance in ("cost", "even"):
                pool = RunaheadPrefill(model, path, n, dtype, threads=args.threads, balance=balance)
                try:
                    s = timed(lambda: pool.prefill(ids))
                finally:
                    pool.close()
                rows.append(
                    {
                        "label": label,
                        "tokens": T,
                        "ranks": n,
                        "balance": balance,
                        "ttft_s": s,
                        "speedup": one / s,
                    }
                )
                print(
                    f"{label:>10} T={T:>5} {n} ranks {balance:>4}  {s:7.2f} s  x{one / s:4.2f}",
                    flush=True,
                )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", action="append", required=True, metavar="LABEL=PATH[:DTYPE]")
    p.add_argument(
        "--batch",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8, 16, 32],
        help="batch sizes for throughput (none: only the --ttft runs)",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[16, 256])
    p.add_argument("--new-lens", type=int, nargs=2, default=[64, 128])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--ttft", type=int, nargs="*", default=[], help="prompt lengths for time to first token"
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--chunk",
        type=int,
        default=1024,
        help="the 1-rank prefill runs in forwards of this many tokens (0: one forward)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per process for the TTFT runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="tiny settings: checks that the script runs"
    )
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.requests, args.prompt_lens, args.new_lens = [1, 4], 4, [8, 24], [4, 8]
        args.ttft, args.ranks, args.rounds, args.chunk = args.ttft or [64], [1, 2], 1, 16
    try:
        folders = [parse_folder(s) for s in args.folder]
        rows = {"throughput": [], "ttft": []}
        for label, path, dtype in folders:
            if args.batch:
                rows["throughput"] += throughput(label, path, dtype, args)
            if args.ttft:
                rows["ttft"] += ttft(label, path, dtype, args)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
