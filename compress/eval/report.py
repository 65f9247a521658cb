"""``python -m compress.eval.report PATH``: compare every run folder under PATH.

Writes into PATH ``comparison.md`` (one row per run, linking to its folder and its
manifest.json; a missing figure shows as "—", never as 0) and PNG plots:
perplexity against weight bytes with the Pareto front marked, decode tokens/s
against perplexity and KV bytes per token against KL (when any run measured them),
and the per-layer views the methods recorded (``layer_views.VIEWS``).
"""

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import quote

from compress.errors import CompressError
from compress.eval.layer_views import VIEWS, plot_view
from compress.eval.run_report import bit_width

MISSING = "—"


def find_runs(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) that hold a report.json; skips unfinished temp folders."""
    root = Path(root)
    found = [p.parent for p in root.rglob("report.json")]
    return sorted(
        p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_run(folder: Path, root: Path) -> dict:
    """What the comparison needs of one run folder: report, resolved recipe, config, relative path."""
    manifest = _json(folder / "manifest.json")
    return {
        "folder": folder,
        "rel": folder.relative_to(root).as_posix() or ".",
        "report": _json(folder / "report.json"),
        "recipe": manifest.get("recipe", {}),
        "config": _json(folder / "config.json"),
        "has_manifest": bool(manifest),
    }


def label_runs(runs: list[dict]) -> None:
    """``run["label"]``: the recipe name, with the folder where two runs share a recipe."""
    names = [r["report"].get("recipe", r["folder"].name) for r in runs]
    for run, name in zip(runs, names):
        run["label"] = (
            name
            if names.count(name) == 1 or run["folder"].name == name
            else f"{name} ({run['folder'].name})"
        )


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both coordinates lower is better)."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], None
    for i in order:
        if best is None or points[i][1] < best[1] or points[i] == best:
            front.append(i)
            best = points[i]
    return sorted(front)


def _num(v, fmt: str) -> str:
    return MISSING if v is None else format(v, fmt)


def _bits_or_sparsity(run: dict) -> str:
    """``4-bit``; ``40% sparse``; for a structurally pruned model also the share of parameters removed
    (``1 - params / source_params``): ``32-bit, 24% pruned``."""
    rep = run["report"]
    if rep.get("sparsity") is not None:
        return f"{rep['sparsity']:.0%} sparse"
    bits = bit_width(rep, run["config"], run["recipe"])
    cell = MISSING if bits is None else f"{bits}-bit"
    if rep.get("params") and rep.get("source_params") and rep["params"] < rep["source_params"]:
        cell += f", {1 - rep['params'] / rep['source_params']:.0%} pruned"
    return cell


COLUMNS = [  # header, cell
    ("recipe", lambda r: r["label"]),
    ("model", lambda r: r["report"].get("model", MISSING)),
    ("bits / sparsity", _bits_or_sparsity),
    ("weights (MB)", lambda r: _num(_mb(r["report"].get("weight_bytes")), ".2f")),
    ("ppl", lambda r: _num(r["report"].get("ppl"), ".3f")),
    ("KL (nats/token)", lambda r: _num(r["report"].get("kl_vs_source"), ".4g")),
    ("top-1 agreement", lambda r: _num(r["report"].get("top1_vs_source"), ".2%")),
    ("decode tok/s", lambda r: _num(r["report"].get("decode_tok_s"), ".1f")),
    ("prefill tok/s", lambda r: _num(r["report"].get("prefill_tok_s"), ".0f")),
    ("KV bytes/token", lambda r: _num(r["report"].get("kv_bytes_per_token"), ",.0f")),
    ("compression time (s)", lambda r: _num(compression_seconds(r), ",.1f")),
    ("run time (s)", lambda r: _num(r["report"].get("elapsed_s"), ",.0f")),
    ("eval windows × tokens", lambda r: _protocol(r) or MISSING),
    ("run", lambda r: f"[{r['rel']}]({quote(r['rel'])}/)"),
    (
        "manifest",
        lambda r: (
            f"[manifest.json]({quote(r['rel'])}/manifest.json)" if r["has_manifest"] else MISSING
        ),
    ),
]


NOT_COMPRESSION = ("export", "eval", "decode")  # the pipeline's own steps in report["stages"]


def compression_seconds(run: dict) -> float | None:
    """Seconds the recipe's stages took: ``report["stages"]`` of the stages the recipe names
    (without a manifest, every entry but the pipeline's export, eval and decode)."""
    timings = run["report"].get("stages")
    if not isinstance(timings, dict):
        return None
    names = run["recipe"].get("stages")
    if names is None:
        names = [k for k in timings if k not in NOT_COMPRESSION]
    return float(sum(timings.get(name, 0.0) for name in names))


def _mb(v):
    return None if v is None else v / 1e6


def _protocol(run: dict) -> str | None:
    rep = run["report"]
    return (
        f"{rep['ppl_windows']} × {rep['seqlen']}"
        if "ppl_windows" in rep and "seqlen" in rep
        else None
    )


def table(runs: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return lines + ["| " + " | ".join(str(cell(r)) for _, cell in COLUMNS) + " |" for r in runs]


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _scatter(ax, runs: list[dict], x, y) -> list[dict]:
    """One marker per run that has both figures, labelled with its recipe; returns those runs.

    A run keeps its colour and marker (its place in ``runs``) across every plot."""
    markers = "osD^vP*Xh<>p"
    shown = [(i, r) for i, r in enumerate(runs) if x(r) is not None and y(r) is not None]
    for i, r in shown:
        ax.scatter(
            x(r),
            y(r),
            marker=markers[i % len(markers)],
            color=f"C{i % 10}",
            s=60,
            zorder=3,
            label=r["label"],
        )
    ax.grid(alpha=0.3)
    return [r for _, r in shown]


def plot_pareto(runs: list[dict], path: Path) -> Path | None:
    """Perplexity against weight bytes, the Pareto front as a dashed step line with ringed points."""
    x, y = (lambda r: _mb(r["report"].get("weight_bytes"))), (lambda r: r["report"].get("ppl"))
    fig, ax = _figure()
    shown = _scatter(ax, runs, x, y)
    if not shown:
        return None
    front = sorted((shown[i] for i in pareto_front([(x(r), y(r)) for r in shown])), key=x)
    ax.step(
        [x(r) for r in front],
        [y(r) for r in front],
        where="post",
        ls="--",
        color="k",
        lw=1,
        label="Pareto front",
    )
    ax.scatter(
        [x(r) for r in front],
        [y(r) for r in front],
        s=220,
        facecolors="none",
        edgecolors="k",
        zorder=2,
    )
    ppls = [y(r) for r in shown]
    if max(ppls) / min(ppls) > 3:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("weight bytes (MB, 10⁶ bytes: every saved tensor)")
    ax.set_ylabel(
        "WikiText-2 perplexity (lower is better"
        + (", log scale)" if ax.get_yscale() == "log" else ")")
    )
    ax.set_title("Perplexity against size")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_xy(
    runs: list[dict], path: Path, x_key: str, y_key: str, xlabel: str, ylabel: str, title: str
):
    """A scatter of two report.json figures, when at least one run has both."""
    fig, ax = _figure()
    if not _scatter(ax, runs, lambda r: r["report"].get(x_key), lambda r: r["report"].get(y_key)):
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_layer_views(runs: list[dict], root: Path) -> list[tuple[str, Path]]:
    """Each per-layer view some run recorded, all those runs in one figure: ``[(title, path)]``."""
    out = []
    for view in VIEWS.values():
        series = [(r["label"], s) for r in runs if (s := view.extract(r["report"]))]
        if series:
            out.append((view.title, plot_view(view, series, root / view.file)))
    return out


def write_comparison(root: Path) -> Path:
    """Write ``root/comparison.md`` and its plots; returns the markdown's path."""
    root = Path(root)
    runs = [load_run(f, root) for f in find_runs(root)]
    if not runs:
        raise CompressError(
            f"no run folders under '{root}' (folders with a report.json). Run a recipe first: "
            f"`python -m compress recipe=awq_int4`."
        )
    label_runs(runs)
    runs.sort(
        key=lambda r: (
            r["report"].get("model", ""),
            -(r["report"].get("weight_bytes") or 0),
            r["label"],
        )
    )
    plots = [  # (caption, path or None when no run has the figures)
        (
            "Perplexity against weight bytes, Pareto front marked",
            plot_pareto(runs, root / "ppl_vs_weight_bytes.png"),
        ),
        (
            "Decode tokens/s against perplexity",
            plot_xy(
                runs,
                root / "decode_vs_ppl.png",
                "ppl",
                "decode_tok_s",
                "WikiText-2 perplexity (lower is better)",
                "decode tokens/s (batch 1, higher is better)",
                "Decode speed against perplexity",
            ),
        ),
        (
            "KV-cache bytes per token against KL",
            plot_xy(
                runs,
                root / "kv_vs_kl.png",
                "kv_bytes_per_token",
                "kl_vs_source",
                "KV-cache size per token (bytes, as stored)",
                "KL(source ‖ run) (nats/token)",
                "KV-cache size against divergence from the source",
            ),
        ),
        *plot_layer_views(runs, root),
    ]
    lines = [
        f"# Comparison of {len(runs)} run{'s' if len(runs) != 1 else ''}",
        "",
        "Perplexity: WikiText-2 raw test, non-overlapping windows (column *eval windows × tokens*); KL and "
        "top-1 agreement against the uncompressed source on the same windows. Weight bytes: every saved "
        "tensor. Compression time: the recipe's stages; run time: the whole run, with "
        f"loading, export, eval and the decoder. {MISSING}: not measured in that run.",
        "",
    ]
    protocols = {(r["report"].get("model"), _protocol(r)) for r in runs}
    if len(protocols) > 1:
        lines += [
            "**Note:** these runs differ in model or eval windows; compare perplexity only between runs "
            "with the same model and windows.",
            "",
        ]
    lines += table(runs)
    for caption, path in plots:
        if path:
            lines += ["", f"## {caption}", "", f"![{caption}]({quote(path.name)})"]
    out = root / "comparison.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m compress.eval.report", description=__doc__.splitlines()[0]
    )
    p.add_argument("path", type=Path, help="folder holding run folders, e.g. outputs/")
    args = p.parse_args(argv)
    try:
        print(write_comparison(args.path))
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
