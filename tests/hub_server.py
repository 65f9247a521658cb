"""A small fake Hugging Face Hub on 127.0.0.1: the endpoints ``create_repo`` and ``upload_folder`` call.

Implements, for model repos (``huggingface_hub`` 2.4, basic LFS transfer, Xet disabled):

    POST /api/repos/create                          create a repo (409 when it exists)
    POST /api/validate-yaml                         README.md front matter must parse to a mapping
    GET  /api/models/{repo}[/revision/{rev}]        repo info (id, private, sha)
    POST /api/models/{repo}/branch/{branch}         create a branch from main (409 when it exists)
    POST /api/models/{repo}/preupload/{rev}         upload mode per file: "lfs" for ``lfs_suffixes``, else "regular"
    POST /api/models/{repo}/paths-info/{rev}        size, git blob id and LFS sha256 of committed files
    POST /{repo}.git/info/lfs/objects/batch         basic transfer: one PUT href per object
    PUT  /lfs/{oid}                                 LFS object upload (sha256 checked)
    POST /api/models/{repo}/commit/{rev}            NDJSON commit: header, file (base64), lfsFile (oid)

State, for the tests: ``repos[repo_id] = {"private", "branches": {name: {path: bytes}}, "commits": [...]}``,
``lfs[oid] = bytes``, ``requests`` (method, path), ``auth`` (Authorization headers seen).
``fail = (method, path_prefix, nth, status)`` answers the nth matching request with that status.
"""

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub(ThreadingHTTPServer):
    def __init__(self, lfs_suffixes=(".safetensors",)):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lfs_suffixes = tuple(lfs_suffixes)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.repos, self.lfs, self.requests, self.auth = {}, {}, [], set()
        self.fail, self.lock = None, threading.Lock()

    def __enter__(self):
        threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_PUT(self):
        self.route("PUT")

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def reply(self, status: int, obj=None):
        data = json.dumps(obj if obj is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def route(self, method: str):
        hub, url = self.server, urlsplit(self.path)
        path, data = unquote(url.path), self.body()
        with hub.lock:
            hub.requests.append((method, path))
            hub.auth.add(self.headers.get("Authorization"))
            if hub.fail and method == hub.fail[0] and path.startswith(hub.fail[1]):
                hub.fail = (*hub.fail[:2], hub.fail[2] - 1, hub.fail[3])
                if hub.fail[2] == 0:
                    return self.reply(hub.fail[3], {"error": "injected failure"})
            try:
                status, obj = self.handle_api(method, path, url.query, data)
            except KeyError as e:
                status, obj = 404, {"error": f"not found: {e}"}
        self.reply(status, obj)

    def handle_api(self, method, path, query, data):
        hub = self.server
        if (method, path) == ("POST", "/api/repos/create"):
            req = json.loads(data)
            repo_id = (
                f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            )
            if repo_id in hub.repos:
                return 409, {
                    "error": "You already created this model repo",
                    "url": f"{hub.endpoint}/{repo_id}",
                }
            hub.repos[repo_id] = {
                "private": req.get("visibility") == "private",
                "branches": {"main": {}},
                "commits": [],
            }
            return 200, {"url": f"{hub.endpoint}/{repo_id}"}
        if (method, path) == ("POST", "/api/validate-yaml"):
            return _validate_yaml(json.loads(data)["content"])
        if path.endswith(".git/info/lfs/objects/batch"):
            req = json.loads(data)
            return 200, {
                "transfer": "basic",
                "objects": [
                    {
                        "oid": o["oid"],
                        "size": o["size"],
                        "actions": {"upload": {"href": f"{hub.endpoint}/lfs/{o['oid']}"}},
                    }
                    for o in req["objects"]
                ],
            }
        if method == "PUT" and path.startswith("/lfs/"):
            oid = path.split("/")[-1]
            if hashlib.sha256(data).hexdigest() != oid:
                return 400, {"error": "sha256 mismatch"}
            hub.lfs[oid] = data
            return 200, {}
        # /api/models/{org}/{name}/{action}/{rev...}
        parts = path.split("/")
        repo_id, action, rev = "/".join(parts[3:5]), (parts[5:6] or [""])[0], "/".join(parts[6:])
        repo = hub.repos[repo_id]
        if method == "GET" and action in ("", "revision"):
            files = repo["branches"][rev or "main"]
            return 200, {"id": repo_id, "private": repo["private"], "sha": _tree_sha(files)}
        if action == "branch":
            if rev in repo["branches"]:
                return 409, {"error": "branch exists"}
            repo["branches"][rev] = dict(repo["branches"]["main"])
            return 200, {}
        files = repo["branches"][rev]
        if action == "preupload":
            return 200, {
                "files": [
                    {
                        "path": f["path"],
                        "shouldIgnore": False,
                        "uploadMode": "lfs" if f["path"].endswith(hub.lfs_suffixes) else "regular",
                    }
                    for f in json.loads(data)["files"]
                ]
            }
        if action == "paths-info":
            wanted = parse_qs(data.decode())["paths"]
            return 200, [
                _file_info(p, files[p], p.endswith(hub.lfs_suffixes)) for p in wanted if p in files
            ]
        if action == "commit":
            return self.commit(
                repo_id, rev, [json.loads(line) for line in data.splitlines() if line.strip()]
            )
        return 404, {"error": f"no route for {method} {path}"}

    def commit(self, repo_id, rev, lines):
        hub = self.server
        staged = {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                staged[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in hub.lfs:
                    return 422, {"error": f"LFS object of {value['path']} was never uploaded"}
                staged[value["path"]] = hub.lfs[value["oid"]]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = hub.repos[repo_id]["branches"][rev]
        files.update(staged)
        oid = _tree_sha(files)
        hub.repos[repo_id]["commits"].append(
            {"revision": rev, "summary": header["summary"], "files": sorted(staged), "oid": oid}
        )
        return 200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid}


def _validate_yaml(content: str):
    try:
        meta = yaml.safe_load(content.split("---\n")[1]) if content.startswith("---\n") else {}
    except yaml.YAMLError as e:
        return 400, {"errors": [{"message": str(e)}]}
    if not isinstance(meta, dict):
        return 400, {"errors": [{"message": "front matter is not a mapping"}]}
    return 200, {"errors": [], "warnings": []}


def _tree_sha(files: dict) -> str:
    return hashlib.sha1(
        json.dumps({p: git_blob_id(b) for p, b in sorted(files.items())}).encode()
    ).hexdigest()


def _file_info(path: str, data: bytes, lfs: bool) -> dict:
    info = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
    if lfs:
        info["lfs"] = {
            "oid": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "pointerSize": 134,
        }
    return info
