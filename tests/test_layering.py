"""The package's import graph has no cycles: every module of compress, compress.kernels and
compress.eval, read with ``ast`` (imports inside functions count too)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"compress": "compress", "kernels": "compress.kernels", "eval": "compress.eval"}


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
    assert {"compress.pipeline", "compress.kernels", "compress.eval.perplexity"} <= set(mods)
    assert cycles(import_graph(mods)) == []
