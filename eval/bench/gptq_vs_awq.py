"""GPTQ against AWQ in one run: each recipe's calibration time (its stage, same model, same
calibration set), its perplexity, and the default decode speed of the two saved folders, measured
alternately. Prints a table; the ratios are what the issue's bars read (GPTQ time <= 1.5x AWQ's,
GPTQ folder decodes as fast as the AWQ folder of the same bits).

    python eval/bench/gptq_vs_awq.py --bits 4 --windows 4 --rounds 3     # the default model
    python eval/bench/gptq_vs_awq.py --model TINY_FOLDER --small          # a smoke test

Run it alone: both figures are wall-clock times on this machine's cores.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import compress
from compress.decoder.generate import generate

SMALL = {"calib": {"samples": 2, "seqlen": 32}, "eval": {"windows": 1, "seqlen": 32}}


def calibrate(recipe: str, model, out: Path, windows: int, small: bool) -> dict:
    stage = recipe.split("_")[0]
    settings = {"eval": {"windows": windows}, **(SMALL if small else {})}
    settings["eval"] = {**settings["eval"], "compare_source": False}
    settings["decode"] = {"enabled": False}
    if small and stage == "awq":
        settings["awq"] = {"n_grid": 2}
    kw = {"model": model} if model else {}
    result = compress.run(recipe, out=out / recipe, **kw, **settings)
    return {
        "stage_s": result.report["stages"][stage],
        "ppl": result.report["ppl"],
        "path": result.path,
    }


def decode_tok_s(folder: Path, prompt_len: int, new_tokens: int) -> float:
    """Decode tok/s of ``folder`` in the decoder's default configuration (``compress.load``)."""
    model, _, runtime = compress.load(folder)
    prompt = torch.randint(2, 100, (prompt_len,), generator=torch.Generator().manual_seed(0))
    kw = dict(compile=runtime.compile, ignore_eos=True, max_len=prompt_len + new_tokens)
    generate(model, [prompt.tolist()], 2, **kw)  # warm-up: kernel forms, the compiled step
    return generate(model, [prompt.tolist()], new_tokens, **kw).decode_tok_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a source folder (default: the recipes' model)")
    ap.add_argument("--bits", type=int, default=4, choices=(3, 4))
    ap.add_argument("--windows", type=int, default=4, help="evaluation windows per recipe")
    ap.add_argument("--rounds", type=int, default=3, help="alternating decode measurements")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="where the two run folders go (default: a temp)")
    ap.add_argument("--small", action="store_true", help="tiny calibration and evaluation")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="gptq_vs_awq-"))
    rows = {}
    for recipe in (f"awq_int{args.bits}", f"gptq_int{args.bits}"):
        rows[recipe] = calibrate(recipe, args.model, out, args.windows, args.small)
    speeds = {r: [] for r in rows}
    for _ in range(args.rounds):
        for recipe, row in rows.items():
            new = 8 if args.small else args.new_tokens
            speeds[recipe].append(decode_tok_s(row["path"], 16, new))
    awq, gptq = rows
    print(f"\nthreads {torch.get_num_threads()}, {args.rounds} rounds, folders in {out}\n")
    print("| recipe | stage s | ppl | decode tok/s (median) |")
    print("|---|---|---|---|")
    for recipe, row in rows.items():
        tok_s = statistics.median(speeds[recipe])
        print(f"| {recipe} | {row['stage_s']:.1f} | {row['ppl']:.3f} | {tok_s:.1f} |")
    ratio = rows[gptq]["stage_s"] / rows[awq]["stage_s"]
    speed = statistics.median(speeds[gptq]) / statistics.median(speeds[awq])
    print(f"\nGPTQ / AWQ calibration time: {ratio:.2f}x; GPTQ / AWQ decode tok/s: {speed:.2f}x")


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"({time.time() - start:.0f} s)")
