"""The Hub HTTP protocol as huggingface_hub 2.x uses it, served from in-memory repos.

Routes (model repos): create repo, validate README YAML, model info, preupload, LFS batch
(basic transfer) + upload + verify, NDJSON commit, tree listing, paths-info, resolve
(HEAD/GET download). Shapes follow what the client parses in `hf_api.py`, `_commit_api.py`,
`lfs.py` and `file_download.py`. State and fault knobs live in `hub_server.LocalHubServer`.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    from hub_server import LocalHubServer

# The patterns the Hub writes into a new repo's .gitattributes; matching files go to LFS.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub refuses regular (non-LFS) files from 10 MiB on
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


def git_blob_oid(content: bytes) -> str:
    """Git's object id of a blob (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def is_lfs_path(path: str, size: int) -> bool:
    """Whether the Hub would store this file in LFS (by .gitattributes pattern or size)."""
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_SIZE_THRESHOLD or any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS)


@dataclass(frozen=True)
class Blob:
    """One stored file: its bytes and whether the repo keeps it in LFS."""

    content: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.content)}\n".encode()

    @property
    def oid(self) -> str:
        """The git oid the Hub reports: of the LFS pointer for LFS files, of the content otherwise."""
        return git_blob_oid(self.pointer if self.lfs else self.content)

    def entry(self, path: str) -> dict:
        """The tree / paths-info JSON of this file."""
        out: dict = {"type": "file", "path": path, "size": len(self.content), "oid": self.oid}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.content), "pointerSize": len(self.pointer)}
        return out


@dataclass
class Commit:
    oid: str
    title: str
    files: dict[str, Blob]
    date: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"))


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def find(self, revision: str) -> Commit | None:
        """The commit a branch name ("main") or a commit oid names."""
        if revision == "main":
            return self.head
        return next((c for c in self.commits if c.oid == revision), None)


class HubError(Exception):
    """An HTTP error the handler turns into a Hub-style JSON response."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


_R = r"(?P<repo>[^/]+/[^/]+)"
ROUTES: list[tuple[tuple[str, ...], re.Pattern[str], str]] = [
    (("POST",), re.compile(r"^/api/repos/create$"), "create"),
    (("POST",), re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    (("GET",), re.compile(rf"^/api/models/{_R}(?:/revision/(?P<rev>[^/]+))?$"), "model_info"),
    (("POST",), re.compile(rf"^/api/models/{_R}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    (("POST",), re.compile(rf"^/api/models/{_R}/commit/(?P<rev>[^/]+)$"), "commit"),
    (("GET",), re.compile(rf"^/api/models/{_R}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    (("POST",), re.compile(rf"^/api/models/{_R}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    (("POST",), re.compile(rf"^/{_R}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    (("POST",), re.compile(rf"^/{_R}\.git/info/lfs/objects/verify$"), "lfs_verify"),
    (("PUT",), re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})$"), "lfs_upload"),
    (("GET", "HEAD"), re.compile(rf"^/{_R}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


def _truthy(query: dict[str, list[str]], key: str) -> bool:
    return query.get(key, ["false"])[0].lower() in ("1", "true")


def _with_last_commit(entries: list[dict], commit: Commit) -> list[dict]:
    for entry in entries:
        entry["lastCommit"] = {"id": commit.oid, "title": commit.title, "date": commit.date}
    return entries


class HubHandler(BaseHTTPRequestHandler):
    """Routes one HTTP request to the matching Hub endpoint of `self.hub`."""

    hub: LocalHubServer
    protocol_version = "HTTP/1.1"  # keep-alive, like the real Hub; every response carries Content-Length
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stalls

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        """Stay quiet: pytest shows failures, not access logs."""

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # ---- plumbing --------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        for methods, pattern, route in ROUTES:
            match = pattern.match(url.path)
            if match and method in methods:
                break
        else:
            self._read_body()
            self._send_json(404, {"error": f"no route for {method} {url.path}"})
            return
        fault = self.hub.record_request(route, method)
        if fault == "drop":
            self._drop_midway()
            return
        body = b"" if route == "lfs_upload" else self._read_body()  # LFS bodies are streamed by the route
        try:
            if fault is not None:
                if route == "lfs_upload":
                    self._read_body()
                status, headers = fault
                raise HubError(status, f"injected HTTP {status}", headers=headers)
            if self.hub.valid_tokens is not None and route != "lfs_upload":  # LFS PUT URLs are pre-signed
                auth = self.headers.get("authorization", "")
                if not auth.startswith("Bearer ") or auth[len("Bearer ") :] not in self.hub.valid_tokens:
                    msg = "Invalid credentials in Authorization header"
                    raise HubError(401, msg, headers={"X-Error-Message": msg})
            params = {k: unquote(v) if v is not None else None for k, v in match.groupdict().items()}
            getattr(self, f"_route_{route}")(body=body, **params)
        except HubError as err:
            headers = dict(err.headers)
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send_json(err.status, {"error": err.message}, headers)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                chunk = self.rfile.read(size + 2)[:size]  # each chunk ends with CRLF
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _drop_midway(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", code="RepoNotFound")
        return repo

    def _commit(self, repo_id: str, rev: str) -> Commit:
        commit = self._repo(repo_id).find(rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
        return commit

    # ---- routes ----------------------------------------------------------------------------
    def _route_create(self, body: bytes) -> None:
        payload = json.loads(body)
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"{self.hub.base_url}/{repo_id}"
        with self.hub.lock:
            exists = repo_id in self.hub.repos
            if not exists:
                repo = Repo(repo_id=repo_id, private=payload.get("visibility") == "private")
                self.hub.repos[repo_id] = repo
                self.hub.new_commit(repo, "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        if exists:  # the client reads `url` from the 409 body when exist_ok=True
            self._send_json(409, {"error": "You already created this model repo", "url": url})
        else:
            self._send_json(200, {"url": url, "name": repo_id})

    def _route_validate_yaml(self, body: bytes) -> None:
        self._send_json(200, {"errors": [], "warnings": []})

    def _route_model_info(self, body: bytes, repo: str, rev: str | None) -> None:
        with self.hub.lock:
            commit, private = self._commit(repo, rev or "main"), self._repo(repo).private
        siblings = [{"rfilename": p} for p in sorted(commit.files)]
        self._send_json(200, {"id": repo, "sha": commit.oid, "private": private, "siblings": siblings, "lastModified": commit.date})

    def _route_preupload(self, body: bytes, repo: str, rev: str) -> None:
        with self.hub.lock:
            commit = self._commit(repo, rev)
        out = []
        for item in json.loads(body)["files"]:
            existing = commit.files.get(item["path"])
            # The client skips files whose remote oid equals its local one (sha256 for LFS, git oid otherwise).
            oid = None if existing is None else (existing.sha256 if existing.lfs else existing.oid)
            mode = "lfs" if is_lfs_path(item["path"], item["size"]) else "regular"
            out.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send_json(200, {"files": out, "commitOid": commit.oid})

    def _route_lfs_batch(self, body: bytes, repo: str) -> None:
        with self.hub.lock:
            self._repo(repo)
            stored = {oid: len(data) for oid, data in self.hub.lfs_objects.items()}
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if stored.get(obj["oid"]) != obj["size"]:  # only missing objects get upload actions
                entry["authenticated"] = True
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.base_url}/_lfs/{obj['oid']}"},
                    "verify": {"href": f"{self.hub.base_url}/{repo}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        self._send_json(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _route_lfs_upload(self, body: bytes, oid: str) -> None:
        length = int(self.headers.get("Content-Length") or -1)
        stall = self.hub.take_stall()
        if stall is not None and length > 0:
            first = self.rfile.read(length // 2)
            stall[0].set()
            stall[1].wait(timeout=60)
            try:
                data = first + self.rfile.read(length - len(first))
            except OSError:
                data = first
            if len(data) != length:  # the uploader went away: keep nothing, like an aborted S3 PUT
                self.close_connection = True
                return
        else:
            data = self._read_body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "uploaded bytes do not match the LFS oid")
        with self.hub.lock:
            self.hub.lfs_objects[oid] = data
        self._send(200, b"")

    def _route_lfs_verify(self, body: bytes, repo: str) -> None:
        obj = json.loads(body)
        with self.hub.lock:
            data = self.hub.lfs_objects.get(obj["oid"])
        if data is None or len(data) != obj["size"]:
            raise HubError(404, "LFS object not found")
        self._send_json(200, {"success": True})

    def _route_commit(self, body: bytes, repo: str, rev: str) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        with self.hub.lock:
            repo_obj, head = self._repo(repo), self._commit(repo, rev)
            if header.get("parentCommit") not in (None, head.oid):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(head.files)
            for item in lines:
                key, value = item["key"], item["value"]
                path = value.get("path")
                if key == "file":
                    files[path] = Blob(base64.b64decode(value["content"]), lfs=False)
                elif key == "lfsFile":
                    content = self.hub.lfs_objects.get(value["oid"])
                    if content is None:
                        raise HubError(422, f"LFS object {value['oid']} of {path} was never uploaded")
                    files[path] = Blob(content, lfs=True)
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, "A file with this name doesn't exist", code="EntryNotFound")
                elif key == "deletedFolder":
                    files = {p: b for p, b in files.items() if not p.startswith(path.rstrip("/") + "/")}
                if key in ("file", "lfsFile") and self.hub.take_corruption(path):
                    flipped = bytearray(files[path].content)
                    flipped[len(flipped) // 2] ^= 0xFF
                    files[path] = Blob(bytes(flipped), lfs=files[path].lfs)
            oid = self.hub.new_commit(repo_obj, header["summary"], files)
        commit_url = f"{self.hub.base_url}/{repo}/commit/{oid}"
        self._send_json(200, {"success": True, "commitOid": oid, "commitUrl": commit_url, "pullRequestUrl": None})

    def _route_tree(self, body: bytes, repo: str, rev: str, path: str | None) -> None:
        with self.hub.lock:
            commit = self._commit(repo, rev)
        recursive, base = _truthy(self.query, "recursive"), f"{path.strip('/')}/" if path and path.strip("/") else ""
        files = {p: b for p, b in commit.files.items() if p.startswith(base)}
        if base and not files:
            raise HubError(404, f"{base} does not exist", code="EntryNotFound")
        dirs: set[str] = set()
        out = []
        for p in sorted(files):
            parts = p[len(base) :].split("/")
            dirs.update(base + "/".join(parts[:i]) for i in range(1, len(parts)))
            if recursive or len(parts) == 1:
                out.append(files[p].entry(p))
        for d in sorted(dirs):
            if recursive or "/" not in d[len(base) :]:
                out.append({"type": "directory", "path": d, "size": 0, "oid": hashlib.sha1(f"{commit.oid}:{d}".encode()).hexdigest()})
        self._send_json(200, _with_last_commit(out, commit) if _truthy(self.query, "expand") else out)

    def _route_paths_info(self, body: bytes, repo: str, rev: str) -> None:
        form = parse_qs(body.decode())
        with self.hub.lock:
            commit = self._commit(repo, rev)
        out = [commit.files[p].entry(p) for p in form.get("paths", []) if p in commit.files]
        self._send_json(200, _with_last_commit(out, commit) if _truthy(form, "expand") else out)

    def _route_resolve(self, body: bytes, repo: str, rev: str, path: str) -> None:
        with self.hub.lock:
            commit = self._commit(repo, rev)
        blob = commit.files.get(path)
        if blob is None:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{blob.oid}"'}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.content))})
        self._send(200, blob.content, headers, ctype="application/octet-stream")
