"""``python -m compress.cli.distill --student S --teacher T --data D --out O``: distillation on its
own (``compress.methods.distill.distill``), written atomically as a loadable folder."""

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

from compress.errors import CompressError
from compress.io.checkpoint import save_checkpoint
from compress.io.data import read_text
from compress.io.run_folder import atomic_dir, commit_dir, weights_sha256
from compress.io.source import load_model
from compress.methods.distill import fsdp
from compress.methods.distill.distill import (
    LOSSES,
    TrainConfig,
    run_distill,
    token_blocks,
    train_config,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m compress.cli.distill", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--student", required=True, help="HF folder of the student (e.g. a pruned run folder)"
    )
    p.add_argument(
        "--teacher", help="HF folder or hub id of the teacher (not needed for --loss ce)"
    )
    p.add_argument(
        "--data", required=True, help="a text file or a datasets id repo[:config[:split]]"
    )
    p.add_argument(
        "--out", required=True, help="folder for the trained student (written atomically)"
    )
    p.add_argument("--loss", default="kl", choices=LOSSES)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument(
        "--recipe", default="cli", help="a name for the run, part of the checkpoint fingerprint"
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("extra", "betas", "progress"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            p.add_argument(flag, action="store_true")
        else:
            kind = f.type if f.type in (int, float) else str
            required = f.default is dataclasses.MISSING
            p.add_argument(
                flag, type=kind, required=required, default=None if required else f.default
            )
    p.add_argument(
        "--kl-chunk", default="auto", help="tokens per loss chunk: auto, 0 (whole logits) or N"
    )
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        tc = train_config(vars(args), progress=not args.no_progress)
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise CompressError(
                f"output folder '{out}' already exists and is not empty; pick another --out."
            )
        if args.loss != "ce" and args.teacher is None:
            raise CompressError("--teacher is required unless --loss ce.")
        fsdp.check_settings(tc.compile)
        student, tok, _ = load_model(args.student)
        teacher = load_model(args.teacher)[0] if args.loss != "ce" else None
        text = read_text(args.data, role="distill")
        blocks = token_blocks(tok, text, tc.seqlen)
        fingerprint = {
            "recipe": args.recipe,
            "student": weights_sha256(student),
            "teacher": weights_sha256(teacher) if teacher is not None else None,
            "data": hashlib.sha256(text.encode()).hexdigest(),
        }
        chunk = args.kl_chunk if args.kl_chunk == "auto" else int(args.kl_chunk)
        stats = run_distill(
            student,
            teacher,
            blocks,
            tc,
            args.loss,
            args.temperature,
            args.alpha,
            fingerprint,
            chunk,
        )
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from accelerate import PartialState

    if PartialState().is_main_process:
        tmp = atomic_dir(out)
        save_checkpoint(student, tok, tmp, None)
        (tmp / "distill.json").write_text(json.dumps(stats, indent=1))
        commit_dir(tmp, out)
        print(
            f"trained {stats['tokens']:,} tokens in {stats['steps']} steps; final loss "
            f"{stats['losses'][-1] if stats['losses'] else float('nan'):.4f}; saved {out}"
        )
    PartialState().wait_for_everyone()


if __name__ == "__main__":
    main()
