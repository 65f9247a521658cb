"""``report.json`` and ``report.md`` of one run folder.

report.json keys: recipe, model, ppl, source_ppl (the uncompressed source on the same
windows), ppl_windows, seqlen, kl_vs_source, top1_vs_source, weight_bytes, elapsed_s, stages
(per-stage seconds), the built-in decoder's decode_tok_s, prefill_tok_s and kv_bytes_per_token
(compress/eval/decode_speed.py; decode_error instead if it could not run the folder), plus
whatever the stages recorded (bits, group_size, ...).
"""

import json
from pathlib import Path

from compress.eval.layer_views import plot_run_views
from compress.layers import group_params


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def bit_width(report: dict, config: dict, recipe: dict) -> int | None:
    """Bits per weight of the quantized linears: the stage's record, else config.json's
    quantization_config, else the model dtype of an unquantized run (None if unknown)."""
    qcfg = config.get("quantization_config") or {}
    stored = (group_params(qcfg) or (None,))[0]
    if report.get("bits") or stored:
        return report.get("bits") or stored
    if qcfg.get("load_in_8bit"):
        return 8
    if not qcfg:
        return DTYPE_BITS.get((recipe.get("model") or {}).get("dtype"))
    return None


def protocol(report: dict) -> str:
    """The eval protocol behind the figures, in one sentence."""
    return (
        f"WikiText-2 test, first {report['ppl_windows']} windows of {report['seqlen']} tokens; "
        f"KL and top-1 against the uncompressed source on the same windows."
    )


def ppl_delta(report: dict) -> str | None:
    """``+0.254 (+1.69%)``: the run's perplexity minus the source's on the same windows."""
    if report.get("ppl") is None or not report.get("source_ppl"):
        return None
    d = report["ppl"] - report["source_ppl"]
    return f"{d:+.4g} ({d / report['source_ppl']:+.2%})"


def metrics_table(report: dict) -> list[str]:
    """The headline figures as markdown table lines; the source's perplexity and the delta
    follow the run's."""
    lines = ["| metric | value |", "|---|---|"]
    delta = ppl_delta(report)
    for key in (
        "ppl",
        "source_ppl",
        "kl_vs_source",
        "top1_vs_source",
        "weight_bytes",
        "linear_weight_bytes",
        "params",
        "distill_tokens",
        "bits",
        "group_size",
        "lm_head",
        "llm_int8_threshold",
        "llm_int8_threshold_reason",
        "decode_tok_s",
        "prefill_tok_s",
        "decode_threads",
        "kv_bytes_per_token",
        "decode_error",
        "peak_rss_bytes",
        "elapsed_s",
    ):
        if key in report:
            lines.append(f"| {key} | {_fmt(report[key])} |")
        if key == "source_ppl" and delta:
            lines.append(f"| ppl − source_ppl | {delta} |")
    return lines


def write_report(folder: Path, report: dict) -> None:
    """report.json, the per-layer plots the run recorded, and report.md that shows them."""

    (folder / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    lines = [
        f"# {report['recipe']} on {report['model']}",
        "",
        protocol(report),
        "",
        *metrics_table(report),
    ]
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["stages"].items()]
    for title, file in plot_run_views(folder, report, report["recipe"]):
        lines += ["", f"## {title}", "", f"![{title}]({file})"]
    extra = {k: v for k, v in report.items() if isinstance(v, (dict, list)) and k != "stages"}
    for key, value in extra.items():
        lines += ["", f"## {key}", "", "```json", json.dumps(value, indent=1)[:20000], "```"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
