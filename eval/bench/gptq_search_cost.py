"""What ``gptq.scale_search=mse`` adds to GPTQ's time: ``gptq_quantize`` on one decoder layer's
linear shapes (q, k, v, o, gate, up, down; act-order, random weights and Hessian), with
``minmax`` and with ``mse`` grids, and the difference times the layer count.

    python eval/bench/gptq_search_cost.py [--hidden 576 --intermediate 1536 --kv 192 --layers 30]
        [--bits 4 3] [--group-size 64] [--rounds 3]

The defaults are SmolLM2-135M's shapes. The stage's own time (Hessians from the calibration
forwards included) is ``eval/bench/gptq_vs_awq.py``'s.
"""

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv", type=int, default=192, help="k and v projections' output width")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="median of this many")
    args = ap.parse_args()

    from compress.methods.quant.gptq import gptq_quantize

    h, i, kv = args.hidden, args.intermediate, args.kv
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    gen = torch.Generator().manual_seed(0)
    hess = {}
    for n in (h, i):
        x = torch.randn(4096, n, generator=gen)
        hess[n] = 2 * x.T @ x / x.shape[0]
    weights = [torch.randn(o, n, generator=gen) * 0.02 for o, n in shapes]

    def layer_seconds(bits, search):
        t = time.perf_counter()
        for w in weights:
            gptq_quantize(w, hess[w.shape[1]], bits, args.group_size, act_order=True,
                          scale_search=search)  # fmt: skip
        return time.perf_counter() - t

    print(f"torch threads {torch.get_num_threads()}, group {args.group_size}, act-order")
    print("| bits | minmax s/layer | mse s/layer | added s over the layers |")
    print("|---|---|---|---|")
    for bits in args.bits:
        med = {}
        for search in ("minmax", "mse"):
            runs = sorted(layer_seconds(bits, search) for _ in range(args.rounds))
            med[search] = runs[len(runs) // 2]
        added = args.layers * (med["mse"] - med["minmax"])
        print(f"| {bits} | {med['minmax']:.2f} | {med['mse']:.2f} | {added:.0f} ({args.layers}) |")


if __name__ == "__main__":
    main()
