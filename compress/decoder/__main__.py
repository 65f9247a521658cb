"""``python -m compress.decoder RUN --prompt "..." [--max-new-tokens 128]``: generate from a run folder.

Streams the continuation to stdout as it is produced (greedy unless ``--temperature``), then
prints TTFT, prefill and decode tokens/s, peak memory and KV bytes per token to stderr.
``--json`` prints one JSON object instead: ``text`` (the continuation only), ``ttft_s``,
``decode_tok_s``, ``prefill_tok_s``, ``peak_mem_bytes`` and ``kv_bytes_per_token``.
With ``--draft`` it decodes speculatively (``compress.decoder.speculative.cli`` has the options) and
adds ``acceptance`` (α), ``tokens_per_pass`` and ``rounds``.

On a group-quantized folder on the CPU the default is the fast configuration (bfloat16, lean,
compiled step, the W4A8 kernel and the int8 head; :func:`configuration`), and naming one setting
keeps the fast choice for the others; ``--dtype float32`` is the bit-faithful path of the
pipeline's evaluation. The configuration that runs is printed first to stderr (``runtime`` in
``--json``; with ``--draft``, ``draft_runtime`` too).
The compiled step is compiled once per machine and cache length, then read from torch
inductor's on-disk FX graph cache, so only the first warm-up pays for compiling (both times in
BENCHMARKS.md, "Decoder settings").
``--head int8|int4`` quantizes the output head at load (``compress.layers.head``); by default
the folder's recorded ``quant.lm_head``. IAM decoding (a small model alongside) is
``python -m compress.cli.iam generate``, which runs this CLI with its own loader (:func:`run`).
A ``--prompt`` or ``--stop`` that is not UTF-8, a folder the loaders refuse (its config's values,
weights, tokenizer or chat template: ``compress.arch.hf_config``, ``compress.io.tokenizer``) and a stdout
that cannot be written (a full disk, a closed pipe) are one line on stderr and exit status 2.
"""

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from compress.decoder.devices import check_device
from compress.decoder.generate import generate, peak_memory, peak_memory_reset
from compress.decoder.kv import KV_KINDS, parse_options
from compress.decoder.model import load, release_freed_memory
from compress.decoder.runtime import RuntimeConfig, named_settings, resolve_runtime
from compress.decoder.sampling import Sampling, check_sampling
from compress.decoder.speculative import cli as spec_cli
from compress.decoder.speculative.generate import speculative_generate
from compress.errors import ArgumentParser, CompressError
from compress.io.manifest import skip_verification, verify_folder
from compress.io.tokenizer import chat_text, check_ids, check_vocabulary

DTYPES = ("float32", "bfloat16", "float16")
HEADS = ("none", "int8", "int4")
KERNELS = ("exact", "w4a8")


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser(prog: str = "python -m compress.decoder", description=None, add_help=True):
    """The decoder CLI's parser (``python -m compress.cli.iam generate`` extends it)."""
    p = ArgumentParser(
        prog=prog, description=description or __doc__.splitlines()[0], add_help=add_help
    )
    p.add_argument("run", help="run folder (any recipe's) or HF Llama-family folder")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    p.add_argument(
        "--kv", choices=KV_KINDS, default="fp16", help="KV cache; full: the model's dtype, exact"
    )
    p.add_argument(
        "--kv-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cache option, e.g. --kv-opt bits=2 (repeatable)",
    )
    p.add_argument("--max-len", type=int, help="KV cache length (default: prompt + max new tokens)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the model's dtype; default: bfloat16 for a group-quantized folder on the CPU (the "
        "fast configuration), else float32. --dtype float32 is the bit-faithful path the "
        "pipeline's evaluation runs",
    )
    p.add_argument(
        "--qdtype",
        choices=DTYPES,
        help="dtype the int-quantized layers compute in (bfloat16: "
        "ATen's int4pack kernel on the CPU, faster, inputs rounded); default: --dtype",
    )
    p.add_argument(
        "--head",
        choices=HEADS,
        help="quantize the output head at load, group-wise (the embedding stays exact); "
        "default: what the run folder's manifest records (quant.lm_head), else none",
    )
    p.add_argument(
        "--kernel",
        choices=KERNELS,
        help="how the quantized layers compute: exact (weight-only) or w4a8 (activations rounded "
        "to int8 per token and 32 channels, integer dot products; CPU); default: "
        "the fast configuration's for a group-quantized folder on the CPU, else exact",
    )
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: torch's; 1 is often fastest "
        "for batch-1 decoding on a busy 2-core machine)",
    )
    p.add_argument(
        "--lean",
        action=argparse.BooleanOptionalAction,
        help="keep only the bfloat16 int4pack form of quantized "
        "layers (needs --dtype or --qdtype bfloat16): less memory, slower long prefills; "
        "default: on in the fast configuration",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="decode with the static-shape compiled step "
        "(CPU; fp16 or full cache; compiled on the first run, then read from torch's compile "
        "cache; with --draft: the draft's steps); default: on in the fast configuration",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed first pass over the prompt that prepares (and compiles) the kernels",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking the folder's files against the sha256 its manifest.json records "
        "(for a folder edited on purpose)",
    )
    p.add_argument(
        "--iam",
        metavar="SMALL",
        help="moved: IAM decoding is `python -m compress.cli.iam generate RUN --small SMALL ...` "
        "(the decoder imports no method)",
    )
    spec_cli.add_arguments(p)
    return p


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.iam is not None:
        print(
            f"error: IAM decoding moved to the iam package (the decoder imports no method): "
            f"run `python -m compress.cli.iam generate {args.run} --small {args.iam} "
            f"[--iam-layers N|auto] [--iam-map FILE]` with the same decoder options.",
            file=sys.stderr,
        )
        sys.exit(2)
    checked_run(args)


def checked_run(args, load_model=None) -> None:
    """:func:`run` with the argument checks, a CompressError printed as one line (exit 2)."""
    try:
        if not Path(args.run).exists():
            raise CompressError(
                f"run folder '{args.run}' does not exist. Pass a folder a recipe "
                f"wrote (outputs/...) or an HF Llama-family folder."
            )
        check_arguments(args)
        spec_cli.check_arguments(args)
        verify_folders(args)
        run(args, load_model)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


FLAGS = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "max_new_tokens": "--max-new-tokens",
    "threads": "--threads",
    "stop": "--stop",
}


def check_arguments(args) -> None:
    """The sampling settings (``sampling.check_sampling``, shared with the server and the API),
    the device, the cache length and the KV options, before anything loads."""

    check_sampling(
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.max_new_tokens,
        args.threads,
        args.stop,
        names=FLAGS,
    )
    if args.max_len is not None and args.max_len < 1:
        raise CompressError(
            f"--max-len {args.max_len}: the KV cache length is a number of tokens >= 1 (leave it "
            f"out for the prompt's length plus --max-new-tokens)."
        )
    args.device = check_device(args.device)
    parse_options(args.kv_opt)
    check_text("--prompt", args.prompt)
    for stop in args.stop:
        check_text("--stop", stop)


def check_text(flag: str, text: str) -> None:
    """Refuse an argument that is not UTF-8: Python hands such argv bytes over as lone
    surrogates (U+DC80..U+DCFF, ``surrogateescape``), which no tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise CompressError(
            f"{flag} is not UTF-8 text ({byte} at character {e.start}); pass the text in "
            f"UTF-8 (convert it with iconv, or set a UTF-8 locale in the terminal)."
        ) from None


def write_out(text: str) -> None:
    """``text`` to stdout, flushed. A stdout that cannot take it (a full disk, a closed pipe)
    is a CompressError; stdout then points at /dev/null, so that Python's final flush of what
    is still buffered cannot fail a second time with a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        if sys.stdout is sys.__stdout__:
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, sys.stdout.fileno())
                os.close(null)
            except (OSError, ValueError):
                pass
        fix = (
            "free space on the device it is redirected to, or redirect it elsewhere"
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            else "the program reading it stopped early or it cannot be written; redirect it "
            "to a file"
        )
        raise CompressError(
            f"cannot write the output to standard output ({e.strerror or type(e).__name__}); {fix}."
        ) from None


def verify_folders(args) -> None:
    """Check the run folder (and a --draft folder, or IAM's small one) against its manifest's hashes."""

    folders = [args.run] + [
        extra
        for extra in (args.draft, getattr(args, "small", None))
        if extra not in (None, "self") and Path(extra).is_dir()
    ]
    for folder in folders:  # the loaders check again unless told (model.load's verify)
        if args.no_verify:
            skip_verification(folder)
        else:
            verify_folder(folder)


def configuration(args) -> RuntimeConfig:
    """The configuration that runs (``compress.decoder.runtime.resolve_runtime``): the fast
    choice for every setting not named on the command line. The compiled step needs an fp16 or
    full cache and no draft."""
    static = args.kv in ("fp16", "full") and args.draft is None
    return resolve_runtime(args.run, args.device, named_settings(args), static_cache=static)


def run(args, load_model=None) -> None:
    """Load ``args.run`` in :func:`configuration` (``compress.decoder.model.load(folder,
    runtime=...)``, or a method's ``load_model(folder, **model.load keywords) -> (model,
    tokenizer)``), warm up, generate and print the figures."""
    import time

    import torch

    conf = configuration(args)
    args.compile_flag, args.compile = args.compile, conf.compile
    if not args.json:
        print(conf.describe(), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if load_model is None:
        model, tok = load(args.run, runtime=conf)
    else:  # a method's loader around model.load (IAM's pair), with model.load's keywords
        if conf.threads:
            torch.set_num_threads(conf.threads)
        model, tok = load_model(args.run, **conf.load_kwargs())
    if tok is None:
        raise CompressError(
            f"'{args.run}' has no tokenizer files, so the decoder cannot read a text prompt."
        )
    check_vocabulary(tok, model.spec.vocab_size, args.run)
    text = args.prompt
    if args.chat and not getattr(tok, "chat_template", None):
        raise CompressError(
            f"--chat: the tokenizer of '{args.run}' has no chat template; leave out --chat to "
            f"continue the prompt as plain text."
        )
    if args.chat:
        text = chat_text(
            tok,
            [{"role": "user", "content": text}],
            args.run,
            ". Leave out --chat to continue the prompt as plain text",
        )
    ids = tok(text, add_special_tokens=not args.chat).input_ids
    check_ids(ids, model.spec.vocab_size)  # the server's check of a prompt
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)

    kv_opts = parse_options(args.kv_opt)
    t1 = time.perf_counter()
    decode = generate
    if args.draft is not None:
        from functools import partial

        draft_conf = spec_cli.draft_runtime(args, conf)
        if not args.json:
            print(draft_conf.describe("draft runtime"), file=sys.stderr, flush=True)
        schedule = spec_cli.draft_schedule(args, model, tok, draft_conf)
        decode = partial(speculative_generate, draft=schedule)
    if (
        not args.no_warmup
    ):  # kernels prepare their weight forms, and compile (for this cache size), at first use
        warm = 2 if args.draft is None else 3  # 3: a draft step runs (and compiles)
        decode(
            model,
            [ids],
            warm,
            kv=args.kv,
            kv_opts=kv_opts,
            max_len=args.max_len or len(ids) + args.max_new_tokens,
            compile=args.compile,
            ignore_eos=True,
        )
    t2 = time.perf_counter()

    def stream(_row, piece):
        write_out(piece)

    release_freed_memory()
    peak_memory_reset()
    r = decode(
        model,
        [ids],
        args.max_new_tokens,
        tok,
        sampling,
        args.kv,
        kv_opts,
        args.max_len,
        tuple(args.stop),
        on_text=None if args.json else stream,
        compile=args.compile,
    )
    peak = peak_memory()
    stats = {
        "text": r.texts[0],
        "ttft_s": r.ttft_s,
        "decode_tok_s": r.decode_tok_s,
        "prefill_tok_s": r.prefill_tok_s,
        "peak_mem_bytes": peak,
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "runtime": conf.as_dict(),
    }
    if args.draft is not None:
        stats.update(acceptance=r.acceptance, tokens_per_pass=r.tokens_per_pass, rounds=r.rounds)
        stats["draft_runtime"] = draft_conf.as_dict()
    if args.json:
        write_out(json.dumps(stats) + "\n")
        return
    write_out("\n")
    print(
        f"[load {t1 - t0:.1f} s, warm-up {t2 - t1:.1f} s; {len(ids)} prompt tokens, {len(r.tokens[0])} "
        f"generated] TTFT {r.ttft_s * 1e3:.0f} ms  "
        f"prefill {r.prefill_tok_s:.1f} tok/s  decode {r.decode_tok_s:.1f} tok/s  "
        f"peak memory {peak / 2**20:.0f} MiB  KV {r.kv_bytes_per_token:.0f} B/token ({args.kv})",
        file=sys.stderr,
    )
    if args.draft is not None:
        print(
            f"[speculative, draft {args.draft}] acceptance {r.acceptance:.3f}  "
            f"{r.tokens_per_pass:.2f} tokens per target pass ({r.rounds} passes)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
