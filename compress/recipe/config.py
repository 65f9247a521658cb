"""A composed recipe checked before any work; ``compress.recipe.overrides`` checked its overrides.

``validate(cfg)`` checks what the run will need (data files, the model path, group sizes, bit
widths, the decoder and Hub settings) in milliseconds, before the model loads.
"""

from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from compress.arch.hf_config import config_from_dict
from compress.arch.spec import spec_of
from compress.decoder.kv import KV_KINDS
from compress.errors import CompressError
from compress.eval.decode_speed import check_threads
from compress.io.data import check_source
from compress.io.source import check_path
from compress.kernels.w4a8_cpu import KERNELS
from compress.layers.head import check_head
from compress.recipe.hub import check_config
from compress.recipe.overrides import RECIPES, available, spell
from compress.recipe.stages import get_stage

if TYPE_CHECKING:
    import torch

QUANT_STAGES = ("rtn", "awq", "gptq")  # stages with ``bits`` and ``group_size``


def check_resolvable(cfg: DictConfig) -> None:
    """Every interpolation of the composed config resolves (an environment variable a recipe
    reads without a default is unset: found now, not when a stage reads the key)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "a key"
        raise CompressError(
            f"{key}: its interpolation cannot be resolved ({str(e).splitlines()[0]}). Set the "
            f"environment variable it reads, or override {key} with a value."
        ) from None


def _positive_int(cfg, key: str, null_ok=False, low=1, why="", group="") -> None:
    """``cfg[key]`` is an integer >= ``low`` (or null); ``group`` prefixes the key shown."""
    value = OmegaConf.select(cfg, key, default=None)
    if value is None and null_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        key = group + key
        raise CompressError(
            f"{key}={value!r}: {key} takes {kind}{' or null' if null_ok else ''}{why}."
        )


SEED_MAX = 2**64 - 1  # torch.manual_seed's largest seed


def check_sizes(cfg) -> None:
    """``seed`` and the token counts every run reads (``eval.*``, ``calib.*``)."""
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise CompressError(
            f"seed={seed!r}: the seed is an integer from 0 to 2**64-1 ({SEED_MAX}), the range "
            f"torch.manual_seed takes."
        )
    pairs = " (a window scores each token after the first: 2 tokens at least)"
    _positive_int(cfg, "eval.seqlen", low=2, why=pairs)
    _positive_int(cfg, "calib.seqlen", low=2, why=pairs.replace("a window scores", "a sample"))
    _positive_int(cfg, "calib.samples")
    _positive_int(cfg, "eval.windows", null_ok=True)


def _recipes_with(stage: str) -> list[str]:
    """Recipes whose ``stages:`` line names ``stage``."""
    out = []
    for name in available():
        for line in (RECIPES / f"{name}.yaml").read_text().splitlines():
            if line.startswith("stages:") and stage in line.split("#")[0]:
                out.append(name)
    return out


def check_stage_list(cfg) -> None:
    """Known stage names whose settings group the recipe has, each once, and at most one
    quantization stage, the last: what it writes (packed integer layers) no stage can
    quantize again or train. awq with ``awq.quantize=false`` quantizes nothing (it folds its
    scales into float weights) and needs a quantization stage after it."""

    stages = list(cfg.stages)
    for name in stages:
        get_stage(name)
        group = {"gqa": "attn", "cla": "attn"}.get(name, name)
        if not isinstance(cfg.get(group), DictConfig):
            has = ", ".join(_recipes_with(name)) or "none"
            raise CompressError(
                f"stages={spell(stages)}: the {name} stage reads its settings from {group}.*, "
                f"which recipe {cfg.name} does not have. Use a recipe that runs it ({has})."
            )
    shown = spell(stages)
    twice = [s for i, s in enumerate(stages) if s in stages[:i]]
    if twice:
        raise CompressError(
            f"stages={shown}: {twice[0]} is listed twice; a stage runs once, with the settings "
            f"of its group ({twice[0]}.*). List it once."
        )
    quant = quantizing_stages(cfg)
    later = [s for s in quant if stages.index(s) > stages.index("awq")] if "awq" in stages else []
    if "awq" in stages and "awq" not in quant and not later:
        raise CompressError(
            f"stages={shown}: awq.quantize=false folds AWQ's scales into float weights for a "
            f"later quantization stage, and none follows awq. Add one after it (stages=[awq,gptq] "
            f"or [awq,rtn]), or set awq.quantize=true."
        )
    if len(quant) > 1 or (quant and stages[-1] != quant[0]):
        hint = ""
        if quant[0] == "awq" and len(quant) > 1:
            hint = (
                f" (to quantize AWQ-scaled weights with {quant[1]}, set awq.quantize=false: awq "
                f"then folds its scales into float weights; recipes awq_gptq_int4, awq_gptq_int3)"
            )
        raise CompressError(
            f"stages={shown}: {quant[0]} replaces the linears by quantized ones, which no later "
            f"stage can quantize again or change. Use one of {', '.join(QUANTIZING_STAGES)}, "
            f"as the last stage{hint}."
        )


def quantizing_stages(cfg) -> list[str]:
    """The recipe's stages that replace the linears by quantized ones: the layer-wise ones, but
    awq with ``awq.quantize=false`` (its scales folded into float weights for a later stage)."""
    awq_quantizes = (cfg.get("awq") or {}).get("quantize", True) is not False
    return [s for s in cfg.stages if s in QUANTIZING_STAGES and (s != "awq" or awq_quantizes)]


def eval_device(name: str, key: str = "eval.device") -> "torch.device":
    """A device setting: ``auto`` is the GPU when there is one, else the CPU."""
    import torch

    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise CompressError(f"{key}={name}: use auto, cpu, or cuda.")
    if name == "cuda" and not torch.cuda.is_available():
        raise CompressError(
            f"{key}=cuda, but this machine has no usable GPU (torch.cuda.is_available() is "
            f"false: no device, no driver, or a CPU-only torch). Use {key}=auto or {key}=cpu."
        )
    return torch.device(name)


def recipe_device(cfg) -> "torch.device":
    """``device``: where every calibration runs, one decoder layer at a time (auto, cpu, cuda)."""
    return eval_device(cfg.get("device", "auto"), "device")


def run_eval_device(cfg) -> "torch.device":
    """``eval.device`` when set (an override), else the recipe's ``device``."""
    name = cfg.eval.get("device")
    return eval_device(name, "eval.device") if name not in (None, "") else recipe_device(cfg)


DISTRIBUTED_STAGES = ("distill",)  # split across the processes of `accelerate launch`
# deterministic: every process computes the same
REPEATED_STAGES = ("prune", "gqa", "cla", "mla", "fit")


def check_distributed(cfg) -> int:
    """The number of processes (``WORLD_SIZE``, set by ``accelerate launch``/torchrun); refuse,
    before any work, a recipe with a stage that runs in one process only."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return world
    alone = [s for s in cfg.stages if s not in DISTRIBUTED_STAGES + REPEATED_STAGES]
    if alone or "distill" not in cfg.stages:
        what = f"its stage(s) {alone} run" if alone else "it has no distill stage, so it runs"
        raise CompressError(
            f"`accelerate launch` started {world} processes, but recipe {cfg.name}: {what} in "
            f"one process (only distill splits across processes; {', '.join(REPEATED_STAGES)} "
            f"are repeated by each). Run it with `python -m compress recipe={cfg.name} ...` "
            f"(one process; device=cuda puts calibration on the GPU)."
        )
    get_stage("distill").check(cfg, None)  # its settings for the processes (FSDP's compile)

    return world


# stages that replace the linears by quantized ones (awq unless awq.quantize=false)
QUANTIZING_STAGES = ("rtn", "awq", "gptq", "llm_int8")
LAYERWISE_STAGES = ("rotate", *QUANTIZING_STAGES)  # stages that work one decoder layer at a time


def layerwise(cfg) -> bool:
    """Whether the recipe has stages and every one works one decoder layer at a time (llm_int8
    with a numeric threshold: ``auto`` compares whole-model perplexities)."""
    int8 = cfg.get("llm_int8") or {}
    if "llm_int8" in cfg.stages and int8.get("threshold", 6.0) == "auto":
        return False
    return bool(cfg.stages) and all(s in LAYERWISE_STAGES for s in cfg.stages)


def check_offload(cfg) -> str:
    """``offload``: auto, disk or host."""
    value = cfg.get("offload", "auto")
    if value not in ("auto", "disk", "host"):
        raise CompressError(
            f"offload={value}: use auto (the source's decoder layers stay on disk when every "
            f"stage works layer by layer), disk (require that), or host (load the whole model)."
        )
    if value == "disk" and not layerwise(cfg):
        raise CompressError(
            f"offload=disk, but the stages {list(cfg.stages)} need the whole model in memory "
            f"(only {', '.join(LAYERWISE_STAGES)} work one layer at a time; llm_int8 with a "
            f"numeric threshold). Use offload=auto or offload=host."
        )
    return value


def validate(cfg: DictConfig) -> None:
    """Everything a run can check before loading the model: costs milliseconds."""

    check_resolvable(cfg)
    check_stage_list(cfg)
    check_distributed(cfg)
    check_sizes(cfg)
    if cfg.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise CompressError(
            f"model.dtype={cfg.model.dtype}: use auto (the stored dtype), float32, bfloat16 or "
            f"float16."
        )
    check_offload(cfg)

    config = check_path(str(cfg.model.path))
    hf_config = None
    if config is not None:
        hf_config = config_from_dict(config, str(cfg.model.path))
        spec_of(hf_config)  # the decoder's own checks: a family or layout it cannot run
        check_experts(cfg, hf_config)
    for name in cfg.stages:  # each stage refuses its own settings
        get_stage(name).check(cfg, hf_config)
    check_source(cfg.data.eval.source, role="eval")
    if needs_calibration(cfg):
        check_source(cfg.data.calib.source, role="calib")

    recipe_device(cfg)
    run_eval_device(cfg)

    head = (cfg.get("quant") or {}).get("lm_head", "none")
    check_head(head)
    if head != "none" and "iam" in cfg.stages:
        raise CompressError(
            f"quant.lm_head={head} with the iam stage: the IAM pair is evaluated with the heads "
            f"as stored. Leave quant.lm_head=none for an iam recipe."
        )
    if cfg.decode.enabled:
        check_decode(cfg.decode)

    check_config(cfg.get("hub"))
    if hf_config is not None:
        check_positions(cfg, hf_config)


EXPERT_STAGES = ("rtn", "awq", "gptq")  # the stages that reach every expert (layers.experts)
WHY_NOT_EXPERTS = {
    "llm_int8": "bitsandbytes' int8 layers hold only nn.Linear, and transformers keeps experts "
    "fused, so they would stay in 16 bits (bitsandbytes issue 1849); no int8 expert format "
    "loads in transformers",
    "prune": "on a mixture-of-experts model prune takes prune.experts.keep and "
    "prune.experts.intermediate_size (recipe=minitron_experts), which are not set",
    "gqa": "attention conversion of mixture-of-experts models is not built",
    "cla": "attention conversion of mixture-of-experts models is not built",
    "mla": "attention conversion of mixture-of-experts models is not built",
    "fit": "attention conversion of mixture-of-experts models is not built",
    "iam": "IAM's attention mapping is not built for mixture-of-experts models",
}


def check_experts(cfg, hf_config) -> None:
    """Refuse, on a mixture-of-experts model, a stage that does not reach the experts (it would
    leave them in full precision), and an RTN scheme transformers cannot load for experts."""
    if spec_of(hf_config).moe is None or not cfg.stages:
        return
    prunes = "prune" in cfg.stages and any(
        v is not None for v in dict(cfg.prune.get("experts") or {}).values()
    )
    reach = EXPERT_STAGES + ("rotate", "distill") + (("prune",) if prunes else ())
    other = [s for s in cfg.stages if s not in reach]
    if other:
        why = WHY_NOT_EXPERTS.get(other[0], "it does not reach experts yet")
        raise CompressError(
            f"stages={spell(list(cfg.stages))} on '{hf_config.model_type}', a mixture-of-experts "
            f"model: {other[0]} cannot run there ({why}); of the quantizers only "
            f"{', '.join(EXPERT_STAGES)} reach every expert yet. Use recipe=awq_int4 "
            f"awq.symmetric=true (or rtn_int4 / gptq_int4 with symmetric=true), or recipe=fp "
            f"to evaluate the model as it is."
        )
    if not set(cfg.stages) & set(EXPERT_STAGES):
        return  # prune and distill write float folders
    fmt = (cfg.get("quant") or {}).get("format") or "compressed-tensors"
    if fmt != "compressed-tensors":
        raise CompressError(
            f"quant.format={fmt} on a mixture-of-experts model: only the compressed-tensors "
            f"format stores experts (one tensor per expert); leave quant.format at its default."
        )
    for stage in cfg.stages:
        if stage not in EXPERT_STAGES or cfg[stage].get("symmetric", False):
            continue
        raise CompressError(
            f"{stage}.symmetric=false on '{hf_config.model_type}', a mixture-of-experts model: "
            f"transformers' compressed-tensors loader decompresses experts without zero points "
            f"(transformers 5.25, integrations/compressed_tensors.py), so an asymmetric "
            f"folder would not load there. Add {stage}.symmetric=true (llm-compressor's W4A16)."
        )
    if spec_of(hf_config).adapter.expert_layout != "fused":
        raise CompressError(
            f"stages={spell(list(cfg.stages))} on '{hf_config.model_type}': {hf_config.model_type}'s "
            f"experts (gate_up_proj [E, hidden, 2 x width] with gate and up interleaved, biases, "
            f"the clamped SwiGLU) are not split into per-expert linears by compress's quantizers "
            f"yet, and transformers reads them only fused, so no per-expert quantized folder of "
            f"it would load. Use recipe=fp to evaluate and serve it as it is."
        )


def check_positions(cfg, hf_config) -> None:
    """Sequence lengths within the model's ``max_position_embeddings`` (config.json): a window
    beyond it is scored at positions the model never had; the decoder's prompt and prefill
    (the start of the first eval window) must leave room for a generated token."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 2:
        return
    lengths = [("eval.seqlen", cfg.eval.seqlen)]
    if needs_calibration(cfg):
        lengths.append(("calib.seqlen", cfg.calib.seqlen))
    if "distill" in cfg.stages:
        lengths.append(("distill.seqlen", cfg.distill.get("seqlen", 512)))
    for key, n in lengths:
        if n > limit:
            raise CompressError(
                f"{key}={n} is beyond the model's max_position_embeddings={limit} "
                f"(config.json of {cfg.model.path}): it would run positions the model was never "
                f"trained on. Use {key}={limit} or less."
            )
    if cfg.decode.enabled:
        for key in ("decode.prompt_tokens", "decode.prefill_tokens"):
            n = min(OmegaConf.select(cfg, key), cfg.eval.seqlen)
            if n >= limit:
                raise CompressError(
                    f"{key}: the decoder's prompt of {n} tokens (the start of the first eval "
                    f"window) fills the model's max_position_embeddings={limit}, leaving no "
                    f"position to generate in. Set {key}={limit - 1} or less."
                )


def needs_calibration(cfg) -> bool:
    """Whether a stage of the recipe reads calibration text."""
    int8 = cfg.get("llm_int8") or {}
    int8_calib = (
        "llm_int8" in cfg.stages
        and int8.get("outlier_stats", True)
        and int8.get("threshold", 6.0) != 0
    )
    return int8_calib or bool({"awq", "gptq", "prune", "distill", "iam", "fit"} & set(cfg.stages))


def check_decode(dcfg) -> None:
    """Refuse a ``decode`` group the decoder cannot run."""

    if dcfg.kv not in KV_KINDS or dcfg.dtype not in ("float32", "bfloat16", "float16"):
        raise CompressError(
            f"decode.kv={dcfg.kv}, decode.dtype={dcfg.dtype}: use kv one of {list(KV_KINDS)} "
            f"and dtype float32, bfloat16 or float16 (or decode.enabled=false)."
        )
    off = "; or decode.enabled=false to skip the decoder's figures"
    for key in ("prompt_tokens", "prefill_tokens"):
        _positive_int(dcfg, key, why=off, group="decode.")
    first = " (decode_tok_s times the tokens after the first)"
    _positive_int(dcfg, "new_tokens", low=2, why=first + off, group="decode.")
    if dcfg.get("compile") and dcfg.kv not in ("fp16", "full"):
        raise CompressError(
            f"decode.compile=true with decode.kv={dcfg.kv}: the compiled decode step keeps an "
            f"uncompressed cache. Use decode.kv=fp16 (or full) to measure it compiled, or "
            f"decode.compile=false to measure the {dcfg.kv} cache."
        )

    kernel = dcfg.get("kernel", "exact")
    if kernel not in KERNELS:
        raise CompressError(
            f"decode.kernel={kernel}: the quantized layers compute exactly (exact, weight-only) "
            f"or with int8 activations (w4a8, whose ppl cost the evaluation then reports); use "
            f"one of {', '.join(KERNELS)}."
        )
    if dcfg.get("lean") and dcfg.dtype != "bfloat16" and kernel == "exact":
        raise CompressError(
            f"decode.lean=true keeps only the bfloat16 int4pack form of the int layers, so it "
            f"needs decode.dtype=bfloat16 (got {dcfg.dtype}); or set decode.lean=false."
        )

    check_threads(dcfg.get("threads", 1))
