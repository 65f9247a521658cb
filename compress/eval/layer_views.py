"""Per-layer views of what a method recorded in report.json, drawn as PNGs.

A view turns one report into ``{group: {layer index: value}}`` (or None when the
run did not record it) and draws one panel per group, one line per run. Used by
each run's report.md (one run) and by the cross-run comparison (all runs).
A method that records a new per-layer table adds one entry to ``VIEWS``.
"""

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# panels in the order a decoder layer runs them (report.json stores its keys sorted)
ORDER = (
    "qkv",
    "q_proj",
    "k_proj",
    "v_proj",
    "o",
    "o_proj",
    "gate_up",
    "gate_proj",
    "up_proj",
    "down",
    "down_proj",
)


def _order(name: str) -> tuple:
    first = name.split("/")[0]
    return (ORDER.index(first) if first in ORDER else len(ORDER), name)


def awq_alpha(report: dict) -> dict | None:
    """AWQ's chosen α per layer and scale group (qkv, o, gate_up, down)."""
    series = {}
    for layer, groups in (report.get("awq_alpha") or {}).items():
        for group, alpha in groups.items():
            series.setdefault(group, {})[int(layer)] = alpha
    return series or None


def outlier_dims(report: dict) -> dict | None:
    """LLM.int8: distinct input dims that crossed the threshold, per layer and linear.

    Linears that read the same input (q/k/v, gate/up) have equal series and share a panel.
    """
    series = {}
    for name, row in (report.get("outliers") or {}).items():
        m = re.search(
            r"\.(\d+)\.(.+)$", name
        )  # model.layers.3.self_attn.q_proj -> 3, self_attn.q_proj
        if m:
            series.setdefault(m.group(2).split(".")[-1], {})[int(m.group(1))] = row["dims"]
    merged = {}
    for name, values in sorted(series.items(), key=lambda kv: _order(kv[0])):
        same = next((k for k, v in merged.items() if v == values), None)
        if same is None:
            merged[name] = values
        else:
            merged[f"{same}/{name}"] = merged.pop(same)
    return merged or None


@dataclass(frozen=True)
class View:
    extract: Callable[[dict], dict | None]
    title: str
    ylabel: str
    file: str


VIEWS = {
    "awq_alpha": View(
        awq_alpha,
        "AWQ: chosen scale exponent α per layer",
        "α (s = mean|x|^α, dimensionless)",
        "layers_awq_alpha.png",
    ),
    "outliers": View(
        outlier_dims,
        "LLM.int8: outlier input dims per layer (calibration)",
        "input dims with |x| > threshold (count)",
        "layers_int8_outliers.png",
    ),
}


def plot_view(view: View, runs: list[tuple[str, dict]], path: Path) -> Path:
    """One panel per group, one line per ``(label, series)`` run; written to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    groups = sorted(dict.fromkeys(g for _, series in runs for g in series), key=_order)
    cols = min(2, len(groups))
    rows = -(-len(groups) // cols)
    fig = Figure(figsize=(6 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, group in zip(axes, groups):
        for label, series in runs:
            if group in series:
                layers = sorted(series[group])
                ax.plot(layers, [series[group][i] for i in layers], marker=".", label=label)
        ax.set_title(group)
        ax.set_xlabel("decoder layer (index)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(view.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    fig.suptitle(view.title)
    fig.savefig(path, dpi=110)
    return path


def plot_run_views(folder: Path, report: dict, label: str) -> list[tuple[str, str]]:
    """Every view this run recorded, written into ``folder``: ``[(title, file name)]``; none
    without matplotlib (the ``plots`` extra), with one warning."""
    if importlib.util.find_spec("matplotlib") is None:
        if any(view.extract(report) for view in VIEWS.values()):
            log.warning("matplotlib is not installed: no plots (pip install 'compress[plots]')")
        return []
    out = []
    for view in VIEWS.values():
        series = view.extract(report)
        if series:
            plot_view(view, [(label, series)], Path(folder) / view.file)
            out.append((view.title, view.file))
    return out
