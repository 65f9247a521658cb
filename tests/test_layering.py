"""The package's import graph: no cycles, and every import points down the layers
(``docs/architecture.md``): formats, kernels, layers, arch, io, decoder, serve, eval, methods,
recipe, command lines. Read with ``ast``; imports inside functions count too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"compress": "compress"}
# lower layers never import higher ones; the runtime (decoder, serve) imports no method, loading
# (io) knows formats and not methods, and methods import no command line
LAYERS = [
    ("compress.errors", "compress.version"),
    ("compress.formats",),
    ("compress.kernels",),
    ("compress.layers",),
    ("compress.arch",),
    ("compress.io",),
    ("compress.decoder",),
    ("compress.serve",),
    ("compress.eval",),
    ("compress.methods",),
    ("compress.recipe",),
    ("compress.cli", "compress.api", "compress.__main__"),
    ("compress", "compress.testing"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# command lines inside the runtime's rooms: nothing below the command-line layer imports them
CLI = ("compress.decoder.__main__", "compress.serve.__main__", "compress.decoder.speculative.cli")


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the installed package."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: package modules it imports}``; ``from a import b`` counts a.b if b is one."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {o for t in targets if (o := owner(t)) and o != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_relative_and_lazy_imports(tmp_path):
    (tmp_path / "compress" / "sub").mkdir(parents=True)
    files = {
        "compress": tmp_path / "compress" / "__init__.py",
        "compress.sub": tmp_path / "compress" / "sub" / "__init__.py",
        "compress.sub.a": tmp_path / "compress" / "sub" / "a.py",
        "compress.b": tmp_path / "compress" / "b.py",
    }
    files["compress"].write_text("")
    files["compress.sub"].write_text("from . import a\n")
    files["compress.sub.a"].write_text("def f():\n    from ..b import g\n")
    files["compress.b"].write_text("import compress.sub.a as a\nfrom compress import sub\n")
    graph = import_graph(files)
    assert graph["compress.sub"] == {"compress.sub.a"}
    assert graph["compress.sub.a"] == {"compress.b"}
    assert graph["compress.b"] == {"compress.sub.a", "compress.sub", "compress"}


def test_no_import_cycles():
    mods = modules()
    assert {"compress.recipe.pipeline", "compress.kernels", "compress.eval.perplexity"} <= set(mods)
    assert cycles(import_graph(mods)) == []


def layer(module: str) -> str:
    parts = module.split(".")
    return next(".".join(parts[:n]) for n in (2, 1) if ".".join(parts[:n]) in RANK)


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one, and imports of a command line."""
    out = []
    for a, targets in graph.items():
        for b in targets:
            if b == "compress":
                continue
            if RANK[layer(b)] > RANK[layer(a)]:
                out.append(f"{a} -> {b}")
            elif b in CLI and RANK[layer(a)] < RANK["compress.cli"] and not a.startswith(layer(b)):
                out.append(f"{a} -> {b} (a command line)")
    return sorted(out)


def test_layer_checker_finds_wrong_way_imports():
    graph = {
        "compress.decoder.model": {"compress.methods.quant.awq"},
        "compress.methods.iam.map": {"compress.decoder.__main__", "compress.decoder.model"},
        "compress.io.source": {"compress.formats.bitplanes", "compress"},
    }
    assert wrong_way(graph) == [
        "compress.decoder.model -> compress.methods.quant.awq",
        "compress.methods.iam.map -> compress.decoder.__main__ (a command line)",
    ]


def test_imports_point_down_the_layers():
    mods = modules()
    assert all(layer(m) for m in mods), [m for m in mods if not layer(m)]
    assert wrong_way(import_graph(mods)) == []
