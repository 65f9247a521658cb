"""LLM.int8 (Dettmers et al. 2022): vector-wise int8 with mixed-precision outlier decomposition.

For one linear layer ``y = x W^T + b``, ``x [M, K]`` (M tokens), ``W [N, K]``::

    weights (offline):  c_w[n] = max_k |W[n, k]|              W_i8 = round(127 * W / c_w)
    outlier dims:       O = {k : max_m |x[m, k]| > a}          a = threshold, default 6.0
    activations:        c_x[m] = max_{k not in O} |x[m, k]|    x_i8 = round(127 * x / c_x), dims O zeroed
    y = (x_i8 W_i8^T)[m, n] * c_x[m] * c_w[n] / 127^2          int8 x int8 -> int32, scaled in the epilogue
      + x[:, O] (W_i8[:, O] * c_w / 127)^T                     full precision, dequantized weight columns
      + b

``threshold = 0`` turns the decomposition off: O is empty and every dim goes
through int8 (pure vector-wise int8, the paper's "Int8 vector-wise" baseline).
The outlier dims are found and gathered once per forward with tensor ops.

When gradients are needed (``x.requires_grad``), the layer computes ``x W_hat^T + b``
in x's dtype instead, since the int8 product has no backward.

On disk, the layer is bitsandbytes' ``Linear8bitLt`` state_dict (what
transformers writes and reads for ``load_in_8bit``)::

    {prefix}weight         int8    [out, in]   W_i8, row-major
    {prefix}SCB            float32 [out]       c_w, the absmax of each output row
    {prefix}weight_format  uint8   []          0 (row-major)
    {prefix}bias           float32 [out]       optional

    config.json "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": true,
                                        "llm_int8_threshold": a, ...}

Like bitsandbytes (``Int8Params``), the weight is rounded to fp16 before it is
quantized, so ``weight`` and ``SCB`` are bit-identical to bitsandbytes' for the
same fp weights. An all-zero row gets ``SCB`` 0 and codes 0; no scale divides by it.

Where the forward differs from bitsandbytes' (well within 1e-2 of each other):
activations are quantized from fp32 (bitsandbytes casts them to fp16 first);
``c_x`` ignores the outlier dims entirely (bitsandbytes zeroes only the
entries >= a, so smaller entries of an outlier dim still widen ``c_x``); a dim
is an outlier when some |x| > a (bitsandbytes: >= a).

Kernels: ``torch._int_mm`` on the CPU (``compress.kernels.int8_cpu``), the
Triton GEMM with the fused epilogue on CUDA (``compress.kernels.int8_matmul``).

``threshold = auto`` measures it: on windows of calibration text (``calib``, validation text,
never the test windows), the candidates are tried from the largest down and the first whose
perplexity is within ``auto_tolerance`` (0.5%) of the source's is kept, i.e. the largest such
threshold: the fewest dims in the fp path at the quality asked for::

    a* = max { a in candidates : ppl(a) <= (1 + tolerance) * ppl(source) }

When none is, the candidate with the lowest perplexity is kept, and the report says so.
"""

import copy
import math

import torch
from torch import nn
from tqdm import tqdm

from compress.adapters import get_adapter, set_module
from compress.errors import CompressError


_TINY = 127.0 / torch.finfo(torch.float32).max  # below it 127 / c_x would overflow to inf


def check_threshold(threshold) -> float:
    """``threshold`` as a float >= 0, or a CompressError that names the fix."""
    ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if not ok or not math.isfinite(threshold) or threshold < 0:
        raise CompressError(
            f"the LLM.int8 threshold must be a number >= 0, got {threshold!r}. LLM.int8's default is 6.0; "
            f"0 turns the outlier decomposition off (pure vector-wise int8). Set it in the recipe "
            f"(llm_int8.threshold=6.0) or in config.json (quantization_config.llm_int8_threshold).")
    return float(threshold)


def quantize_rowwise(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_i8 [N, K] int8, SCB [N] float32)``: absmax per output row, via fp16 as bitsandbytes does."""
    w16 = w.detach().to(torch.float16)
    if not torch.isfinite(w16).all():
        raise CompressError(f"weight of '{name}' has NaN, inf or values beyond fp16's range (65504), "
                            f"which bitsandbytes' int8 format cannot hold; check the source checkpoint.")
    scb = w16.abs().amax(dim=1).float()
    scale = torch.where(scb > 0, 127.0 / scb, 0.0)  # an all-zero row: codes 0, SCB 0
    return torch.round(w16 * scale[:, None]).to(torch.int8), scb


def quantize_activations(x: torch.Tensor, threshold: float, name: str = "layer"):
    """Per-token int8 of ``x [M, K]``'s non-outlier dims: ``(x_i8 [M, K], c_x [M], outlier dims or None)``.

    Raises a CompressError naming ``name`` when ``x`` holds NaN or inf.
    """
    xf = x.float()
    mag = xf.abs()
    outliers = None
    if threshold > 0:
        col_max = mag.amax(dim=0)
        _check_finite(col_max, name)
        outliers = (col_max > threshold).nonzero().squeeze(1)
        if outliers.numel():
            mag.index_fill_(1, outliers, 0.0)  # touches the outlier columns only
        else:
            outliers = None
    c_x = mag.amax(dim=1)
    if threshold == 0:
        _check_finite(c_x, name)
    scaled = xf * torch.where(c_x > _TINY, 127.0 / c_x, 0.0)[:, None]  # a zero (or subnormal) token: 0
    if outliers is not None:
        scaled.index_fill_(1, outliers, 0.0)  # their share goes through the fp path
    return scaled.round_().to(torch.int8), c_x, outliers


def _check_finite(t: torch.Tensor, name: str) -> None:
    if not torch.isfinite(t).all():
        raise CompressError(
            f"the input of '{name}' contains NaN or inf. An earlier layer overflowed or the input is "
            f"corrupt; LLM.int8 refuses to quantize it rather than return a NaN perplexity. Check the "
            f"source model in fp32 on the same input.")


def int8_matmul_dequant(a, b, row_absmax, col_absmax, bias=None, out_dtype=torch.float32):
    """``(a @ b.T) * row_absmax[:, None] * col_absmax / 127^2 + bias``: Triton on CUDA, ``_int_mm`` on CPU."""
    if a.is_cuda:
        from compress.kernels.int8_matmul import int8_matmul_dequant_triton as fn
    else:
        from compress.kernels.int8_cpu import int8_matmul_dequant_cpu as fn
    return fn(a, b, row_absmax, col_absmax, bias, out_dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None = None,
                threshold: float = 6.0, name: str = "layer") -> torch.Tensor:
    """LLM.int8's ``x [M, K] @ W_hat^T + b`` -> ``[M, N]`` in ``x.dtype`` (see the module docstring)."""
    x_i8, c_x, outliers = quantize_activations(x, threshold, name)
    y = int8_matmul_dequant(x_i8, weight, c_x, scb, bias)
    if outliers is not None:
        w_cols = weight[:, outliers].float() * (scb.float() / 127.0)[:, None]  # [N, |O|], dequantized
        y.addmm_(x[:, outliers].float(), w_cols.t())
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer in bitsandbytes' int8 format (buffers ``weight``, ``SCB``, ``weight_format``, ``bias``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, threshold: float = 6.0,
                 device=None, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.threshold = check_threshold(threshold)
        self.name = name  # for error messages
        self.format_checked = False
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("SCB", torch.zeros(out_features, dtype=torch.float32, device=device))
        self.register_buffer("weight_format", torch.tensor(0, dtype=torch.uint8, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float = 6.0, name: str = "") -> "Int8Linear":
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    threshold=threshold, device=linear.weight.device, name=name)
        layer.weight, layer.SCB = quantize_rowwise(linear.weight, name or "linear")
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """``W_hat [out, in] = W_i8 * SCB / 127``."""
        return (self.weight.to(dtype) * (self.SCB.to(dtype) / 127.0)[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.format_checked:  # once: the codes are read as row-major
            if int(self.weight_format) != 0:
                raise CompressError(
                    f"'{self.name}' has weight_format {int(self.weight_format)}; compress reads only 0 "
                    f"(row-major int8), which bitsandbytes >= 0.45 writes. Re-save the checkpoint with it.")
            self.format_checked = True
        if x.requires_grad and torch.is_grad_enabled():  # int8 has no backward: go through W_hat, as
            bias = None if self.bias is None else self.bias.to(x.dtype)  # bitsandbytes does on the CPU
            return nn.functional.linear(x, self.dequantize(x.dtype), bias)
        y = int8_linear(x.reshape(-1, self.in_features), self.weight, self.SCB, self.bias,
                        self.threshold, self.name or "an Int8Linear layer")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}"


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


def score(model: nn.Module, windows: torch.Tensor, make, compare: bool = True, desc: str = "eval",
          cache=None, source_sha: str = "") -> dict:
    """``evaluate`` figures of ``make(copy of model)`` on ``windows [n, seqlen]``; with ``compare``,
    KL and top-1 against ``model`` itself (``model`` is left as it is)."""
    from compress.eval.perplexity import evaluate

    return evaluate(make(copy.deepcopy(model)), windows, model if compare else None, desc=desc,
                    cache=cache, source_sha=source_sha)


def check_candidates(candidates, tolerance) -> tuple[list[float], float]:
    """``auto``'s settings, validated: candidates largest first, and the tolerance."""
    def number(a) -> bool:
        return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)

    if not candidates or not all(number(a) and a > 0 for a in candidates):
        raise CompressError(f"llm_int8.auto_candidates={candidates!r}: give a list of thresholds "
                            f"> 0, e.g. [8.0, 6.0, 4.0, 3.0, 2.0, 1.0].")
    if not number(tolerance) or not 0 < tolerance < 1:
        raise CompressError(f"llm_int8.auto_tolerance={tolerance!r}: give the allowed relative "
                            f"perplexity increase over the source, a number in (0, 1), e.g. 0.005 "
                            f"for 0.5%.")
    return sorted({float(a) for a in candidates}, reverse=True), float(tolerance)


def choose_threshold(model: nn.Module, windows: torch.Tensor, candidates, tolerance: float = 0.005):
    """``(threshold, reason, record)``: the largest candidate whose perplexity on ``windows`` is
    within ``tolerance`` of ``model``'s (see the module docstring), why, and the perplexities
    tried."""
    candidates, tolerance = check_candidates(candidates, tolerance)
    source = score(model, windows, lambda m: m, compare=False, desc="llm_int8 auto: source")["ppl"]
    where = f"{len(windows)} calibration windows of {windows.shape[1]} tokens"
    tried = {}
    for a in candidates:
        tried[a] = score(model, windows, lambda m, a=a: quantize_model(m, a), compare=False,
                         desc=f"llm_int8 auto: t={a:g}")["ppl"]
        if tried[a] <= (1 + tolerance) * source:
            chosen = a
            reason = (f"largest of {candidates} whose ppl on {where} ({tried[a]:.4f}) is within "
                      f"{tolerance:.2%} of the source's ({source:.4f})")
            break
    else:
        chosen = min(tried, key=tried.get)
        reason = (f"no candidate of {candidates} is within {tolerance:.2%} of the source's ppl "
                  f"({source:.4f}) on {where}; kept the lowest ppl ({tried[chosen]:.4f})")
    record = {"source_ppl": source, "tolerance": tolerance,
              "ppl": {f"{a:g}": p for a, p in tried.items()}}
    return chosen, reason, record


def check_settings(cfg) -> float | str:
    """The ``llm_int8`` group's threshold, validated: a number >= 0, or ``auto`` with valid
    ``auto_candidates`` and ``auto_tolerance``. Cheap: for config checks before any work."""
    threshold = (cfg or {}).get("threshold", 6.0)
    if isinstance(threshold, str) and threshold != "auto":
        raise CompressError(f"llm_int8.threshold={threshold!r}: give a number >= 0 (6.0 is "
                            f"LLM.int8's default, 0 turns the decomposition off) or auto "
                            f"(measured on calibration text).")
    if threshold == "auto":
        check_candidates(list(cfg.get("auto_candidates") or []), cfg.get("auto_tolerance", 0.005))
        return threshold
    return check_threshold(threshold)


def llm_int8(model: nn.Module, ctx) -> nn.Module:
    """Stage: LLM.int8 with ``ctx.cfg.llm_int8`` = {threshold (a number or auto), outlier_stats,
    auto_candidates, auto_tolerance}."""
    cfg = ctx.cfg.get("llm_int8") or {}
    threshold = check_settings(cfg)
    if threshold == "auto":
        candidates, tolerance = check_candidates(list(cfg.get("auto_candidates") or []),
                                                 cfg.get("auto_tolerance", 0.005))
        threshold, reason, record = choose_threshold(model, ctx.calibration(), candidates,
                                                     tolerance)
        ctx.record["llm_int8_auto"] = record
    else:
        reason = "set in the recipe (llm_int8.threshold)"
    ctx.record["llm_int8_threshold"], ctx.record["llm_int8_threshold_reason"] = threshold, reason
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
