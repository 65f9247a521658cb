"""The wheel holds every recipe, and an installed (non-editable) compress runs them from any
directory."""

import importlib.util
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def build_wheel(out):
    """``pip wheel .``: in this environment when it has setuptools >= 68 and a bdist_wheel,
    else in pip's isolated build environment (setuptools and wheel from the package index)."""
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    has_bdist_wheel = importlib.util.find_spec("wheel") is not None or (major, minor) >= (70, 1)
    local = major >= 68 and has_bdist_wheel
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w", str(out)]
    res = subprocess.run(
        cmd + (["--no-build-isolation"] if local else []),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = out.glob("compress-*.whl")
    return wheel


def wheel_info(names) -> str:
    (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    return info


def test_wheel_ships_the_recipes_and_runs_them(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = sorted(
        p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes").rglob("*.yaml")
    )
    assert recipes and {f"compress/recipes/{r}" for r in recipes} <= names  # subfolders too
    assert "compress/kernels/__init__.py" in names and "compress/eval/report.py" in names
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir())  # the C++ kernels' sources
    assert sources and {f"compress/kernels/csrc/{s}" for s in sources} <= names
    # only the package: no top-level kernels/, eval/ or tests/ (scripts and sources stay out)
    assert {n.split("/")[0] for n in names if "/" in n} == {"compress", wheel_info(names)}

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "PYTHONPATH": str(site),
        "PATH": "/usr/bin:/bin",
        "COMPRESS_DATA_DIR": str(tmp_path / "data"),
    }
    res = subprocess.run(
        [sys.executable, "-c", "import compress.__main__ as m; print(m.RECIPES)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(site / "compress" / "recipes")
    res = subprocess.run(
        [sys.executable, "-c", "from compress.kernels import native; print(native.CSRC)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(site / "compress" / "kernels" / "csrc")
    res = subprocess.run(
        [sys.executable, "-m", "compress", "recipe=rtn_int4", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "name: rtn_int4" in res.stdout and "group_size: auto" in res.stdout
    assert f"{tmp_path / 'data'}/wikitext-2/wiki.test.raw" in res.stdout  # data/ resolved
