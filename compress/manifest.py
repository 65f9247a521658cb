"""``manifest.json``: what a run folder holds and how it was made.

Keys: recipe (resolved config), source {name, path, sha256}, version,
git_commit, files {name: {bytes, sha256}} for every other file, stages
(seconds), created (UTC), trust_remote_code.
"""

import json
import subprocess
import time
from pathlib import Path

from compress.run_folder import sha256_file
from compress.version import __version__


def git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=40"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_manifest(
    folder: Path, recipe: dict, source, stages: dict, trust_remote_code: bool
) -> dict:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    manifest = {
        "recipe": recipe,
        "source": {"name": source.name, "path": source.path, "sha256": source.sha256},
        "version": __version__,
        "git_commit": git_commit(),
        "files": files,
        "stages": stages,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trust_remote_code": trust_remote_code,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
