"""Time quantized linear layers against dense fp32 and bf16 ones.

CPU (always, 2 threads unless ``--threads``): for each layer shape
``in -> out`` and ``M`` rows, the median time of dense fp32 and bf16
``x @ W^T`` and of INT8 / INT4 / INT3 ``QuantLinear``s through
``quant_matmul`` (bf16 and fp32 activations), all measured in turns in one
run; the speed-up over fp32 and over bf16; the weight bytes each variant reads
and the GB/s it achieves, against the copy bandwidth of a large tensor
measured in the same run. For M <= 16 each variant cycles through copies of
its weights (64 MiB in all, at most 512 copies) so that, as in a decoder, they
come from memory, not from the cache. ``--alternatives`` adds the other CPU paths of each width (the
measurements behind ``compress/kernels/cpu.py``). Each width also runs as ``w4a8`` (``layer.kernel =
"w4a8"``: int8 activations, ``compress.kernels.w4a8_cpu``; for M above ``cpu.W4A8_MAX_M`` that is
the exact path), and with ``--alternatives`` each of its C++ paths forced at every M
(``w4a8:vnni``, ``w4a8:avx2``, ``w4a8:portable``: where they beat the exact paths at large M
decides ``W4A8_MAX_M``). ``--head`` adds SmolLM2's output head (576 -> 49152).

``--skinny``: fp32 products of M = 1..8 rows (speculative verification) over the whole of
SmolLM2-135M's fp32 linears as the decoder runs them (30 x (qkv 576 -> 960, o 576 -> 576,
gate_up 576 -> 3072, down 1536 -> 576) and the head 576 -> 49152: 540 MB, one sweep per
measurement, so the weights come from memory), ATen's ``F.linear`` beside each path of the skinny
kernel (``compress.kernels.skinny_cpu``; ``--alternatives`` adds the portable C++ path): the
measurement behind the kernel's range of M.

CUDA (when present): the Triton kernels against torch's bf16 matmul.

    python eval/bench/bench_linear.py [--quick] [--alternatives] [--head]
        [--threads 2] [--m 1 4 16 512]
    python eval/bench/bench_linear.py --skinny [--m 1 2 3 4 6 8]
"""

import argparse
import copy
import itertools
import math
import statistics
import time

import torch

from compress.formats.quantizer import quantize
from compress.kernels import cpu, quant_matmul, skinny_cpu, w4a8_cpu
from compress.layers import QuantLinear

SMALL = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # SmolLM2-135M: q/o, k/v, gate/up, down
HEAD = [(576, 49152)]  # SmolLM2-135M's output head
# SmolLM2-135M's fp32 linears as the decoder fuses them (qkv, o, gate_up, down) x 30, and the head
MODEL = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + HEAD
LARGE = [(4096, 4096), (4096, 11008), (11008, 4096)]  # 7B: attention, gate/up, down
BITS = (8, 4, 3)
MAX_COPIES = 512


def group_for(k: int) -> int:
    return 128 if k % 128 == 0 else 64


def times_ms(fns: dict, reps: int) -> dict:
    """Milliseconds of each run of each callable, the callables taking turns."""
    for f in fns.values():
        f()  # warm-up: compiles, prepares the cached forms
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: [1e3 * t for t in ts] for name, ts in times.items()}


def median_ms(fns: dict, reps: int) -> dict:
    return {name: statistics.median(t) for name, t in times_ms(fns, reps).items()}


def copy_gbps(mib: int = 256, reps: int = 7) -> float:
    """Copy bandwidth of a large fp32 tensor (read + write bytes per second)."""
    src = torch.randn(mib * 2**18)
    dst = torch.empty_like(src)
    ms = median_ms({"copy": lambda: dst.copy_(src)}, reps)["copy"]
    return 2 * src.nbytes / ms / 1e6


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def rotating(make, working_set: int) -> tuple[callable, int]:
    """A run that cycles through copies of one variant, enough that their weights exceed the cache.

    ``make()`` builds and warms one copy and returns ``(run, weight_bytes)``. A
    decoder reads each layer once per token, from memory: timing one small
    layer over and over would time the L2/L3 cache instead.
    """
    run, nbytes = make()
    runs = [run] + [make()[0] for _ in range(min(MAX_COPIES, math.ceil(working_set / nbytes)) - 1)]
    turn = itertools.cycle(runs)
    return lambda: next(turn)(), nbytes


def dense(w: torch.Tensor, x: torch.Tensor):
    def make():
        wc = w.clone()
        return (lambda: x @ wc.t()), wc.nbytes

    return make


def quantized(layer: QuantLinear, x: torch.Tensor, fn):
    def make():
        q = copy.copy(
            layer
        )  # the same packed buffers, an empty cache: the cache holds this copy's form
        q.cache = {}
        fn(x, q)
        nbytes = tensor_bytes([v for k, v in q.cache.items() if k != "checked"]) or tensor_bytes(
            list(q.buffers())
        )
        return (lambda: fn(x, q)), nbytes

    return make


def forced(path: str):
    return lambda x, layer: cpu.PATHS[path](x, layer)


def forced_w4a8(which: str):
    """The W4A8 kernel's C++ path ``which`` at every M."""

    def run(x, layer):
        packed, s, sz = w4a8_cpu.form(layer)
        return w4a8_cpu.linear(x, packed, s, sz, layer.bits, layer.group_size, which)

    return run


def ctypes_w4a8(which: str):
    """The same C++ path called through ``ctypes`` (the operator's fallback), bf16 in and out."""

    def run(x, layer):
        packed, s, sz = w4a8_cpu.form(layer)
        y = w4a8_cpu.ctypes_linear(
            x, packed, s, sz, layer.bits, layer.group_size, w4a8_cpu.PATHS[which]
        )
        return y.to(x.dtype)

    return run


def alt_paths(x: torch.Tensor, layer) -> list[str]:
    """Every CPU path that can take ``x`` (the slow ones only where they stay affordable)."""
    m = x.shape[0]
    paths = ["kplanes-gemv"] if m <= 16 else ["kplanes-dequant"]
    if cpu.int4pack_fits(x, layer) or (x.dtype == torch.float32 and layer.bits <= 4 and m == 1):
        paths.append("int4pack")  # ATen's float32 int4pack is unvectorized: M = 1 only
    if m == 1 and layer.in_features * layer.out_features < 2**22:
        paths.append("reference")  # dequantizes the whole layer per call: small layers only
    return paths


def cpu_variants(
    k: int, n: int, m: int, alternatives: bool, working_set: int
) -> list[tuple[str, str, callable, int]]:
    """``(name, path, run, weight_bytes)`` per variant."""
    gen = torch.Generator().manual_seed(k * n + m)
    w = torch.randn(n, k, generator=gen) * 0.02
    x32 = torch.randn(m, k, generator=gen)
    x16 = x32.bfloat16()
    out = [
        ("fp32", "dense", *rotating(dense(w, x32), working_set)),
        ("bf16", "dense", *rotating(dense(w.bfloat16(), x16), working_set)),
    ]
    for bits in BITS:
        layer = QuantLinear.from_quantized(quantize(w, bits, group_for(k)))
        for act, x in (("bf16", x16), ("fp32", x32)):
            chosen = cpu.cpu_path(x, layer)
            paths = [(chosen, quant_matmul)]
            if alternatives:
                paths += [(p, forced(p)) for p in alt_paths(x, layer) if p != chosen]
            for i, (path, fn) in enumerate(paths):
                name = f"INT{bits} {act}" + ("" if i == 0 else f" ({path})")
                out.append((name, path, *rotating(quantized(layer, x, fn), working_set)))
        if not w4a8_cpu.fits(layer):
            continue
        a8 = copy.copy(layer)
        a8.kernel = "w4a8"
        out.append((f"INT{bits} w4a8", cpu.cpu_path(x16, a8),
                    *rotating(quantized(a8, x16, quant_matmul), working_set)))  # fmt: skip
        if alternatives:
            for which in (p for p in w4a8_cpu.available() if p != "ref"):
                fn = forced_w4a8(which)
                out.append((f"INT{bits} w4a8:{which}", f"w4a8:{which}",
                            *rotating(quantized(a8, x16, fn), working_set)))  # fmt: skip
            which = w4a8_cpu.path()
            out.append((f"INT{bits} w4a8:{which} ctypes", f"w4a8:{which}",
                        *rotating(quantized(a8, x16, ctypes_w4a8(which)), working_set)))  # fmt: skip
    return out


def bench_cpu(shapes, ms, reps: int, alternatives: bool, threads: int, working_set: int) -> None:
    torch.set_num_threads(threads)
    bw_before = copy_gbps()
    print(
        f"CPU, {torch.get_num_threads()} threads, copy bandwidth {bw_before:.1f} GB/s "
        f"(torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})"
    )
    print(
        "| in -> out | M | variant | path | ms | min ms | x fp32 | x bf16 | weight MB | GB/s | % copy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bws = [bw_before]
    for k, n in shapes:
        for m in ms:
            # prefill reuses each weight over M rows: cold or hot weights barely matter there
            variants = cpu_variants(k, n, m, alternatives, working_set if m <= 16 else 0)
            # big layers at M=512 take ~1 s a call: fewer turns
            r = reps if k * n * m < 2**31 else max(3, reps // 3)
            runs = times_ms({name: run for name, _, run, _ in variants}, r)
            t = {name: statistics.median(ts) for name, ts in runs.items()}
            bws.append(copy_gbps())
            bw = statistics.median(bws)
            for name, path, _, b in variants:
                gbps = b / t[name] / 1e6
                print(
                    f"| {k} -> {n} | {m} | {name} | {path} | {t[name]:.3f} | {min(runs[name]):.3f} | "
                    f"{t['fp32'] / t[name]:.2f} | "
                    f"{t['bf16'] / t[name]:.2f} | {b / 2**20:.1f} | {gbps:.1f} | {100 * gbps / bw:.0f} |",
                    flush=True,
                )
    print(
        f"copy bandwidth over the run: median {statistics.median(bws):.1f} GB/s, "
        f"min {min(bws):.1f}, max {max(bws):.1f}"
    )


def bench_skinny(ms, reps: int, alternatives: bool, threads: int) -> None:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=gen) * 0.02 for k, n in MODEL]
    nbytes = sum(w.nbytes for w in ws)
    paths = [p for p in skinny_cpu.available() if p != "ref" and (alternatives or p != "portable")]
    bw = copy_gbps()
    print(
        f"CPU, {torch.get_num_threads()} threads, copy bandwidth {bw:.1f} GB/s; SmolLM2-135M's "
        f"fp32 linears and head, {nbytes / 1e6:.0f} MB a sweep"
    )
    print("| M | variant | ms a sweep | min ms | GB/s | x F.linear |")
    print("|---|---|---|---|---|---|")
    for m in ms:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for k, _ in MODEL}}

        def sweep(fn):
            return lambda: [fn(xs[w.shape[1]], w) for w in ws]

        fns = {"F.linear": sweep(torch.nn.functional.linear)}
        for p in paths:
            fns[f"skinny:{p}"] = sweep(lambda x, w, p=p: skinny_cpu.linear(x, w, None, p))
        runs = times_ms(fns, reps)
        t = {name: statistics.median(ts) for name, ts in runs.items()}
        for name in fns:
            print(
                f"| {m} | {name} | {t[name]:.2f} | {min(runs[name]):.2f} | "
                f"{nbytes / t[name] / 1e6:.1f} | {t['F.linear'] / t[name]:.2f} |",
                flush=True,
            )


def bench_cuda(shapes, ms) -> None:
    import triton.testing

    from compress.kernels.dequant_matmul import triton_quant_matmul

    dev = torch.device("cuda")
    src = torch.empty(2**28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = (
        2 * src.nbytes / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    )
    print(f"\nCUDA {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s")
    print("| in -> out | M | variant | ms | x bf16 | weight MB | GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        w16 = w.to(dev, torch.bfloat16)
        layers = {b: QuantLinear.from_quantized(quantize(w, b, group_for(k))).to(dev) for b in BITS}
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            runs = {"bf16": (lambda: x @ w16.t(), w16.nbytes)}
            for b, layer in layers.items():
                runs[f"INT{b} triton"] = (
                    lambda layer=layer: triton_quant_matmul(x, layer),
                    sum(t.nbytes for t in layer.buffers()),
                )
            t = {
                name: triton.testing.do_bench(f, return_mode="median")
                for name, (f, _) in runs.items()
            }
            for name, (_, b) in runs.items():
                gbps = b / t[name] / 1e6
                print(
                    f"| {k} -> {n} | {m} | {name} | {t[name]:.4f} | {t['bf16'] / t[name]:.2f} | "
                    f"{b / 2**20:.1f} | {gbps:.0f} | {100 * gbps / bw:.0f} |",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="the small model's shapes and 4096x4096, fewer turns"
    )
    ap.add_argument(
        "--alternatives", action="store_true", help="also time every other CPU path of each width"
    )
    ap.add_argument(
        "--reps", type=int, default=None, help="turns per variant (default 15, --quick 5)"
    )
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    ap.add_argument(
        "--working-set",
        type=int,
        default=64,
        help="MiB of weight copies each variant cycles "
        "through, above the L3 cache (default 64; 0 times one cache-hot copy)",
    )
    ap.add_argument("--m", type=int, nargs="+", default=[1, 512], help="rows of x (default 1 512)")
    ap.add_argument("--head", action="store_true", help="also SmolLM2's output head, 576 -> 49152")
    ap.add_argument(
        "--shapes", nargs="+", metavar="INxOUT", help="only these shapes, e.g. 576x1536"
    )
    ap.add_argument(
        "--skinny", action="store_true", help="fp32 products of a few rows over SmolLM2's linears"
    )
    args = ap.parse_args()
    if args.skinny:
        ms = args.m if args.m != [1, 512] else [1, 2, 3, 4, 6, 8]
        return bench_skinny(ms, args.reps or 7, args.alternatives, args.threads)
    shapes = SMALL + (LARGE[:1] if args.quick else LARGE) + (HEAD if args.head else [])
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    reps = args.reps or (5 if args.quick else 15)
    bench_cpu(shapes, args.m, reps, args.alternatives, args.threads, args.working_set << 20)
    if torch.cuda.is_available():
        bench_cuda(shapes, args.m)


if __name__ == "__main__":
    main()
