"""The ``prune`` stage: importance on calibration text (cached), target sizes, slicing.

Recipe keys (``prune.*``)::

    export:         explicit sizes, as in ModelOpt's mcore_minitron export_config: hidden_size,
                    intermediate_size, num_attention_heads, num_key_value_heads, num_hidden_layers
                    (unset = the source's; num_key_value_heads alone keeps the heads per group)
    target_params:  a parameter budget over the width axes not set in export: a fraction of the
                    source (0.7) or a count (95e6); null = explicit sizes only
    axes:           the width axes the budget may shrink (default [hidden_size, intermediate_size])
    round:          step of hidden/intermediate sizes the budget picks (64; hidden sizes are also
                    multiples of the head count where the config demands it)
    tolerance:      the budget solver's candidates lie within this fraction below the target (0.03)
    depth_metric:   block (1 - cos) | ppl (perplexity drop; needs ppl_samples > 0)
    ppl_samples:    calibration samples for the ppl-drop score (0: not computed)
    calib:          samples / seqlen / batch_size of the importance pass (null = calib.*)
    cache:          keep scores in ~/.cache/compress/importance/ (true)
    experts:        a mixture-of-experts model's pruning (``experts.py``): keep (experts per
                    sparse layer: a count >= top-k, or a fraction) and intermediate_size (each
                    expert's width: a count or a fraction); null = the source's. The other
                    axes stay the source's there.

The scores go into the run folder as ``importance/scores.safetensors`` (a subfolder, so
that loaders globbing ``*.safetensors`` see only the model); report.json gets
``params``, ``source_params`` and ``prune`` (sizes, kept layers).
"""

import atexit
import hashlib
import logging
import shutil
import tempfile
import time
from pathlib import Path

from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.io.data import calib_samples, read_text
from compress.io.source import cache_dir
from compress.methods.prune import experts as moe_prune
from compress.methods.prune.importance import cached_importance, save_scores
from compress.methods.prune.prune import (
    AXES,
    check_sizes,
    keep_indices,
    layout_of,
    param_count,
    param_total,
    prune_model,
    resolve_target,
    sizes_of,
    solve_budget,
)

log = logging.getLogger(__name__)


def _given(value, default):
    """A setting, or ``default`` where it is null (0 is a value, not "unset")."""
    return default if value is None else value


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def expert_settings(p) -> dict | None:
    """``prune.experts`` where it asks for anything (keep or intermediate_size set), else None."""
    experts = dict(p.get("experts") or {})
    unknown = sorted(set(experts) - {"keep", "intermediate_size"})
    if unknown:
        raise CompressError(
            f"prune.experts has unknown keys {unknown}; it takes keep and intermediate_size."
        )
    return experts if any(v is not None for v in experts.values()) else None


def check(cfg, hf_config=None) -> None:
    """Refuse, before the model loads, ``prune.*`` numbers the stage would replace or fail on
    after the calibration pass."""
    p = cfg.prune
    experts = expert_settings(p)
    moe = spec_of(hf_config).moe if hf_config is not None else None
    dense_axes = p.get("target_params") is not None or any(
        v is not None for v in dict(p.get("export") or {}).values()
    )
    if moe is not None and (experts is None or dense_axes):
        raise CompressError(
            f"prune on '{hf_config.model_type}': a mixture-of-experts model is pruned by "
            f"prune.experts.keep (experts per layer) and prune.experts.intermediate_size "
            f"(each expert's width) alone (recipe=minitron_experts); prune.export and "
            f"prune.target_params are for dense models."
        )
    if experts is not None and hf_config is not None:
        moe_prune.target(hf_config, experts)  # refuses a dense model too
    c = p.get("calib") or {}
    rules = (
        ("round", p.get("round"), 1, False),
        ("ppl_samples", p.get("ppl_samples"), 0, True),
        ("calib.samples", c.get("samples"), 1, True),
        ("calib.seqlen", c.get("seqlen"), 2, True),
        ("calib.batch_size", c.get("batch_size"), 1, True),
    )
    for key, v, low, null_ok in rules:
        if (v is None and null_ok) or (isinstance(v, int) and not isinstance(v, bool) and v >= low):
            continue
        raise CompressError(
            f"prune.{key}={v!r}: prune.{key} takes an integer >= {low}"
            f"{' or null (the default)' if null_ok else ''}."
        )
    tol = p.get("tolerance")
    if tol is not None and (not _number(tol) or not 0 <= tol < 1):
        raise CompressError(
            f"prune.tolerance={tol!r}: the budget's candidates lie within this fraction below "
            f"prune.target_params, a number from 0 to below 1 (0.03)."
        )
    target = p.get("target_params")
    if target is not None and (not _number(target) or not target > 0):
        raise CompressError(
            f"prune.target_params={target!r} must be positive: a fraction of the source's "
            f"parameters (e.g. 0.7), a count (e.g. 95e6), or null for the export sizes alone."
        )
    metric = p.get("depth_metric") or "block"
    if metric not in ("block", "ppl") or (metric == "ppl" and not p.get("ppl_samples")):
        raise CompressError(
            f"prune.depth_metric={metric!r}: use 'block' (block importance) or 'ppl' "
            f"(perplexity drop; needs prune.ppl_samples > 0)."
        )


def target_sizes(model, p) -> dict:
    """The sizes a ``prune`` config asks for, validated against the source."""
    orig = sizes_of(model.config)
    export = {k: v for k, v in dict(p.get("export") or {}).items() if v is not None}
    unknown = sorted(set(export) - set(AXES))
    if unknown:
        raise CompressError(
            f"prune.export has unknown keys {unknown}; sizes are {', '.join(AXES)}."
        )
    fixed = {k: int(v) for k, v in export.items()}
    if "num_key_value_heads" in fixed and "num_attention_heads" not in fixed:
        rep0 = orig["num_attention_heads"] // orig["num_key_value_heads"]
        fixed["num_attention_heads"] = fixed["num_key_value_heads"] * rep0
    lay = layout_of(model)
    check_sizes(orig, {**orig, **fixed}, lay.hidden_per_head)
    if p.get("target_params") is None:
        return {**orig, **fixed}
    target = resolve_target(float(p.target_params), param_count(lay, orig))
    axes = list(p.get("axes") or ["hidden_size", "intermediate_size"])
    sizes = solve_budget(
        lay,
        orig,
        target,
        fixed,
        axes,
        int(_given(p.get("round"), 64)),
        float(_given(p.get("tolerance"), 0.03)),
    )
    check_sizes(orig, sizes, lay.hidden_per_head)
    return sizes


def prune_experts(model, ctx, experts: dict):
    """The mixture-of-experts path (``experts.py``): REAP saliency, then slicing."""
    cfg, p = ctx.cfg, ctx.cfg.prune
    want = moe_prune.target(model.config, experts)
    c = p.get("calib") or {}
    samples = int(_given(c.get("samples"), cfg.calib.samples))
    seqlen = int(_given(c.get("seqlen"), cfg.calib.seqlen))
    text = read_text(cfg.data.calib.source, role="calib")
    tokens = calib_samples(ctx.tokenizer, text, samples, seqlen, seed=cfg.seed)
    t = time.time()
    scores = moe_prune.expert_scores(model, tokens, int(_given(c.get("batch_size"), 8)))
    importance_s = round(time.time() - t, 2)
    moe = spec_of(model.config).moe
    keep = moe_prune.kept(scores, want["keep"], want["width"], moe.n_group)
    pruned = moe_prune.prune_experts(model, keep, want["keep"], want["width"])
    params, source_params = param_total(pruned), param_total(model)
    log.info(
        "pruned experts %d x %d -> %d x %d per layer: %s -> %s parameters",
        moe.n_experts,
        moe.intermediate_size,
        want["keep"],
        want["width"],
        f"{source_params:,}",
        f"{params:,}",
    )
    ctx.record.update(
        params=params,
        source_params=source_params,
        params_ratio=round(params / source_params, 4),
        prune={
            "experts": want["keep"],
            "source_experts": moe.n_experts,
            "expert_width": want["width"],
            "source_expert_width": moe.intermediate_size,
            "kept_experts": {i: k["experts"].tolist() for i, k in keep.items()},
            "routed_tokens": {i: s["routed"].long().tolist() for i, s in scores.items()},
            "saliency": {i: [round(float(v), 6) for v in s["saliency"]] for i, s in scores.items()},
            "importance_s": importance_s,
            "calib": {"samples": samples, "seqlen": seqlen},
        },
    )
    del model
    return pruned


def prune(model, ctx):
    cfg = ctx.cfg
    p = cfg.prune
    experts = expert_settings(p)
    if experts is not None:
        return prune_experts(model, ctx, experts)
    orig = sizes_of(model.config)
    sizes = target_sizes(model, p)  # fail on bad sizes before the calibration pass

    c = p.get("calib") or {}
    samples = int(_given(c.get("samples"), cfg.calib.samples))
    seqlen = int(_given(c.get("seqlen"), cfg.calib.seqlen))
    text = read_text(cfg.data.calib.source, role="calib")
    settings = {
        "calib_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "samples": samples,
        "seqlen": seqlen,
        "seed": int(cfg.seed),
    }
    t = time.time()
    scores, path = cached_importance(
        model,
        lambda: calib_samples(ctx.tokenizer, text, samples, seqlen, seed=cfg.seed),
        settings,
        cache_dir() / "importance" if p.get("cache", True) else None,
        batch_size=int(_given(c.get("batch_size"), 8)),
        ppl_samples=int(p.get("ppl_samples") or 0),
    )
    importance_s = round(time.time() - t, 2)

    metric = p.get("depth_metric") or "block"
    pruned = prune_model(model, scores, sizes, metric)
    kept = keep_indices(scores, orig, sizes, metric)["layers"].tolist()
    params, source_params = param_total(pruned), param_total(model)
    log.info(
        "pruned %s -> %s: %s -> %s parameters", orig, sizes, f"{source_params:,}", f"{params:,}"
    )
    ctx.record.update(
        params=params,
        source_params=source_params,
        params_ratio=round(params / source_params, 4),
        prune={
            "sizes": sizes,
            "source_sizes": orig,
            "target_params": p.get("target_params"),
            "kept_layers": kept,
            "importance_s": importance_s,
            "calib": {"samples": samples, "seqlen": seqlen},
        },
    )
    if path is None:  # no cache: the run folder still gets the scores (from a file removed at exit)
        tmp = Path(tempfile.mkdtemp(prefix="compress-importance-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        path = tmp / "scores.safetensors"
        save_scores(path, scores, settings)
    ctx.files["importance/scores.safetensors"] = path
    del model
    return pruned
