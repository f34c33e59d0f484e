"""A local Hub-protocol test server: the part of the Hugging Face Hub HTTP API that
huggingface_hub 2.x calls to create a repo, commit files (preupload, LFS batch + basic
transfer, NDJSON commit), read repo info, list trees and download files.

The real huggingface_hub client talks to it over HTTP on 127.0.0.1 (pass `base_url` as the
endpoint). It keeps every commit in memory, stores what it receives byte for byte, and has
fault injection knobs: fail a route with a status, drop a connection mid-request, corrupt a
stored file, stall an LFS upload so a test can kill the uploader. It does not speak Xet:
tests set `HF_HUB_DISABLE_XET` so the client uses plain LFS. The protocol itself is in
`hub_protocol.py`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Literal

from hub_protocol import Blob, Commit, HubHandler, Repo, is_lfs_path

Fault = tuple[int, dict[str, str]] | Literal["drop"] | None


class LocalHubServer:
    """A Hub-protocol HTTP server on 127.0.0.1 with in-memory repos; use as a context manager."""

    def __init__(self, valid_tokens: set[str] | None = None) -> None:
        self.valid_tokens = valid_tokens  # None: accept any request (auth not under test)
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # oid -> bytes, as received by LFS PUTs
        self.requests: list[tuple[str, str]] = []  # (route, method) of every request, in order
        self.lock = threading.Lock()
        self._failures: dict[str, list[tuple[int, dict[str, str]]]] = {}
        self._drops: Counter[str] = Counter()
        self._corrupt: set[str] = set()
        self._stall: tuple[threading.Event, threading.Event] | None = None
        self._commit_counter = 0
        self._httpd: ThreadingHTTPServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> LocalHubServer:
        """Bind a free port and serve in a daemon thread."""
        handler = type("BoundHubHandler", (HubHandler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> LocalHubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # ---- fault injection (set by tests) ----------------------------------------------------
    def fail_next(self, route: str, status: int, count: int = 1, headers: dict[str, str] | None = None) -> None:
        """Answer the next `count` requests of `route` with `status` (and extra headers, e.g. Retry-After)."""
        with self.lock:
            self._failures.setdefault(route, []).extend([(status, headers or {})] * count)

    def drop_next(self, route: str, count: int = 1) -> None:
        """Read half of the next `count` request bodies of `route`, then cut the connection without answering."""
        with self.lock:
            self._drops[route] += count

    def corrupt_next_commit_of(self, path: str) -> None:
        """Flip one byte of `path` when the next commit stores it (the server then reports what it holds)."""
        with self.lock:
            self._corrupt.add(path)

    def stall_next_lfs_upload(self) -> tuple[threading.Event, threading.Event]:
        """Stop the next LFS PUT halfway: returns (started, release) events for a test that kills the uploader."""
        started, release = threading.Event(), threading.Event()
        with self.lock:
            self._stall = (started, release)
        return started, release

    # ---- used by the handler ---------------------------------------------------------------
    def record_request(self, route: str, method: str) -> Fault:
        """Log a request and hand out the fault injected for it, if any."""
        with self.lock:
            self.requests.append((route, method))
            if self._drops[route] > 0:
                self._drops[route] -= 1
                return "drop"
            queue = self._failures.get(route)
            return queue.pop(0) if queue else None

    def take_stall(self) -> tuple[threading.Event, threading.Event] | None:
        with self.lock:
            stall, self._stall = self._stall, None
            return stall

    def take_corruption(self, path: str) -> bool:
        """Whether to corrupt `path` now (call with the lock held: commits run under it)."""
        if path in self._corrupt:
            self._corrupt.discard(path)
            return True
        return False

    def new_commit(self, repo: Repo, title: str, files: dict[str, Blob]) -> str:
        """Append a commit to `repo` (call with the lock held) and return its oid."""
        self._commit_counter += 1
        oid = hashlib.sha1(f"{repo.repo_id}:{self._commit_counter}:{title}".encode()).hexdigest()
        repo.commits.append(Commit(oid=oid, title=title, files=files))
        return oid

    # ---- inspection ------------------------------------------------------------------------
    def count(self, route: str, method: str | None = None) -> int:
        """How many requests `route` received (failed and dropped ones included)."""
        with self.lock:
            return sum(1 for r, m in self.requests if r == route and (method is None or m == method))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, Blob]:
        """The files of a repo at a revision."""
        with self.lock:
            commit = self.repos[repo_id].find(revision)
            assert commit is not None, revision
            return dict(commit.files)

    def commit_files(self, repo_id: str, files: dict[str, bytes], title: str = "test commit") -> str:
        """Commit files directly (as another client would), returning the new commit oid."""
        with self.lock:
            repo = self.repos[repo_id]
            merged = dict(repo.head.files)
            merged.update({p: Blob(c, lfs=is_lfs_path(p, len(c))) for p, c in files.items()})
            return self.new_commit(repo, title, merged)
