"""Greedy output of the decoder's fast default against its bit-faithful path, prompt by prompt.

    python eval/bench/fast_vs_faithful.py RUN [--new 64] [--threads 1] [--head none]
        [--no-compile] [--json OUT]

The bit-faithful path is what the pipeline's evaluation computes: float32, the int layers from
their packed codes, the exact (``full``) KV cache. The fast default is what
``python -m compress.decoder RUN`` runs on a group-quantized folder: bfloat16 with the int layers
through ATen's int4pack kernel, lean weights, the compiled step, the fp16 KV cache. Each of the
decoder's equivalence prompts (:data:`PROMPTS`, also those of ``tests/test_decoder.py``) is
continued greedily by both for ``--new`` tokens (EOS ignored). Where the two first differ, the
table gives the position, both tokens, and the bit-faithful model's top-2 logit margin there
(its logits on the prompt and the common prefix, teacher-forced): a small margin means the
bfloat16 rounding of the fast path tipped a near tie, not a wrong kernel.
"""

import argparse
import json

import torch

from compress.testing import PROMPTS


def margin(model, ids: list[int]) -> tuple[float, list[int]]:
    """``(top-1 minus top-2 logit, [top-1 id, top-2 id])`` of ``model``'s next token after ``ids``."""
    from compress.decoder.kv import new_cache

    with torch.no_grad():
        logits = model(torch.tensor([ids]), new_cache(model, "full", 1, len(ids)), last=True)
    top = logits[0, -1].double().topk(2)
    return (top.values[0] - top.values[1]).item(), top.indices.tolist()


def compare(faithful, fast, tok, prompts, new: int, compile: bool = True) -> list[dict]:
    """One record per prompt: ``equal``, and at the first divergence ``at`` (index into the
    continuation), ``faithful_token``, ``fast_token``, ``faithful_margin`` and ``fast_margin``
    (top-2 logit margins of each model there)."""
    from compress.decoder.generate import generate

    rows = []
    for prompt in prompts:
        ids = tok(prompt).input_ids
        a = generate(faithful, [ids], new, kv="full", ignore_eos=True).tokens[0]
        b = generate(fast, [ids], new, compile=compile, ignore_eos=True).tokens[0]
        row = {"prompt": prompt, "tokens": len(a), "equal": a == b}
        if a != b:
            at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            prefix = ids + a[:at]
            row.update(
                at=at,
                faithful_token=a[at],
                fast_token=b[at],
                faithful_margin=margin(faithful, prefix)[0],
                fast_margin=margin(fast, prefix)[0],
            )
        rows.append(row)
    return rows


def main(argv=None) -> None:
    from compress.decoder.model import load
    from compress.decoder.runtime import FAST_KERNEL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a group-quantized run folder")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--head", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--kernel",
        default=FAST_KERNEL,
        choices=("exact", "w4a8"),
        help=f"the fast side's kernel (default: the decoder's, {FAST_KERNEL})",
    )
    p.add_argument("--json", help="also write the records here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    faithful, tok = load(args.run, dtype=torch.float32, head=args.head)
    fast, _ = load(args.run, dtype=torch.bfloat16, lean=True, head=args.head, kernel=args.kernel)
    rows = compare(faithful, fast, tok, PROMPTS, args.new, args.compile)
    print(
        "| prompt | equal | first difference | faithful / fast token | faithful margin | fast margin |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["equal"]:
            print(f"| {r['prompt']} | yes ({r['tokens']} tokens) | | | | |")
            continue
        toks = f"{tok.decode([r['faithful_token']])!r} / {tok.decode([r['fast_token']])!r}"
        print(
            f"| {r['prompt']} | no | token {r['at']} | {toks} | "
            f"{r['faithful_margin']:.4f} | {r['fast_margin']:.4f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
