"""CPU timing of LLM.int8 linears: ours (``Int8Linear``), bitsandbytes' ``Linear8bitLt``, fp32 and bf16.

    python eval/bench/bench_int8.py [--threads N] [--reps 15] [--m 1 16 512] [--threshold 6.0]

For each layer shape (the default model's 576x576, 576x1536, 1536x576 and the
7B-sized 4096x4096, 4096x11008, written in x out) and each M (tokens per call),
all four layers are built from the same fp32 weights and fed the same fp32
activations, which carry two planted outlier dims (|x| ~ 20) so that both int8
layers take their decomposition path. Each repetition times every layer once,
in a rotating order (A/B alternation), over enough calls to last ~``--sample-ms``
(short samples keep the median clear of the scheduler's preemptions on a shared
machine); the table gives the medians in ms per call, the ratios to ours (> 1: ours faster),
and each int8 layer's relative error against fp32.

``--clock cpu`` (the default with ``--threads 1``) times the calling thread's CPU
time (``time.thread_time``): with one thread all the work runs on it, and time
spent preempted by other processes on a shared machine is not counted.
``--clock wall`` (the default otherwise) times wall-clock.

bitsandbytes runs in eval mode (its int8 path; in training mode it dequantizes
the weight and runs an fp matmul instead), with its per-call "cast to float16"
warning silenced.
"""

import argparse
import logging
import os
import statistics
import time

import torch

SHAPES = [(576, 576), (576, 1536), (1536, 576), (4096, 4096), (4096, 11008)]  # (in, out)


def layers(k: int, n: int, threshold: float) -> dict:
    """The four contenders, from one random fp32 weight ``[n, k]``."""
    import bitsandbytes as bnb

    from compress.layers import Int8Linear

    fp32 = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.normal_(fp32.weight, std=k**-0.5)
    ours = Int8Linear.from_linear(fp32, threshold)
    theirs = (
        bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=threshold)
        .to("cpu")
        .eval()
    )
    theirs.load_state_dict(ours.state_dict())
    bf16 = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    bf16.weight.data.copy_(fp32.weight)
    return {"ours": ours, "bnb": theirs, "fp32": fp32, "bf16": bf16}


def activations(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k)
    x[:, [7, k // 3]] *= 20.0  # LLM.int8-style outlier dims
    return x


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def per_call(fn, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


@torch.no_grad()
def bench(k: int, n: int, m: int, reps: int, threshold: float, sample_s: float, clock) -> dict:
    mods, x = layers(k, n, threshold), activations(m, k)
    inputs = {name: x.to(torch.bfloat16) if name == "bf16" else x for name in mods}
    fns = {name: (lambda mod=mod, xi=inputs[name]: mod(xi)) for name, mod in mods.items()}
    exact = fns["fp32"]()
    err = {
        name: ((fns[name]().float() - exact).norm() / exact.norm()).item()
        for name in ("ours", "bnb")
    }
    calls = {
        name: max(1, int(sample_s / per_call(fn, 1, clock))) for name, fn in fns.items()
    }  # warm-up, sizing
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(per_call(fns[name], calls[name], clock))
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {**out, "err_ours": err["ours"], "err_bnb": err["bnb"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sample-ms", type=float, default=1.0, help="length of one timed sample")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--threshold", type=float, default=6.0)
    p.add_argument(
        "--clock", choices=sorted(CLOCKS), help="default: cpu with --threads 1, else wall"
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{k}x{n}" for k, n in SHAPES],
        help="in x out, e.g. 576x1536",
    )
    args = p.parse_args(argv)
    args.clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, threshold {args.threshold}, medians of {args.reps}, "
        f"{args.clock} clock, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print(
        "| in x out | M | ours ms | bnb ms | fp32 ms | bf16 ms | bnb/ours | fp32/ours | bf16/ours "
        "| err ours | err bnb |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        for m in args.m:
            t = bench(k, n, m, args.reps, args.threshold, args.sample_ms / 1e3, CLOCKS[args.clock])
            print(
                f"| {k}x{n} | {m} | {t['ours']:.3f} | {t['bnb']:.3f} | {t['fp32']:.3f} | {t['bf16']:.3f} "
                f"| {t['bnb'] / t['ours']:.2f} | {t['fp32'] / t['ours']:.2f} | {t['bf16'] / t['ours']:.2f} "
                f"| {t['err_ours']:.1e} | {t['err_bnb']:.1e} |",
                flush=True,
            )
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
