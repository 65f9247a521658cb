"""Where one decode step's time goes: torch.profiler's ``key_averages`` table over N steps.

    python eval/bench/profile_step.py RUN [--steps 32] [--threads 1] [--dtype bfloat16]
        [--no-lean] [--no-compile] [--head none|int8|int4] [--kernel exact|w4a8] [--prompt-len 32] [--rows 30]
        [--sort self_cpu_time_total] [--trace OUT.json]

Loads the run folder as ``python -m compress.decoder`` would (default: the fast configuration,
bfloat16 with lean weights and the compiled step), prefills a ``--prompt-len``-token prompt,
runs ``--warmup`` untimed steps (the compile happens there), then profiles ``--steps`` decode
steps of batch 1 (greedy, one token each) and prints the table, sorted by ``--sort``. With the
compiled step, inductor's kernels show as ``graph_*``/``cpp_fused_*`` rows and ATen calls made
inside the graph (``aten::_weight_int4pack_mm_for_cpu``, ``mkldnn``/``addmm``) by name; anything
outside the compiled graph (a graph break, ``Eager`` layers, sampling) shows as its own ATen ops.
The footer gives the wall time per step measured without the profiler.
"""

import argparse
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="run folder")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--qdtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--head", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--kernel", default="exact", choices=("exact", "w4a8"))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sort", default="self_cpu_time_total")
    p.add_argument("--trace", help="also write a Chrome trace here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from bench_decode import prompt_ids

    from compress.decoder.generate import static_step
    from compress.decoder.kv import new_cache
    from compress.decoder.model import load

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    qdtype = getattr(torch, args.qdtype) if args.qdtype else dtype
    model, tok = load(
        args.run, dtype=dtype, qdtype=qdtype, lean=args.lean, head=args.head, kernel=args.kernel
    )
    if tok is not None:
        ids = torch.tensor([prompt_ids(tok, args.prompt_len)])
    else:  # a folder without a tokenizer (eval/bench/moe_decode.py's): fixed random ids
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=gen)
    max_len = args.prompt_len + args.warmup + 2 * args.steps + 2
    with torch.no_grad():
        if args.compile:
            step, cache = static_step(model, "fp16", None, 1, max_len)
        else:
            step, cache = model, new_cache(model, "fp16", 1, max_len)
        x = model(ids, cache, last=True)[:, -1].argmax(-1)

        def one(x):
            return step(x[:, None], cache)[:, -1].argmax(-1)

        for _ in range(args.warmup):
            x = one(x)
        t = time.perf_counter()
        for _ in range(args.steps):
            x = one(x)
        wall = (time.perf_counter() - t) / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                with torch.profiler.record_function("decode_step"):
                    x = one(x)
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    conf = (
        f"dtype {args.dtype}, qdtype {qdtype}, head {args.head}, kernel {args.kernel}"
        f"{', lean' if args.lean else ''}{', compiled' if args.compile else ''}"
    )
    print(
        f"{args.steps} steps ({conf}, {args.threads} threads): {wall * 1e3:.2f} ms per step "
        f"without the profiler ({1 / wall:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
