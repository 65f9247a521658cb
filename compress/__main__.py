"""``python -m compress recipe=NAME [KEY=VALUE ...]``: run ``recipes/NAME.yaml``.

Every recipe is a Hydra primary config that starts from ``recipes/base.yaml``.
``recipe=NAME`` is rewritten to Hydra's ``--config-name NAME``, so
``--cfg job`` prints the resolved recipe and any key can be overridden
(``eval.windows=4``, ``model.path=...``, ``hydra.run.dir=DIR``). Overrides are checked
against the recipe before Hydra or the model sees them (``compress.recipe.overrides``); torch
and transformers load only once they pass, so ``--help`` and a mistake answer in a second.
"""

import logging
import signal
import sys
from pathlib import Path

from compress.errors import CompressError, Interrupted, on_signal
from compress.io.run_folder import check_writable
from compress.recipe.overrides import RECIPES, available, check_overrides, summary

log = logging.getLogger("compress")

COMMON_KEYS = (
    (
        "model.path=FOLDER_OR_HUB_ID",
        "the source (default smollm2-135m: SmolLM2-135M-Instruct, embedded)",
    ),
    ("eval.windows=N", "perplexity windows of eval.seqlen=2048 tokens (default 40; null = all)"),
    ("calib.samples=N", "calibration samples of calib.seqlen=512 tokens (default 128)"),
    ("STAGE.bits, STAGE.group_size", "a method's knobs live in the group named after its stage:"),
    ("", "rtn.*, awq.*, llm_int8.threshold, prune.*, distill.*"),
    ("decode.enabled=false", "skip the built-in decoder's speed figures"),
    ("hydra.run.dir=DIR", "the run folder (default outputs/DATE_TIME_RECIPE)"),
    ("hub.push=true hub.repo_id=ORG/NAME", "push the run folder once it is complete"),
    ("--cfg job", "print the resolved recipe (every key) instead of running it"),
)


def usage() -> str:
    width = max(map(len, available()))
    recipes = "\n".join(f"  {name:<{width}}  {summary(name)}" for name in available())
    keys = "\n".join(f"  {k:<36}{v}" for k, v in COMMON_KEYS)
    return (
        f"usage: python -m compress recipe=NAME [KEY=VALUE ...] [--cfg job]\n\n"
        f"Compress a model with a recipe and write a run folder: checkpoint, manifest, report.\n\n"
        f"recipes (recipes/NAME.yaml):\n{recipes}\n\ncommon keys:\n{keys}\n\n"
        f"The calibration and evaluation text is read from $COMPRESS_DATA_DIR/wikitext-2/.\n\n"
        "example:\n"
        "  COMPRESS_DATA_DIR=../shared/data python -m compress recipe=awq_int4 eval.windows=4\n"
    )


def rewrite_argv(argv: list[str]) -> list[str]:
    """Turn ``recipe=NAME`` into ``--config-name NAME`` and check every override before Hydra
    sees it (unknown keys, values of the wrong kind, unknown recipe or group config)."""
    out, recipe, overrides = [], None, []
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
            continue
        out.append(arg)
        if ("=" in arg or arg.startswith("~")) and not arg.startswith("-"):
            overrides.append(arg)
    if recipe is None:
        raise CompressError(
            "no recipe given: add recipe=NAME (`python -m compress --help` lists them)."
        )
    check_overrides(recipe, overrides)
    check_run_dir_override(overrides)
    if any(a.startswith("--cfg") or a == "-c" for a in out) and "--resolve" not in out:
        out.append("--resolve")  # print the resolved recipe
    return ["--config-name", recipe] + out


def check_run_dir_override(overrides: list[str]) -> None:
    """Hydra makes ``hydra.run.dir`` before the run starts (a traceback when it cannot): check
    that it can be made, or that ``outputs/`` can for the default."""

    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    path = given[-1].strip("'\"") if given else "outputs/RUN"
    if "${" in path:  # an interpolation (${now:...}): check the part before it
        path = path.split("${", 1)[0] + "RUN"
    check_writable(Path(path), "hydra.run.dir")


def _exit_interrupted(e: KeyboardInterrupt) -> None:
    print(e if isinstance(e, Interrupted) else Interrupted(), file=sys.stderr)
    sys.exit(130)


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so the pipeline removes its temporary folder; both are
    # remembered, so one that lands inside a native call still ends the run as an interrupt
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    args = sys.argv[1:]
    if not args:
        print(usage(), file=sys.stderr)
        sys.exit(2)
    if "-h" in args or "--help" in args:
        print(usage())
        sys.exit(0)
    try:
        sys.argv = [sys.argv[0]] + rewrite_argv(args)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        _exit_interrupted(e)

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(config_path=str(RECIPES), config_name="fp", version_base=None)
    def _run(cfg) -> None:
        from compress.recipe.pipeline import run  # heavy (torch, transformers): after the checks

        try:
            report = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except CompressError as e:
            log.error("%s", e)
            sys.exit(2)
        if "ppl" not in report:  # a process other than 0 of `accelerate launch`
            return
        print(
            f"ppl {report['ppl']:.3f}  kl {report.get('kl_vs_source', float('nan')):.4f}  "
            f"weight_bytes {report['weight_bytes']:,}  decode {report.get('decode_tok_s', float('nan')):.1f} tok/s  "
            f"elapsed {report['elapsed_s']:.0f}s"
        )

    try:
        _run()
    except KeyboardInterrupt as e:
        _exit_interrupted(e)


if __name__ == "__main__":
    main()
