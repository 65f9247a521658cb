"""The Python API beside ``python -m compress``: run a recipe, or quantize a model in memory.

``run(recipe, model=..., **overrides)`` is the CLI's run (same checks, same run folder)::

    result = compress.run("awq_int4", model="FOLDER_OR_HUB_ID", eval={"windows": 4})
    result.path, result.report["ppl"]

``quantize(model, config)`` swaps an HF model's decoder linears in place, as torchao's
``quantize_(model, config)`` does; ``save`` writes it as a run-folder checkpoint::

    compress.quantize(model, compress.RTNConfig(bits=4, group_size=128))
    compress.quantize(model, compress.AWQConfig(bits=4), tokenizer=tok)  # calibrates
    compress.quantize(model, compress.GPTQConfig(bits=3), tokenizer=tok)
    compress.save(model, "outputs/my_int4", tokenizer=tok)

A config's unset knobs take the values of the recipe it names (``recipes/NAME.yaml``).
"""

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from compress.arch.adapters import get_adapter
from compress.decoder.model import load as load_model
from compress.decoder.runtime import resolve_runtime
from compress.errors import CompressError
from compress.io.checkpoint import save_checkpoint, unquantized_dtype
from compress.io.data import check_source
from compress.io.manifest import write_manifest
from compress.io.run_folder import (
    atomic_dir,
    check_writable,
    commit_dir,
    lock_folder,
    no_space,
    sweep,
)
from compress.io.source import Source
from compress.recipe.config import check_sizes, needs_calibration
from compress.recipe.inputs import check_inputs, check_token_ids
from compress.recipe.overrides import compose
from compress.recipe.pipeline import Context
from compress.recipe.pipeline import run as run_pipeline
from compress.recipe.stages import get_stage


@dataclass
class RunResult:
    """A completed run: its folder and its report (``report.json``)."""

    path: Path
    report: dict


def override_value(value) -> str:
    """A Python value as Hydra's override grammar spells it (strings quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    # Hydra's quoted strings: backslashes escape only before a quote or the closing quote
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value)).replace("'", "\\'")
    return f"'{text}'"


def overrides_of(settings: dict, prefix: str = "") -> list[str]:
    """``{"eval": {"windows": 2}}`` -> ``["eval.windows=2"]``: a dict value is a config group."""
    out = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out += overrides_of(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={override_value(value)}")
    return out


def run(
    recipe: str, *overrides: str, model=None, out=None, verify: bool = True, **settings
) -> RunResult:
    """Run ``recipes/RECIPE.yaml`` on ``model`` (a folder or hub id; default: the recipe's) into
    ``out`` (default ``outputs/DATE_TIME_RECIPE``).

    ``overrides`` are CLI-style ``"KEY=VALUE"`` strings; ``settings`` are config keys or groups
    (``eval={"windows": 4}``, ``seed=1``). Both are checked before the model loads.
    ``verify=False`` (``model.verify=false``) skips checking a run folder given as ``model``
    against its manifest's hashes, for a folder edited on purpose.
    """

    if not isinstance(recipe, str):
        raise CompressError(
            f"run takes a recipe name such as 'awq_int4', not {type(recipe).__name__}."
        )
    bad = [o for o in overrides if not isinstance(o, str)]
    if bad:
        raise CompressError(
            f"run's positional overrides are 'KEY=VALUE' strings, not {type(bad[0]).__name__} "
            f"{bad[0]!r}; pass settings as keywords (eval={{'windows': 4}})."
        )
    extra = [*overrides, *overrides_of(settings)]
    if model is not None:
        extra.append(f"model.path={override_value(str(model))}")
    if not verify:
        extra.append("model.verify=false")
    cfg = compose(recipe, extra)
    out = (
        Path(out)
        if out is not None
        else Path("outputs") / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{cfg.name}"
    )
    report = run_pipeline(cfg, out)
    return RunResult(path=out, report=report)


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest, group-wise with a zero point (``rtn.*``), saved in ``format``
    (``quant.format``: compressed-tensors or autoawq)."""

    bits: int = 4
    group_size: int | str = "auto"  # auto: 128, else 64, else 32; -1: one scale per output row
    symmetric: bool = False
    format: str = "compressed-tensors"
    recipe: ClassVar[str] = "rtn_int4"
    stage: ClassVar[str] = "rtn"

    def overrides(self) -> list[str]:
        rtn = {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}
        return overrides_of({"rtn": rtn, "quant": {"format": self.format}})


@dataclass(frozen=True)
class _Calibrated:
    """A calibrating method's knobs (``STAGE.*``), on ``calib_samples`` x ``calib_seqlen``
    tokens, saved in ``format`` (``quant.format``)."""

    bits: int = 4
    group_size: int | str = "auto"
    calib_samples: int | None = None  # None: the recipe's (128 of 512 tokens)
    calib_seqlen: int | None = None
    options: dict = field(default_factory=dict)  # other STAGE.* keys
    format: str = "compressed-tensors"
    stage: ClassVar[str] = ""

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.options, dict):
            raise CompressError(
                f"{name}(options={self.options!r}): options is a dict of {self.stage}.* keys, "
                f"e.g. options={{'batch': 8}}."
            )
        for key, low in (("calib_samples", 1), ("calib_seqlen", 2)):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise CompressError(
                    f"{name}({key}={v!r}): {key} is an integer >= {low}, or None for the "
                    f"recipe's ({'128 samples' if low == 1 else '512 tokens'})."
                )

    def overrides(self) -> list[str]:
        calib = {
            k: v
            for k, v in (("samples", self.calib_samples), ("seqlen", self.calib_seqlen))
            if v is not None
        }
        knobs = {"bits": self.bits, "group_size": self.group_size, **self.options}
        return overrides_of(
            {
                self.stage: knobs,
                "quant": {"format": self.format},
                **({"calib": calib} if calib else {}),
            }
        )


@dataclass(frozen=True)
class AWQConfig(_Calibrated):
    """AWQ scale and clip search (``awq.*``; options: n_grid, clip, duo_scaling, ...)."""

    recipe: ClassVar[str] = "awq_int4"
    stage: ClassVar[str] = "awq"


@dataclass(frozen=True)
class GPTQConfig(_Calibrated):
    """GPTQ (``gptq.*``; options: damp, block_size, act_order, scale_search, min_range,
    true_sequential, batch)."""

    recipe: ClassVar[str] = "gptq_int4"
    stage: ClassVar[str] = "gptq"


@dataclass(frozen=True)
class Int8Config:
    """LLM.int8 (``llm_int8.*``): outlier input dims above ``threshold`` stay in full precision.

    ``outlier_stats`` records the per-layer outlier table, which needs calibration text.
    """

    threshold: float = 6.0
    outlier_stats: bool = False
    recipe: ClassVar[str] = "llm_int8"
    stage: ClassVar[str] = "llm_int8"

    def overrides(self) -> list[str]:
        return overrides_of(
            {"llm_int8": {"threshold": self.threshold, "outlier_stats": self.outlier_stats}}
        )


def quantize(model, config, tokenizer=None, calibration=None):
    """Quantize an HF model of the Llama family in place; returns it.

    ``calibration`` (methods that calibrate): token ids ``[samples, seqlen]``, or a text source
    (a file or datasets id) read with ``tokenizer``; default: the recipe's ``data.calib.source``.
    ``model.config.quantization_config`` is set to what ``save`` writes into config.json.
    """
    import torch

    if not hasattr(config, "overrides"):
        raise CompressError(
            f"quantize takes RTNConfig, AWQConfig, GPTQConfig or Int8Config, not "
            f"{type(config).__name__}."
        )
    given, model = model, unwrap(model)  # torch.compile's wrapper: quantize the module inside
    check_model(model, "quantize")
    check_not_quantized(model)
    extra = config.overrides()
    tokens = calibration if isinstance(calibration, torch.Tensor) else None
    if calibration is not None and tokens is None:
        extra.append(f"data.calib.source={override_value(str(calibration))}")
    cfg = compose(config.recipe, extra)
    check_sizes(cfg)
    get_stage(config.stage).check(cfg, model.config)
    if needs_calibration(cfg) and tokens is None:
        if tokenizer is None:
            raise CompressError(
                f"{type(config).__name__} calibrates on text: pass tokenizer=... (with "
                f"calibration=TEXT_FILE, or the default data.calib.source), or "
                f"calibration=token ids [samples, seqlen]."
            )
        check_source(cfg.data.calib.source, role="calib")
        check_inputs(cfg, tokenizer, roles=("calib",))
    if tokens is not None:
        check_token_ids(tokens, model.config.vocab_size)
    torch.manual_seed(cfg.seed)
    ctx = Context(cfg=cfg, tokenizer=tokenizer, calib_tokens=tokens)
    model = get_stage(config.stage).run(model, ctx)
    model.config.quantization_config = ctx.quantization_config
    return given.eval()


def unwrap(model):
    """The module inside ``torch.compile``'s wrapper (``_orig_mod``), whose parameter names are
    the model's own; ``model`` itself when it is not wrapped."""
    import torch

    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def check_model(model, what: str) -> None:
    """Refuse what is not a Hugging Face causal LM of a supported family (``adapters``), and a
    model whose weights hold no data (the meta device)."""

    config = getattr(model, "config", None)
    if not hasattr(model, "state_dict") or not hasattr(config, "to_diff_dict"):
        raise CompressError(
            f"{what} takes a Hugging Face causal LM (AutoModelForCausalLM.from_pretrained(...), "
            f"which has a .config), not {type(model).__name__}. Wrap a bare layer in a model, "
            f"or quantize a whole model."
        )
    get_adapter(config)  # an unsupported architecture gets the families compress knows
    tensors = [*model.parameters(), *model.buffers()] if hasattr(model, "parameters") else []
    meta = [t for t in tensors if t.is_meta]
    if meta:
        raise CompressError(
            f"{what}: {len(meta)} of the model's {len(tensors)} tensors are on the meta device "
            f"(shapes without data: built under init_empty_weights, torch.device('meta') or "
            f"device_map='meta'). Load the weights first, e.g. "
            f"AutoModelForCausalLM.from_pretrained(FOLDER)."
        )


def check_not_quantized(model) -> None:
    """Refuse a model with ``quantization_config`` set or decoder linears that are no longer
    ``nn.Linear`` (a quantized run folder loaded by ``checkpoint.load_run``)."""
    from torch import nn

    done = [
        f"{name} is {type(m).__name__}"
        for name, m in get_adapter(model.config).all_linears(model).items()
        if not isinstance(m, nn.Linear)
    ]
    if getattr(model.config, "quantization_config", None) or done:
        why = done[0] if done else "model.config.quantization_config is set"
        raise CompressError(
            f"this model is already quantized ({why}); quantizing it again would round "
            f"rounded weights. Quantize the full-precision model instead."
        )


def save(model, folder, tokenizer=None) -> Path:
    """Write ``model`` (quantized by ``quantize`` or not) as a checkpoint folder that
    ``compress.io.checkpoint.load_run`` and ``python -m compress.decoder`` read; a quantized model's
    unquantized tensors are saved as a recipe run saves them (``checkpoint.unquantized_dtype``).

    As a run writes its folder: claimed by a lock (another writer is refused), what killed
    writers into it left is removed first, written under a temporary name with a
    ``manifest.json`` (so loading verifies it) and renamed into place; a full disk is one
    paragraph and leaves nothing (``compress.io.run_folder``)."""
    import shutil

    model = unwrap(model)  # torch.compile's wrapper would prefix every name with _orig_mod.
    check_model(model, "save")
    if not isinstance(folder, (str, Path)) or not str(folder):
        raise CompressError(f"save takes a folder path, not {folder!r}.")
    folder = Path(folder)
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise CompressError(
            f"save's tokenizer is a transformers tokenizer (AutoTokenizer.from_pretrained(...)), "
            f"not {type(tokenizer).__name__}; or leave it out."
        )
    check_writable(folder, "the folder")
    with no_space(folder, "the folder"), lock_folder(folder, "the folder") as lock:
        sweep(folder, lock)
        if folder.exists() and any(folder.iterdir()):
            raise CompressError(f"'{folder}' already exists and is not empty; pick another folder.")
        qcfg = getattr(model.config, "quantization_config", None)
        tmp = atomic_dir(folder)
        try:
            qcfg = qcfg if isinstance(qcfg, dict) else None
            dtype = unquantized_dtype(model, getattr(model.config, "dtype", None)) if qcfg else None
            # unquantized tensors as a recipe run saves them
            save_checkpoint(model, tokenizer, tmp, qcfg, dtype)
            name = str(getattr(model.config, "name_or_path", "") or "")
            recipe = {"saved_by": "compress.save", "quantization_config": qcfg}
            write_manifest(tmp, recipe, Source(name, "", ""), {}, False)
            commit_dir(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def load(folder, device: str = "cpu", **settings):
    """``(model, tokenizer, runtime)``: a run folder (or an HF folder of a supported family)
    loaded in the built-in decoder's model, in the configuration ``python -m compress.decoder``
    resolves for it (``compress.decoder.runtime.resolve_runtime``): the fast choice for every
    setting not named in ``settings`` (dtype, qdtype, kernel, head, lean, compile, threads;
    a dtype as a string or a ``torch.dtype``). ``runtime.compile`` is what to pass as
    ``generate``'s ``compile``; ``threads`` is set at load. The model's ``generate`` is
    ``compress.decoder.generate.generate``."""
    if not Path(folder).is_dir():
        raise CompressError(f"'{folder}' is not a folder; pass a run folder or an HF folder.")
    settings = {
        k: str(v).removeprefix("torch.") if k.endswith("dtype") and v is not None else v
        for k, v in settings.items()
    }
    runtime = resolve_runtime(folder, device, settings)
    model, tok = load_model(folder, runtime=runtime)
    return model, tok, runtime
