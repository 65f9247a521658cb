"""The decoder CLI's speculative options: ``--draft DRAFT|self [--gamma N|auto]``, skip sets.

--draft RUN                     a draft model folder (same tokenizer), its own fp16 cache
--draft self --skip N           the target minus N layers (unified layer skipping)
--draft self --skip-layers 3,5  the target minus the given layers
--draft self --skip search      a skip set searched on calibration text, saved as RUN.skip.json
--draft self --adapt bandit     per prompt, a unimodal bandit over skip sets x gamma (or ucb1)

A draft folder runs in its own configuration (:func:`draft_runtime`, ``resolve_runtime`` on the
draft folder): group-quantized, on the CPU, without ``--dtype``, the decoder's fast one whatever
the target's (bfloat16, lean, the fast kernel and head, and compiled decode steps). Its tokens are only proposals: the target
verifies each, so the output is the target's alone.
"""

from compress.decoder.runtime import RuntimeConfig, named_settings, resolve_runtime
from compress.decoder.speculative.bandit import self_bandit
from compress.decoder.speculative.drafts import LayerSkipDraft, ModelDraft, load_draft
from compress.decoder.speculative.gamma import check_confidence, schedule_for
from compress.decoder.speculative.layer_skip import (
    calibration_ids,
    parse_layers,
    searched_skip,
    skip_file,
    unified_skip,
)
from compress.errors import CompressError


def add_arguments(p) -> None:
    p.add_argument(
        "--draft",
        help="speculative decoding: a draft model folder with the target's "
        "tokenizer, or 'self' (the target with layers skipped)",
    )
    p.add_argument(
        "--gamma", default="5", help="draft tokens per round, or 'auto' (transformers' heuristic)"
    )
    p.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="stop a round's drafting after a draft token whose draft probability is below "
        "this (default 0: draft all gamma tokens)",
    )
    p.add_argument(
        "--skip", help="--draft self: N layers skipped (unified layer skipping), or 'search'"
    )
    p.add_argument("--skip-layers", help="--draft self: the layers to skip, e.g. 4,6,8")
    p.add_argument(
        "--adapt",
        choices=("bandit", "ucb1"),
        help="--draft self: choose skip set and gamma per prompt with a bandit",
    )


def parse_gamma(text: str):
    if text == "auto":
        return "auto"
    try:
        gamma = int(text)
    except ValueError:
        gamma = None
    if gamma is None or gamma < 1:
        raise CompressError(
            f"--gamma {text}: give the number of draft tokens per round (an "
            f"integer >= 1) or 'auto'."
        )
    return gamma


def check_arguments(args) -> None:
    """Refuse contradictory speculative options before anything loads."""
    check_confidence(args.draft_confidence)
    if args.draft_confidence and args.draft is None:
        raise CompressError("--draft-confidence needs --draft (a model folder or 'self').")
    self_only = [
        f"--{n.replace('_', '-')}" for n in ("skip", "skip_layers", "adapt") if getattr(args, n)
    ]
    if args.draft is None:
        if self_only or args.gamma != "5":
            raise CompressError(
                f"{' '.join(self_only) or '--gamma'} needs --draft (a model folder or 'self')."
            )
        return
    args.gamma = parse_gamma(args.gamma)
    if args.compile and args.draft == "self":
        raise CompressError(
            "a self-speculative draft runs the target's eager forward with layers "
            "skipped: drop --compile (it compiles a draft model's decode step)."
        )
    if args.draft != "self" and self_only:
        raise CompressError(
            f"{' '.join(self_only)} choose a self-speculative draft: use --draft self."
        )
    if args.skip is not None and args.skip_layers is not None:
        raise CompressError("give --skip or --skip-layers, not both.")
    if args.adapt and args.draft_confidence:
        raise CompressError("--adapt runs its own drafts: drop --draft-confidence.")
    if args.adapt and (args.skip is not None or args.skip_layers is not None):
        raise CompressError("--adapt chooses the skip set itself: drop --skip/--skip-layers.")


def draft_runtime(args, conf: RuntimeConfig) -> RuntimeConfig:
    """The ``--draft`` folder's configuration: ``compress.decoder.runtime.resolve_runtime`` on
    the draft folder with the settings the command line names (the fast choice for the
    others; ``compile``: the draft's decode steps), or, for ``--draft self``, the target's
    ``conf`` (the target's eager forward with layers skipped)."""
    if args.draft == "self":
        return conf
    named = {**named_settings(args), "compile": getattr(args, "compile_flag", args.compile)}
    return resolve_runtime(args.draft, args.device, named, static_cache=True)


def draft_schedule(args, model, tokenizer, runtime: RuntimeConfig):
    """The schedule ``speculative.speculative_generate`` takes, from the options; a draft
    folder loads in ``runtime`` (:func:`draft_runtime`)."""

    if args.draft != "self":
        draft = load_draft(args.draft, model, tokenizer, runtime=runtime)
        return schedule_for(
            ModelDraft(draft, compile=runtime.compile, stop_below=args.draft_confidence),
            args.gamma,
        )
    if args.adapt:
        return self_bandit(model, args.adapt)
    L = model.spec.n_layers
    if args.skip_layers is not None:
        skip = parse_layers(args.skip_layers, L)
    elif args.skip == "search":
        skip = searched_skip(
            args.run,
            model,
            calibration_ids(tokenizer),
            args.gamma if args.gamma != "auto" else 4,
            log=print_stderr,
        )
        if not skip:
            raise CompressError(
                f"the skip-set search found no set of layers whose draft beats the "
                f"target alone on calibration text (modelled tokens per second; "
                f"{skip_file(args.run)}): decode without --draft self."
            )
    else:
        try:
            n = int(args.skip) if args.skip is not None else max(1, (L - 2) // 2)
        except ValueError:
            raise CompressError(f"--skip {args.skip}: give a number of layers or 'search'.")
        skip = unified_skip(L, n)
    return schedule_for(LayerSkipDraft(model, skip, args.draft_confidence), args.gamma)


def print_stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)
