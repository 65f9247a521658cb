"""Push a run folder to the Hugging Face Hub.

    python -m compress.recipe.hub push outputs/RUN --repo-id ORG/NAME [--private] [--revision BRANCH] [--dry-run]

or ``hub.push=true hub.repo_id=ORG/NAME`` after any recipe (the pipeline pushes once the
run folder is complete). Steps: ``create_repo`` (exist_ok), ``create_branch`` for a
revision other than main, then ``upload_folder``: huggingface_hub's normal path, which
sends large files through Xet or LFS and commits at the end. The token comes from
``HF_TOKEN`` or the stored login (``hf auth login``) and is never logged. ``HF_ENDPOINT``
or ``--endpoint`` points at another Hub. A push only reads the run folder.

A model card written without a repo id holds ``ORG/NAME``: the push sends it with the repo id
filled in (from a temporary folder of links to the run folder's files, so the run folder stays
as it is); every other file is sent as it is.

When a step fails, the error says which one, and what the Hub now holds of the run folder
(checked file by file, by sha256 or git blob id), or that nothing is confirmed uploaded.
"""

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from compress.errors import CompressError
from compress.io.run_folder import sha256_file
from compress.recipe.model_card import PLACEHOLDER_NOTE, PLACEHOLDER_REPO

log = logging.getLogger(__name__)


def upload_plan(run_dir: Path) -> list[tuple[str, int]]:
    """``[(path in repo, bytes)]``: every file ``upload_folder`` sends, in order."""
    from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    from huggingface_hub.utils import filter_repo_objects

    run_dir = Path(run_dir)
    paths = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    return [
        (p, (run_dir / p).stat().st_size)
        for p in filter_repo_objects(paths, ignore_patterns=DEFAULT_IGNORE_PATTERNS)
    ]


def check_run_folder(run_dir: Path) -> None:
    """A complete run folder: manifest.json present, and every file it lists there with its size."""
    run_dir = Path(run_dir)
    if not (run_dir / "manifest.json").is_file():
        raise CompressError(
            f"'{run_dir}' is not a run folder (no manifest.json). Push the folder a recipe "
            f"wrote, e.g. outputs/RUN."
        )
    for name, entry in json.loads((run_dir / "manifest.json").read_text())["files"].items():
        path = run_dir / name
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise CompressError(
                f"'{path}' is missing or changed since the run (manifest.json says "
                f"{entry['bytes']:,} bytes). Re-run the recipe rather than pushing a damaged folder."
            )


@contextlib.contextmanager
def card_for_repo(run_dir: Path, repo_id: str):
    """The folder to upload: ``run_dir``, or, when its README.md holds the card's placeholder
    repo id, a temporary folder of links to its files whose README.md names ``repo_id``."""

    card = run_dir / "README.md"
    if not card.is_file() or PLACEHOLDER_REPO not in (text := card.read_text()):
        yield run_dir
        return
    with tempfile.TemporaryDirectory(prefix="compress-push-") as tmp:
        for p in run_dir.rglob("*"):
            if p.is_file() and p != card:
                link = Path(tmp) / p.relative_to(run_dir)
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(p.resolve(), link)
        filled = text.replace(PLACEHOLDER_NOTE + "\n\n", "").replace(PLACEHOLDER_REPO, repo_id)
        (Path(tmp) / "README.md").write_text(filled)
        yield Path(tmp)


def _git_blob_id(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    h.update(path.read_bytes())
    return h.hexdigest()


def remote_matches(
    api, repo_id: str, revision: str | None, run_dir: Path, files: list[str]
) -> list[str]:
    """The files whose content on the Hub (at ``revision``) equals the local file."""

    remote = {f.path: f for f in api.get_paths_info(repo_id, files, revision=revision)}
    same = []
    for name in files:
        r = remote.get(name)
        if (
            r is not None
            and r.size == (run_dir / name).stat().st_size
            and (
                r.lfs.sha256 == sha256_file(run_dir / name)
                if r.lfs
                else r.blob_id == _git_blob_id(run_dir / name)
            )
        ):
            same.append(name)
    return same


def _failure(
    step: str,
    error: Exception,
    api,
    repo_id: str,
    revision: str | None,
    run_dir: Path,
    files: list[str],
    token: str | None,
    sent: Path | None = None,
) -> CompressError:
    """A CompressError naming the failed step and what the Hub holds of the run folder
    (compared with ``sent``, the folder the push uploads; default ``run_dir``)."""
    where = f"{repo_id}@{revision or 'main'}"
    if step == "create the repository":
        held = "Nothing was uploaded."
    else:
        try:
            same = remote_matches(api, repo_id, revision, sent or run_dir, files)
            missing = [f for f in files if f not in same]
            held = (
                f"{where} now holds {len(same)} of the {len(files)} files of the run folder"
                + (f" ({', '.join(same)})" if same else "")
                + (f"; not uploaded, or different there: {', '.join(missing)}." if missing else ".")
            )
        except Exception as check_error:  # the network is often down for this too
            held = f"Could not check what {where} holds ({type(check_error).__name__}): nothing is confirmed uploaded."
    causes, e = [], error
    while e is not None:  # huggingface_hub wraps the HTTP error: show the whole chain
        causes.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        e = e.__cause__
    reason = " <- ".join(causes)
    if token:
        reason = reason.replace(token, "***")
    return CompressError(
        f"push of '{run_dir}' to {where} failed at step '{step}': {reason}\n{held}\n"
        f"The local run folder was not modified. Re-run the push to retry; files the Hub already holds "
        f"are not sent again."
    )


def push(
    run_dir: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
) -> str | None:
    """Upload the run folder as one ``upload_folder`` call; returns the commit URL (None for a dry run)."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    check_run_folder(run_dir)
    with card_for_repo(run_dir, repo_id) as sent:
        return _push(run_dir, sent, repo_id, private, revision, dry_run, HfApi(endpoint=endpoint))


def _push(
    run_dir: Path, sent: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool, api
) -> str | None:
    """``push``, uploading the folder ``sent`` (``card_for_repo`` of ``run_dir``)."""
    from huggingface_hub import get_token

    plan = upload_plan(sent)
    target = f"{api.endpoint}/{repo_id} ({'private' if private else 'public'}, revision {revision or 'main'})"
    if dry_run:
        print(
            f"dry run: would upload {len(plan)} files, {sum(s for _, s in plan):,} bytes, to {target}"
        )
        for name, size in plan:
            print(f"  {size:>15,}  {name}")
        return None
    token = get_token()
    if not token:
        raise CompressError(
            "no Hugging Face token: set HF_TOKEN, or log in once with `hf auth login`."
        )
    if not (run_dir / "README.md").exists():
        log.warning("%s has no model card (README.md); the Hub page will be empty", run_dir)
    log.info("pushing %d files (%s bytes) to %s", len(plan), f"{sum(s for _, s in plan):,}", target)
    files = [name for name, _ in plan]
    step = "create the repository"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise CompressError(
                f"{repo_id} already exists and is public, so --private cannot hold; nothing "
                f"was uploaded. Make it private on the Hub, or push to another repo id."
            )
        if revision and revision != "main":
            step = f"create the branch '{revision}'"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        step = "upload and commit the files"
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=sent,
            revision=revision,
            commit_message=f"compress run {run_dir.name}",
        )
    except CompressError:
        raise
    except Exception as e:
        raise _failure(step, e, api, repo_id, revision, run_dir, files, token, sent) from e
    log.info("pushed %s: %s", run_dir, info.commit_url)
    return info.commit_url


def check_config(hub_cfg) -> None:
    """Fail before a long run when ``hub.push`` is set but cannot work."""
    if not hub_cfg or not hub_cfg.get("push"):
        return
    from huggingface_hub import get_token

    if not hub_cfg.get("repo_id"):
        raise CompressError("hub.push=true needs hub.repo_id=ORG/NAME.")
    if not get_token():
        raise CompressError(
            "hub.push=true needs a Hugging Face token: set HF_TOKEN, or log in once with "
            "`hf auth login`."
        )


def push_after_run(run_dir: Path, hub_cfg) -> str | None:
    """The pipeline's hook: push the completed run folder when ``hub.push`` is set."""
    if not hub_cfg or not hub_cfg.get("push"):
        return None
    try:
        return push(
            run_dir,
            hub_cfg.repo_id,
            private=bool(hub_cfg.get("private")),
            revision=hub_cfg.get("revision"),
        )
    except CompressError as e:
        raise CompressError(
            f"{e}\nThe run folder '{run_dir}' is complete; push it later with "
            f"`python -m compress.recipe.hub push {run_dir} --repo-id {hub_cfg.repo_id}`."
        ) from e


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m compress.recipe.hub", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("push", help="upload a run folder to a Hub repository")
    q.add_argument("run", type=Path, help="run folder, e.g. outputs/awq_int4")
    q.add_argument("--repo-id", required=True, help="ORG/NAME")
    q.add_argument("--private", action="store_true", help="create the repository private")
    q.add_argument("--revision", help="branch to commit to (created from main if missing)")
    q.add_argument(
        "--dry-run", action="store_true", help="list files, sizes and target; upload nothing"
    )
    q.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        url = push(
            args.run,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            dry_run=args.dry_run,
            endpoint=args.endpoint,
        )
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if url:
        print(url)


if __name__ == "__main__":
    main()
