"""``report.json`` and ``report.md`` of one run folder.

report.json keys (DESIGN.md): recipe, model, ppl, ppl_windows, seqlen,
kl_vs_source, top1_vs_source, weight_bytes, elapsed_s, stages (per-stage
seconds), plus whatever the stages recorded (bits, group_size, ...).
"""

import json
from pathlib import Path


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_report(folder: Path, report: dict) -> None:
    (folder / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    lines = [f"# {report['recipe']} on {report['model']}", "",
             f"WikiText-2 test, first {report['ppl_windows']} windows of {report['seqlen']} tokens; "
             f"KL and top-1 against the uncompressed source on the same windows.", "",
             "| metric | value |", "|---|---|"]
    for key in ("ppl", "kl_vs_source", "top1_vs_source", "weight_bytes", "linear_weight_bytes",
                "bits", "group_size", "peak_rss_bytes", "elapsed_s"):
        if key in report:
            lines.append(f"| {key} | {_fmt(report[key])} |")
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["stages"].items()]
    extra = {k: v for k, v in report.items() if isinstance(v, (dict, list)) and k != "stages"}
    for key, value in extra.items():
        lines += ["", f"## {key}", "", "```json", json.dumps(value, indent=1)[:20000], "```"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
