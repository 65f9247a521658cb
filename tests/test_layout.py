"""The repository's top-level folders shadow no installed package: from the repo root (where
``python -m pytest`` and ``python -m compress`` run, with the root first on ``sys.path``) every
name an installed distribution provides imports that distribution's code. transformers 5.25
imports Hugging Face's ``kernels``; a ``kernels/__init__.py`` at the root once shadowed it."""

import json
import subprocess
import sys

from tests.conftest import ROOT

PROBE = r"""
import importlib.metadata, importlib.util, json, os, sys
root = os.path.realpath(os.getcwd())
env = os.path.realpath(sys.prefix)  # a venv may live inside the checkout (.venv)
provided = {n: [d for d in ds if d != "compress"]
            for n, ds in importlib.metadata.packages_distributions().items()}
out = {}
for name in sorted(os.listdir(root)):
    if name.startswith(".") or not os.path.isdir(name) or not name.isidentifier():
        continue
    spec = importlib.util.find_spec(name)
    places = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
    ours = [p for p in places if p and os.path.realpath(p).startswith(root + os.sep)
            and not os.path.realpath(p).startswith(env + os.sep)]
    out[name] = {"ours": ours, "regular": os.path.isfile(os.path.join(name, "__init__.py")),
                 "dists": provided.get(name, [])}
print(json.dumps(out))
"""


def top_level_imports() -> dict:
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_no_top_level_folder_shadows_an_installed_package():
    found = top_level_imports()
    assert {"compress", "kernels", "eval", "recipes", "tests"} <= set(found)
    shadowing = {n: f for n, f in found.items() if f["dists"] and f["ours"]}
    assert not shadowing, (
        f"top-level folders importable from the repo root under names that installed "
        f"distributions provide: {shadowing}"
    )
    # a regular package (an __init__.py) would win over any installed one: only compress/ is
    packages = sorted(n for n, f in found.items() if f["regular"])
    assert packages == ["compress"], packages


def test_kernels_imports_hugging_face_kernels_from_the_root():
    """transformers 5.25 requires ``kernels``: from the root it is the installed one."""
    found = top_level_imports()
    assert found["kernels"]["dists"], "Hugging Face's kernels is not installed"
    assert not found["kernels"]["ours"]
    res = subprocess.run(
        [sys.executable, "-c", "import kernels, transformers.integrations.hub_kernels"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
