"""What checking a run folder against its manifest costs at load time.

    python eval/bench/bench_verify.py                      # default model + 0.5B shape
    python eval/bench/bench_verify.py --models default --rtn   # the default model, INT4
    python eval/bench/bench_verify.py --models tiny --rounds 2  # a check that it runs

Each model is made into a run folder in a temporary directory (``--keep DIR`` keeps them there):
- ``default``: the default model (SmolLM2-135M, fp32, as cached by ``compress.io.source``);
- ``qwen0.5b``: a random model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query and 2 KV
  heads, intermediate 4864, vocabulary 151936, untied head), in ``--dtype`` (default bfloat16,
  the dtype Qwen ships);
- ``tiny``: a 2-layer random Llama, for tests.
``--rtn`` quantizes each with RTN INT4 (group 64) first, as a recipe's output would be.

Then, alternating in one process, ``--rounds`` times each: the decoder's load
(``compress.decoder.model.load``, dtype float32) alone, and ``manifest.verify_folder`` followed
by that load. Prints the file size, the medians, the verification's own median and its rate.
The page cache is warm after the first round (the load reads the same bytes), so the figures
are the hashing's CPU cost, not the disk's.
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    rope_theta=1e6,
)


def make_folder(kind: str, root: Path, dtype: torch.dtype, rtn: bool, layers=None) -> Path:
    from compress.testing import (
        random_model,
        run_folder,
        tiny_config,
        tiny_tokenizer,
    )

    folder = root / kind
    if folder.exists():
        return folder
    q = {"bits": 4, "group_size": 64} if rtn else None
    if kind == "default":
        from compress.io.checkpoint import read_tokenizer
        from compress.io.source import convert_default_model, load_model

        src = convert_default_model()
        model = load_model(str(src))[0]
        return run_folder(folder, model, read_tokenizer(src), rtn=q)
    if kind == "qwen0.5b":
        from transformers import Qwen2Config

        config = Qwen2Config(**dict(QWEN05B, num_hidden_layers=layers or 24))
    elif kind == "tiny":
        config = tiny_config(hidden_size=128, intermediate_size=256, head_dim=32)
    else:
        raise SystemExit(f"unknown model '{kind}': use default, qwen0.5b or tiny")
    model = random_model(config, std=0.02)
    if not rtn:
        model = model.to(dtype)
    return run_folder(folder, model, tiny_tokenizer(), rtn=q)


def measure(folder: Path, rounds: int) -> dict:
    from compress.decoder.model import load
    from compress.io.manifest import verify_folder

    plain, verified, verify_only = [], [], []
    for _ in range(rounds):
        t = time.perf_counter()
        model = load(folder, verify=False)[0]
        plain.append(time.perf_counter() - t)
        del model
        t = time.perf_counter()
        assert verify_folder(folder)
        v = time.perf_counter() - t
        model = load(folder, verify=False)[0]
        verified.append(time.perf_counter() - t)
        verify_only.append(v)
        del model
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    med = statistics.median
    return {
        "folder_bytes": size,
        "load_s": med(plain),
        "verify_and_load_s": med(verified),
        "verify_s": med(verify_only),
        "verify_gb_per_s": size / med(verify_only) / 1e9,
        "overhead_pct": 100 * (med(verified) - med(plain)) / med(plain),
        "rounds": rounds,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["default", "qwen0.5b"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--rtn", action="store_true", help="RTN INT4 g64 run folders")
    p.add_argument("--threads", type=int, help="torch threads (hashing uses its own threads)")
    p.add_argument(
        "--qwen-layers", type=int, help="layers of the 0.5B shape (default 24; fewer: a smoke test)"
    )
    p.add_argument("--keep", help="make (or reuse) the run folders here instead of a temp dir")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-verify-"))
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    try:
        for kind in args.models:
            folder = make_folder(kind, root, getattr(torch, args.dtype), args.rtn, args.qwen_layers)
            r = measure(folder, args.rounds)
            out[kind] = r
            print(
                f"{kind:9} {r['folder_bytes'] / 2**20:8.1f} MiB  load {r['load_s']:.3f} s  "
                f"verify+load {r['verify_and_load_s']:.3f} s  (+{r['overhead_pct']:.0f}%)  "
                f"verify alone {r['verify_s']:.3f} s = {r['verify_gb_per_s']:.2f} GB/s  "
                f"(median of {r['rounds']})",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
