"""``python -m compress.serve RUN [--host 127.0.0.1 --port 8000]``: serve a run folder over HTTP.

OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (streaming or not),
``/v1/models``, ``/health`` and ``/metrics``, from one engine (``compress.decoder.engine``) that
batches every request in flight over a pool of ``--num-blocks`` KV blocks. Listens on
127.0.0.1 unless ``--host`` says otherwise.
"""

import argparse
import logging
import sys
from pathlib import Path

from compress.errors import CompressError

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m compress.serve", description=__doc__.splitlines()[0]
    )
    p.add_argument("run", help="run folder (any recipe's) or HF Llama-family folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", help="the model id clients send (default: the folder's name)"
    )
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences batched at once")
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="prompt tokens per step (longer prompts are prefilled in chunks)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kv", choices=("fp16", "full"), default="fp16", help="KV storage; full: the compute dtype"
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--qdtype", choices=DTYPES, help="dtype the int-quantized layers compute in")
    p.add_argument(
        "--kernel",
        choices=("exact", "w4a8"),
        default="exact",
        help="how the quantized layers compute: exact (weight-only) or w4a8 (int8 activations, "
        "integer dot products; CPU)",
    )
    p.add_argument(
        "--head",
        choices=("none", "int8", "int4"),
        help="quantize the output head at load (default: the folder's recorded quant.lm_head; "
        "with --batch-invariant: int8 when the folder records none)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's output does not depend on what else is served: W4A8 linears at every "
        "M (lean), the head quantized, attention query by query in a fixed order (CPU)",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument(
        "--prefill-ranks",
        type=int,
        default=1,
        help="KV-Runahead: prefill long prompts over this many processes (gloo), this one the last",
    )
    p.add_argument(
        "--runahead-min-tokens",
        type=int,
        default=256,
        help="prompts this long or longer go to the prefill ranks",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if not Path(args.run).exists():
            raise CompressError(
                f"run folder '{args.run}' does not exist. Pass a folder a recipe "
                f"wrote (outputs/...) or an HF Llama-family folder."
            )
        serve(args)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def serve(args) -> None:
    import torch
    import uvicorn

    from compress.decoder.engine import Engine
    from compress.decoder.model import load
    from compress.serve.app import create_app
    from compress.serve.worker import Worker

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from compress.decoder.defaults import fast_head
    from compress.quant.head import recorded_head

    head = args.head or recorded_head(args.run)
    if args.batch_invariant and args.head is None and head == "none":
        head = fast_head(args.run)
    model, tok = load(
        args.run,
        dtype=getattr(torch, args.dtype),
        device=device,
        qdtype=getattr(torch, args.qdtype) if args.qdtype else None,
        head=head,
        kernel="w4a8" if args.batch_invariant else args.kernel,
        lean=args.batch_invariant,
    )
    if args.batch_invariant:
        from compress.kernels.w4a8_cpu import use

        use(model, "w4a8", every_m=True)  # the integer kernel for every step, prefills too
    if tok is None:
        raise CompressError(
            f"'{args.run}' has no tokenizer files; the server needs one to read text."
        )
    runahead = None
    if args.prefill_ranks > 1:
        from compress.decoder.runahead import RunaheadPrefill

        runahead = RunaheadPrefill(
            model, args.run, args.prefill_ranks, args.dtype, args.qdtype, threads=args.threads or 1
        )
    try:
        engine = Engine(
            model,
            tok,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_seqs=args.max_seqs,
            max_step_tokens=args.max_step_tokens,
            kv=args.kv,
            prefix_caching=not args.no_prefix_caching,
            runahead=runahead,
            runahead_min_tokens=args.runahead_min_tokens,
            batch_invariant=args.batch_invariant,
        )
        name = args.served_model_name or Path(args.run).resolve().name
        app = create_app(Worker(engine), tok, name)
        logging.getLogger("compress.serve").info(
            "serving '%s' on http://%s:%d (%d KV blocks of %d tokens)",
            name,
            args.host,
            args.port,
            args.num_blocks,
            args.block_size,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if runahead is not None:
            runahead.close()


if __name__ == "__main__":
    main()
