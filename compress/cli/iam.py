"""``python -m compress.cli.iam map --large L --small S [--out FILE] [--tokens N]``: IAM's mapping.

Computes both models' attention weights on WikiText-2 validation text, their cosine similarity
per (large layer, small layer) and head, and the mapping (``compress.methods.iam.map``); saves it as JSON
(default: beside the large folder, ``L.iam.json``) with a heat map of the similarity (``.png``,
when matplotlib is installed), and prints the layers ranked for mapping.

``python -m compress.cli.iam generate LARGE --small SMALL [--iam-layers N|auto] [--iam-map FILE]
--prompt "..."`` (with every option of ``python -m compress.decoder``): the large model decodes
with the small one alongside (``compress.methods.iam.decode``), the mapping made on first use. The
decoder CLI runs it (``compress.decoder.__main__.run`` with this package's loader), so the
dependency points one way: iam -> decoder.
"""

import argparse
import logging
import sys
from pathlib import Path

from compress.decoder.__main__ import build_parser, checked_run
from compress.errors import CompressError
from compress.methods.iam import map as iam_map
from compress.methods.iam.decode import load_iam


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m compress.cli.iam", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("map", help="similarity and mapping of a large model onto a small one")
    m.add_argument("--large", required=True, help="run folder or HF folder of the large model")
    m.add_argument("--small", required=True, help="a folder with the same tokenizer")
    m.add_argument("--out", help="mapping file (default: beside the large folder, LARGE.iam.json)")
    m.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    m.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sample")
    m.add_argument("--skip-first", type=int, default=None, help="first layers never mapped (2)")
    m.add_argument("--min-similarity", type=float, default=None, help="'auto' threshold (0.8)")
    m.add_argument("--threads", type=int)

    g = sub.add_parser(
        "generate",
        parents=[build_parser(add_help=False)],
        conflict_handler="resolve",
        help="decode with IAM: the decoder CLI's options, plus the small model and mapping",
    )
    g.add_argument(
        "--small", "--iam", dest="small", metavar="SMALL", required=True,
        help="a smaller model of the same tokenizer; the mapped layers take its attention weights",
    )  # fmt: skip
    g.add_argument(
        "--iam-layers",
        default="auto",
        help="large layers mapped: a count (the most similar first) or auto (default)",
    )
    g.add_argument(
        "--iam-map",
        help="mapping file (default: RUN/iam_map.json or RUN.iam.json beside the folder, made "
        "on first use)",
    )
    return p.parse_args(argv)


def generate(args) -> None:
    """The decoder CLI's run with the pair loaded by :func:`compress.methods.iam.decode.load_iam`."""

    if not Path(args.small).exists():
        print(f"error: --small '{args.small}' does not exist; pass the small model's folder.",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if args.draft is not None or args.compile:
        print("error: IAM decodes eagerly with one model pair: leave out --draft and --compile.",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    args.compile = False

    def load_pair(folder, **load_kw):

        def log(m):
            print(m, file=sys.stderr)

        model, tok = load_iam(folder, args.small, args.iam_layers, args.iam_map, log=log, **load_kw)
        if not args.json:
            log(f"[IAM: {len(model.mapped)} layers mapped onto {args.small}]")
        return model, tok

    checked_run(args, load_pair)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "generate":
        return generate(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        for role in ("large", "small"):
            if not (Path(getattr(args, role)) / "config.json").is_file():
                raise CompressError(
                    f"--{role} '{getattr(args, role)}' has no config.json: pass a run folder or "
                    f"an HF Llama-family folder."
                )
        kw = {}
        if args.skip_first is not None:
            kw["skip_first"] = args.skip_first
        if args.min_similarity is not None:
            kw["min_similarity"] = args.min_similarity
        m = iam_map.build_map(args.large, args.small, args.tokens, args.seqlen, **kw)
        out = (
            Path(args.out)
            if args.out
            else Path(args.large).parent / (Path(args.large).name + ".iam.json")
        )
        iam_map.save_map(m, out)
        print(f"mapping: {out}")
        for rank, ly in enumerate(m["order"]):
            print(
                f"{rank + 1:3d}. large layer {ly:3d} -> small layer {m['layer_map'][ly]:3d}  "
                f"similarity {m['similarity'][ly]:.3f}{'  (auto)' if ly in m['auto'] else ''}"
            )
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
