"""No test is orphaned: every marker ``pyproject.toml`` registers (and an unmarked test) is
selected by a test tier that ``.ci/run`` runs, read as CI reads them (README commands)."""

import re
import shlex
import subprocess
import tomllib

from _pytest.mark.expression import Expression

from tests.conftest import ROOT


def readme_command(n: int) -> str:
    """The line after ``# n.`` in README.md, as ``.ci/run``'s ``readme_command`` reads it."""
    out = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^readme_command()/,/^}}/p" .ci/run); readme_command {n}'],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return out.stdout.strip()


def tiers() -> list[int]:
    found = re.search(r'^TIERS="([0-9 ]+)"', (ROOT / ".ci" / "run").read_text(), re.M)
    assert found, ".ci/run names no TIERS"
    return [int(n) for n in found.group(1).split()]


def pytest_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def selection(command: str, addopts: str) -> str | None:
    """The ``-m`` expression a pytest command runs with (its own, else addopts'); None: all."""
    if "pytest" not in command:
        return "False"  # not a test run: selects nothing
    words = shlex.split(addopts) + shlex.split(command.split("pytest", 1)[1].split("&&")[0])
    marks = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"]
    return marks[-1] if marks else None


def selects(expression: str | None, marks: set[str]) -> bool:
    return expression is None or Expression.compile(expression).evaluate(lambda m: m in marks)


def test_every_marker_runs_in_a_ci_tier():
    ini = pytest_config()
    markers = [m.split(":")[0].strip() for m in ini["markers"]]
    assert markers, "pyproject.toml registers no marker"
    expressions = {n: selection(readme_command(n), ini["addopts"]) for n in tiers()}
    for marks in [set()] + [{m} for m in markers]:
        assert any(selects(e, marks) for e in expressions.values()), (
            f"a test marked {sorted(marks) or 'with no marker'} runs in no tier of .ci/run "
            f"({expressions}); add a README command for it to TIERS"
        )


def test_an_unregistered_marker_is_an_error():
    """With ``--strict-markers`` a typo'd marker (``@pytest.mark.slwo``) fails collection
    instead of leaving its test in a tier by accident."""
    assert "--strict-markers" in shlex.split(pytest_config()["addopts"])


def test_the_check_sees_an_orphan():
    """The check itself: a marker the tiers leave out is found."""
    expressions = [selection(readme_command(2), pytest_config()["addopts"])]
    assert not any(selects(e, {"matrix"}) for e in expressions)
    assert selects(selection("python -m pytest -m 'slow or gpu'", ""), {"gpu"})
    assert not selects(selection("python -m pytest -m slow", ""), {"gpu"})
