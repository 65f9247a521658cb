"""``python -m compress recipe=NAME [overrides...]``: run ``recipes/NAME.yaml``.

Every recipe is a Hydra primary config that starts from ``recipes/base.yaml``.
``recipe=NAME`` is rewritten to Hydra's ``--config-name NAME``, so
``--cfg job`` prints the resolved recipe and any key can be overridden
(``eval.windows=4``, ``model.path=...``, ``hydra.run.dir=DIR``).
"""

import logging
import signal
import sys
from pathlib import Path

from compress.errors import CompressError

# recipes/ ships inside the installed package as compress/recipes (pyproject's package-dir);
# a checkout or editable install reads the top-level folder
_PACKAGED = Path(__file__).resolve().parent / "recipes"
RECIPES = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "recipes"
log = logging.getLogger("compress")


def available(group: str | None = None) -> list[str]:
    folder = RECIPES / group if group else RECIPES
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "base")


def rewrite_argv(argv: list[str]) -> list[str]:
    """Turn ``recipe=NAME`` into ``--config-name NAME`` and check names before Hydra sees them."""
    out, recipe = [], "fp"
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            out.append(arg)
        if arg.startswith(("model=", "data=")):
            group, name = arg.split("=", 1)
            if name not in available(group):
                raise CompressError(
                    f"unknown {group} config '{name}'. Available: {', '.join(available(group))} "
                    f"(files in recipes/{group}/). To use another model, keep the default config and "
                    f"set model.path=FOLDER_OR_HUB_ID.")
    if recipe not in available():
        raise CompressError(f"unknown recipe '{recipe}'. Available recipes: {', '.join(available())} "
                            f"(files in recipes/). Run e.g. `python -m compress recipe=awq_int4`.")
    if any(a.startswith("--cfg") or a == "-c" for a in out) and "--resolve" not in out:
        out.append("--resolve")  # print the resolved recipe
    return ["--config-name", recipe] + out


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so the pipeline removes its temporary folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.argv = [sys.argv[0]] + rewrite_argv(sys.argv[1:])
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(config_path=str(RECIPES), config_name="fp", version_base=None)
    def _run(cfg) -> None:
        from compress.pipeline import run

        try:
            report = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except CompressError as e:
            log.error("%s", e)
            sys.exit(2)
        print(f"ppl {report['ppl']:.3f}  kl {report.get('kl_vs_source', float('nan')):.4f}  "
              f"weight_bytes {report['weight_bytes']:,}  decode {report.get('decode_tok_s', float('nan')):.1f} tok/s  "
              f"elapsed {report['elapsed_s']:.0f}s")

    _run()


if __name__ == "__main__":
    main()
