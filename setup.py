"""What pyproject.toml cannot say: a wheel carries the recipes (top-level ``recipes/``) and the
C++ sources (top-level ``kernels/``, compiled on first use) as package data, in
``compress/recipes`` and ``compress/kernels/csrc``. A checkout or an editable install reads the
top-level folders themselves (``compress.recipe.overrides.RECIPES``, ``compress.kernels.native.CSRC``)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA = {"recipes": ("compress/recipes", "*.yaml"), "kernels": ("compress/kernels/csrc", "*.[ch]*")}


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, (target, pattern) in DATA.items():
            for f in sorted((ROOT / folder).rglob(pattern)):
                out = Path(self.build_lib) / target / f.relative_to(ROOT / folder)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, out)


setup(cmdclass={"build_py": BuildPy})
