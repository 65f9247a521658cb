"""The recipe stages: ``recipes/NAME.yaml``'s ``stages: [...]`` names, each mapped to its function.

A stage is ``fn(model, ctx) -> model`` (``ctx``: ``compress.recipe.pipeline.Context``). Stage ``NAME``
reads its settings from the config group ``NAME`` (``rtn.*``, ``awq.*``, ``gptq.*``, ``llm_int8.*``,
``prune.*``, ``distill.*``, ``mla.*``, ``fit.*``, ``iam.*``, ``rotate.*``), except the attention conversions ``gqa`` and ``cla``,
which share ``attn.*`` (``attn.kv_heads=1 attn.share=2`` composes them); quantization stages spell their common knobs ``bits`` and
``group_size``. Each stage also has ``check(cfg, hf_config)``: it refuses its settings in milliseconds, before
any model loads (``hf_config`` is None when the model is not a local folder), so
``compress.recipe.config`` composes the checks and imports no method.
"""

from collections.abc import Callable
from dataclasses import dataclass

from compress.errors import CompressError
from compress.methods.attn import stage as attn
from compress.methods.distill import distill
from compress.methods.iam import stage as iam
from compress.methods.prune import stage as prune
from compress.methods.quant import awq, gptq, llm_int8, rotate, rtn


@dataclass(frozen=True)
class Stage:
    """A recipe stage: ``run(model, ctx) -> model`` and ``check(cfg, hf_config)``."""

    run: Callable
    check: Callable


STAGES = {
    "rotate": Stage(rotate.rotate, rotate.check),
    "rtn": Stage(rtn.rtn, rtn.check),
    "awq": Stage(awq.awq, awq.check),
    "gptq": Stage(gptq.gptq, gptq.check),
    "llm_int8": Stage(llm_int8.llm_int8, llm_int8.check),
    "prune": Stage(prune.prune, prune.check),
    "distill": Stage(distill.distill, distill.check),
    "gqa": Stage(attn.gqa, attn.check_gqa_stage),
    "cla": Stage(attn.cla, attn.check_cla_stage),
    "mla": Stage(attn.mla, attn.check_mla_stage),
    "fit": Stage(attn.fit, attn.check_fit_stage),
    "iam": Stage(iam.iam, iam.check),
}


def get_stage(name: str) -> Stage:
    """Stage ``name``."""
    if name not in STAGES:
        raise CompressError(
            f"unknown stage '{name}' in the recipe; known stages: {', '.join(STAGES)}."
        )
    return STAGES[name]
