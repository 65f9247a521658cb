"""The recipe stages: ``recipes/NAME.yaml``'s ``stages: [...]`` names, each mapped to its function.

A stage is ``fn(model, ctx) -> model`` (``ctx``: ``compress.pipeline.Context``). Stage ``NAME``
reads its settings from the config group ``NAME`` (``rtn.*``, ``awq.*``, ``llm_int8.*``,
``prune.*``, ``distill.*``, ``mla.*``, ``iam.*``), except the attention conversions ``gqa`` and ``cla``,
which share ``attn.*`` (``attn.kv_heads=1 attn.share=2`` composes them); quantization stages spell their common knobs ``bits`` and
``group_size``. Every stage module is imported here: together they add about 15 ms to
``import compress.pipeline`` (``python -X importtime -c "import compress.stages"``).
"""

from compress.attn.stage import cla, gqa, mla
from compress.errors import CompressError
from compress.iam.stage import iam
from compress.prune.stage import prune
from compress.quant.awq import awq
from compress.quant.llm_int8 import llm_int8
from compress.quant.rtn import rtn
from compress.train.distill import distill

STAGES = {
    "rtn": rtn,
    "awq": awq,
    "llm_int8": llm_int8,
    "prune": prune,
    "distill": distill,
    "gqa": gqa,
    "cla": cla,
    "mla": mla,
    "iam": iam,
}


def get_stage(name: str):
    """The function of stage ``name``."""
    if name not in STAGES:
        raise CompressError(
            f"unknown stage '{name}' in the recipe; known stages: {', '.join(STAGES)}."
        )
    return STAGES[name]
