"""Recipes on disk and ``KEY=VALUE`` overrides checked against them, before anything heavy loads.

A recipe is ``recipes/NAME.yaml``, a Hydra primary config on top of ``recipes/base.yaml``.
``check_overrides`` compares each ``KEY=VALUE`` with the composed recipe: an unknown key gets
the nearest known ones (difflib), a value of the wrong kind names the key and the kind it
takes. This module imports omegaconf and Hydra only, so ``python -m compress --help`` and a
mistyped override answer without importing torch or transformers;
``compress.recipe.config.validate`` then checks what the run needs.
"""

import difflib
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from compress.errors import CompressError

# recipes/ ships inside the installed package as compress/recipes (copied by setup.py); a
# checkout or editable install reads the top-level folder
_PACKAGE = Path(__file__).resolve().parent.parent
RECIPES = _PACKAGE / "recipes" if (_PACKAGE / "recipes").is_dir() else _PACKAGE.parent / "recipes"
_ABSENT = object()


def available(group: str | None = None) -> list[str]:
    """Recipe names (``group=None``), or the config names of a group folder (``model``...)."""
    folder = RECIPES / group if group else RECIPES
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "base")


def groups() -> list[str]:
    """Config group folders under ``recipes/`` (selected with ``GROUP=NAME``)."""
    return sorted(p.name for p in RECIPES.iterdir() if p.is_dir())


def summary(recipe: str) -> str:
    """The first comment line of ``recipes/NAME.yaml``: what the recipe does, in one line."""
    for line in (RECIPES / f"{recipe}.yaml").read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def check_recipe(recipe: str) -> None:
    if recipe not in available():
        raise CompressError(
            f"unknown recipe '{recipe}'. Available recipes: {', '.join(available())} "
            f"(files in recipes/). Run e.g. `python -m compress recipe=awq_int4`."
        )


def _stage_names() -> list[str]:
    from compress.recipe.stages import STAGES  # the methods, only for an unknown key's hint

    return list(STAGES)


def _compose(recipe: str, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
            return hydra_compose(
                config_name=recipe, overrides=list(overrides), return_hydra_config=with_hydra
            )
    except HydraException as e:  # what check_overrides could not foresee
        raise CompressError(f"recipe {recipe} with {' '.join(overrides)}: {e}") from None


def _leaves(node: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of a config that holds a value (not a group of keys)."""
    out = []
    for k, v in node.items_ex(resolve=False):
        if isinstance(v, DictConfig) and not v._is_none():
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def did_you_mean(key: str, known: list[str]) -> list[str]:
    """Known keys close to ``key`` (difflib's ratio), a key with the same last part ranking higher
    (quant.bits -> rtn.bits); the best and those almost as close."""
    leaf = key.rpartition(".")[2]

    def score(k: str) -> float:
        bonus = 0.2 if k.rpartition(".")[2] == leaf else 0.0
        return difflib.SequenceMatcher(None, key, k).ratio() + bonus

    ranked = sorted(((score(k), k) for k in known), reverse=True)
    if not ranked or ranked[0][0] < 0.6:
        return []
    return [k for s, k in ranked[:3] if s >= ranked[0][0] - 0.1]


_KINDS = (
    (bool, "true or false"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    ((list, ListConfig), "a list [a,b]"),
    ((dict, DictConfig), "a group of keys"),
)


def _kind(value) -> str:
    return next(name for t, name in _KINDS if isinstance(value, t))


def spell(value) -> str:
    """A value as an override writes it: true, null, [a,b]."""
    if isinstance(value, list):
        return "[" + ",".join(map(spell, value)) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fits(value, ref) -> bool:
    """Whether an override's ``value`` may replace the recipe's ``ref`` (null always may)."""
    if ref is None or value is None or (isinstance(value, str) and "${" in value):
        return True
    if isinstance(ref, bool) or isinstance(value, bool):
        return isinstance(ref, bool) and isinstance(value, bool)
    if isinstance(ref, int):
        return isinstance(value, int)
    if isinstance(ref, float):  # llm_int8.threshold also takes auto
        return isinstance(value, (int, float)) or value == "auto"
    if isinstance(ref, str):  # group_size: auto also takes 128
        return isinstance(value, (str, int, float))
    if isinstance(ref, (list, ListConfig)):
        return isinstance(value, list)
    return isinstance(value, dict)


# keys that take null although a recipe sets them: what null means is in the recipe's comment
NULLABLE = (
    "eval.windows",
    "eval.device",
    "awq.search_samples",
    "decode.threads",
    "prune.target_params",
    "prune.export.",
    "prune.calib.",
    "attn.kv_heads",
    "distill.data",
    "distill.checkpoint_dir",
    "hub.repo_id",
    "hub.revision",
    "iam.small",
)


def _nullable(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in NULLABLE)


def _refuse_removal(o, ref, recipe: str) -> None:
    """``~KEY``, or ``KEY=null`` where null means nothing: the run would read a missing value."""
    key = o.key_or_group
    if isinstance(ref, ListConfig):
        ref = OmegaConf.to_container(ref, resolve=False)
    if isinstance(ref, (DictConfig, dict)):
        keys = ", ".join(f"{key}.{k}" for k in list(ref)[:3])
        raise CompressError(
            f"{o.input_line}: {key} is a group of keys ({keys}, ...) that the run reads; set "
            f"one of them instead (`python -m compress recipe={recipe} --cfg job` prints them)."
        )
    if o.is_delete():
        raise CompressError(
            f"{o.input_line}: the run reads {key} (the recipe has {key}={spell(ref)}), so it "
            f"cannot be removed; set {key}=VALUE instead."
        )
    raise CompressError(
        f"{o.input_line}: {key} takes {_kind(ref)} (the recipe has {key}={spell(ref)}) and "
        f"has no null setting; give a value, or leave the override out to keep the recipe's."
    )


def _check_interpolations(cfg: DictConfig, parsed) -> None:
    """Resolve every override that interpolates (``${oc.env:NAME}``, ``${now:...}``) now, before
    Hydra or the run reads it (``${hydra:...}`` exists only once Hydra runs)."""
    from omegaconf.errors import OmegaConfBaseException

    todo = [
        o
        for o in parsed
        if isinstance(o.value(), str) and "${" in o.value() and "${hydra:" not in o.value()
    ]
    if not todo:
        return
    trial = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for o in todo:
        OmegaConf.update(trial, o.key_or_group, o.value(), merge=False, force_add=True)
    for o in todo:
        try:
            OmegaConf.select(trial, o.key_or_group, throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            raise CompressError(
                f"{o.input_line}: the interpolation cannot be resolved "
                f"({str(e).splitlines()[0]}). Set the environment variable it reads, give it a "
                f"default (${{oc.env:NAME,DEFAULT}}), or write the value itself."
            ) from None


def check_overrides(recipe: str, overrides: list[str]) -> None:
    """Refuse an override whose key the recipe lacks (with did-you-mean) or whose value is of the
    wrong kind, ``~KEY`` and ``KEY=null`` where the run needs a value, an interpolation that does
    not resolve, and a group selection (``model=NAME``) with no such config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    check_recipe(recipe)
    parser, parsed = OverridesParser.create(), []
    for line in overrides:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as e:
            raise CompressError(
                f"cannot read the override '{line}': {str(e).splitlines()[0]}. Write "
                f"KEY=VALUE (a list: KEY=[a,b]; quotes around text with spaces)."
            ) from None
    group_names = groups()
    selections = [o.input_line for o in parsed if o.key_or_group in group_names]
    for o in parsed:
        if o.key_or_group in group_names and o.is_delete():
            group = o.key_or_group
            raise CompressError(
                f"{o.input_line}: the run needs a {group} config; select another with "
                f"{group}=NAME ({', '.join(available(group))}) or set its keys ({group}.KEY=VALUE)."
            )
        if o.key_or_group in group_names:
            if o.value() not in available(o.key_or_group):
                group = o.key_or_group
                raise CompressError(
                    f"unknown {group} config '{o.value()}'. Available: "
                    f"{', '.join(available(group))} (files in recipes/{group}/). "
                    f"To use another model, keep the default config and "
                    f"set model.path=FOLDER_OR_HUB_ID."
                )
    cfg = _compose(recipe, selections, with_hydra=True)
    known = _leaves(cfg)
    for o in parsed:
        key = o.key_or_group
        if key in group_names or key.startswith("hydra/"):  # a group selection
            continue
        ref = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False)
        if o.is_add() and ref is not _ABSENT:
            raise CompressError(
                f"{o.input_line}: {key} is in the recipe already; write {key}=VALUE."
            )
        if ref is _ABSENT:  # compress reads only the recipe's keys, so '+key' adds nothing it reads
            near = did_you_mean(key, known)
            hint = f"; did you mean {' or '.join(near)}?" if near else "."
            group = key.partition(".")[0]
            if group not in cfg and group in _stage_names():  # a group only its stage brings
                hint += (
                    f" Recipe {recipe} runs the stages {list(cfg.stages)}; "
                    f"{group}.* is read by the {group} stage."
                )
            raise CompressError(
                f"unknown key '{key}' in recipe {recipe}{hint} `python -m compress "
                f"recipe={recipe} --cfg job` prints every key."
            )
        removal = o.is_delete() or (o.value() is None and ref is not None and not _nullable(key))
        if removal and not key.startswith("hydra."):
            _refuse_removal(o, ref, recipe)
        if o.is_delete() or o.is_sweep_override():
            continue
        if isinstance(ref, (DictConfig, ListConfig)):
            ref = OmegaConf.to_container(ref, resolve=False)
        value = o.value()
        if not _fits(value, ref):
            shown = spell(ref)
            raise CompressError(
                f"{o.input_line}: {key} takes {_kind(ref)} (the recipe has {key}={shown}), "
                f"not {_kind(value)} {value!r}."
            )
    _check_interpolations(cfg, parsed)


def compose(recipe: str, overrides=()) -> DictConfig:
    """The recipe's config with ``overrides`` (``KEY=VALUE`` strings), checked first."""
    check_overrides(recipe, list(overrides))
    return _compose(recipe, list(overrides))
