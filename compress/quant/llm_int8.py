"""LLM.int8 (Dettmers et al. 2022): vector-wise int8 with mixed-precision outlier decomposition.

The method: every decoder linear becomes an ``Int8Linear`` (``compress.formats.int8_linear``
has bitsandbytes' on-disk layout and the forward's equations), with weights quantized per
output row and activation dims whose magnitude exceeds ``threshold`` kept in full precision.
Before quantizing, the ``llm_int8`` stage measures on calibration samples how many input dims
of each linear cross the threshold (:func:`outlier_stats`), and records it in the run.
"""

import torch
from torch import nn
from tqdm import tqdm

from compress.adapters import get_adapter, set_module
from compress.formats.int8_linear import Int8Linear, check_threshold


def quantization_config(threshold: float) -> dict:
    """config.json's ``quantization_config``, as transformers' ``BitsAndBytesConfig(load_in_8bit=True)``."""
    return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
            "llm_int8_threshold": threshold, "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": None, "llm_int8_enable_fp32_cpu_offload": False}


@torch.no_grad()
def outlier_stats(model: nn.Module, samples: torch.Tensor, threshold: float) -> dict:
    """Per decoder linear, how many input dims cross ``threshold`` on ``samples [n, seqlen]``, and how often.

    One sample at a time, hooks on the linears' inputs. Per layer: ``dims`` (distinct
    dims that ever crossed), ``dims_per_sample`` (mean |O| of a forward over one sample,
    i.e. the width of the fp path), ``sample_frac`` / ``token_frac`` (share of samples /
    tokens with any outlier), ``max_abs`` and ``top_dims`` ([dim, tokens crossing]).
    """
    linears = get_adapter(model.config).all_linears(model)
    hits = {name: torch.zeros(m.in_features, dtype=torch.int64) for name, m in linears.items()}
    acc = {name: {"outlier_dims": 0, "samples": 0, "tokens": 0, "max_abs": 0.0} for name in linears}

    last = {}  # q/k/v (and gate/up) get the same input tensor object: count it once

    def count(x: torch.Tensor):
        if last.get("x") is not x or last["version"] != x._version:  # holding x keeps its identity unique
            mag = x.detach().reshape(-1, x.shape[-1]).abs().float()
            over = mag > threshold
            per_dim = over.sum(dim=0).cpu()
            last.update(x=x, version=x._version, value=(
                per_dim, int((per_dim > 0).sum()), int(over.any(dim=1).sum()), float(mag.max())))
        return last["value"]

    def hook(name):
        def fn(module, args):
            per_dim, n_dims, tokens, max_abs = count(args[0])
            hits[name] += per_dim
            a = acc[name]
            a["outlier_dims"] += n_dims
            a["samples"] += n_dims > 0
            a["tokens"] += tokens
            a["max_abs"] = max(a["max_abs"], max_abs)
        return fn

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    try:
        for s in tqdm(samples, desc=f"llm_int8 outliers > {threshold:g}", unit="sample"):
            model(s.unsqueeze(0), use_cache=False)
    finally:
        for h in handles:
            h.remove()

    n, tokens = samples.shape[0], samples.numel()
    table = {}
    for name, h in hits.items():
        a = acc[name]
        top = torch.argsort(h, descending=True)[:5]
        table[name] = {
            "in_features": h.numel(), "dims": int((h > 0).sum()),
            "dims_per_sample": a["outlier_dims"] / n, "sample_frac": a["samples"] / n,
            "token_frac": a["tokens"] / tokens, "max_abs": round(a["max_abs"], 3),
            "top_dims": [[int(d), int(h[d])] for d in top if h[d] > 0],
        }
    return table


def quantize_model(model: nn.Module, threshold: float) -> nn.Module:
    """Replace every decoder linear by an ``Int8Linear`` (embeddings and head stay fp)."""
    for name, lin in get_adapter(model.config).all_linears(model).items():
        set_module(model, name, Int8Linear.from_linear(lin, threshold, name=name))
    return model


def llm_int8(model: nn.Module, ctx) -> nn.Module:
    """Stage: LLM.int8 with ``ctx.cfg.llm_int8`` = {threshold, outlier_stats}."""
    cfg = ctx.cfg.get("llm_int8") or {}
    threshold = check_threshold(cfg.get("threshold", 6.0))
    if threshold > 0 and cfg.get("outlier_stats", True):
        table = outlier_stats(model, ctx.calibration(), threshold)
        ctx.record["outliers"] = table
        ctx.record["outlier_summary"] = {
            "layers_with_outliers": sum(r["dims"] > 0 for r in table.values()),
            "layers": len(table),
            "mean_fp_dims_per_sample": sum(r["dims_per_sample"] for r in table.values()) / len(table),
        }
    ctx.record["threshold"] = threshold
    ctx.quantization_config = quantization_config(threshold)
    return quantize_model(model, threshold)
