"""The resident's side (mergeflow.ops.resident): import once, then fork a child that takes each command's place."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from mergeflow.ops.resident import (
    LINUX,
    MESSAGE,
    SOCKET_PATH_MAX,
    ResidentError,
    private_socket_dir,
    read_at_import,
    resident_key,
    socket_dir,
    socket_path,
)

REQUEST_TIMEOUT_S = 5.0  # how long the resident waits for a connected caller's request
# huggingface_hub reads HF_* when it is imported (and these import it): a resident holding one would
# impose its own HF_* settings on every command, so it must not have imported any of them.
NEVER_PRELOADED = ("huggingface_hub", "transformers", "diffusers", "peft")


@dataclass
class _Served:
    pid: int
    conn: socket.socket
    pidfd: int


@dataclass
class Resident:
    """The serving loop: accept, fork, report each child's wait status, end after `idle_s` without work."""

    key: str
    path: Path
    idle_s: float
    become: Callable[[], NoReturn]  # what a child runs once it has taken the command's place
    import_env_of: Callable[[Mapping[str, str]], Mapping[str, str]]  # a command's environment at import
    env_read_at_import: list[tuple[str, str]] = field(default_factory=list)  # the resident's own
    imported_roots: frozenset[str] = frozenset()
    served: int = 0
    started: float = field(default_factory=time.time)
    _children: dict[int, _Served] = field(default_factory=dict)
    _stopping: bool = False
    held: list[int] = field(default_factory=list)  # descriptors it holds for its life (its lock)
    _inherited: list[int] = field(default_factory=list)  # the loop's own descriptors, closed in each child

    def serve(self, listener: socket.socket, announce: Callable[[], None]) -> None:
        """Serve until stopped or idle; `announce` runs once it is ready, SIGTERM's handler included."""
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "listen")
        # SIGTERM stops it: the handler wakes the select, which Python would otherwise resume (PEP 475).
        wake_r, wake_w = os.pipe()
        sel.register(wake_r, selectors.EVENT_READ, "wake")

        def on_sigterm(_signum: int, _frame: Any) -> None:
            self._stop(sel, listener)
            os.write(wake_w, b"x")

        signal.signal(signal.SIGTERM, on_sigterm)
        self._inherited = [wake_r, wake_w, *self.held]
        announce()
        last_work = time.monotonic()
        while True:
            if self._stopping and not self._children:
                return
            timeout = None if self._children else max(0.0, last_work + self.idle_s - time.monotonic())
            events = sel.select(timeout)
            if not events and not self._children and time.monotonic() >= last_work + self.idle_s:
                self._stop(sel, listener)
                return
            for key, _ in events:
                if key.data == "listen":
                    self._accept(sel, listener)
                elif key.data == "wake":
                    os.read(wake_r, 64)
                elif isinstance(key.data, tuple) and key.data[0] == "exit":
                    self._reap(sel, key.data[1])
                elif isinstance(key.data, tuple) and key.data[0] == "caller":
                    self._caller_gone(sel, key.data[1])
            last_work = time.monotonic()

    def _stop(self, sel: selectors.BaseSelector, listener: socket.socket) -> None:
        """Take no more commands; those running are still reported to their callers."""
        if not self._stopping:
            self._stopping = True
            self.path.unlink(missing_ok=True)
            try:
                sel.unregister(listener)
            except (KeyError, ValueError):
                pass
            listener.close()

    def _accept(self, sel: selectors.BaseSelector, listener: socket.socket) -> None:
        if self._stopping:
            return  # stopped by SIGTERM while this event waited: the listener is closed
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            if _peer_uid(conn) != os.getuid():
                conn.close()  # the directory is private: this is not expected, and is never served
                return
            conn.settimeout(REQUEST_TIMEOUT_S)  # a caller that connects and says nothing holds up no one
            data, fds, _flags, _addr = socket.recv_fds(conn, MESSAGE, 3)
            conn.settimeout(None)
            request = json.loads(data)
        except (OSError, ValueError):
            conn.close()
            return
        op = request.get("op")
        if op == "status":
            _answer(conn, {"pid": os.getpid(), "key": self.key, "served": self.served, "running": len(self._children),
                           "idle_minutes": self.idle_s / 60, "started": self.started})
        elif op == "stop":
            _answer(conn, {"pid": os.getpid(), "stopping": True, "running": len(self._children)})
            self._stop(sel, listener)
        elif op == "run" and len(fds) == 3:
            self._run(sel, listener, conn, request, fds)
            return
        else:
            conn.close()
        for fd in fds:
            os.close(fd)

    def _run(self, sel: selectors.BaseSelector, listener: socket.socket, conn: socket.socket,
             request: dict[str, Any], fds: list[int]) -> None:
        try:
            refusal = self._refusal(request)
        except (KeyError, TypeError, ValueError, OSError) as exc:  # a malformed request ends no one's resident
            refusal = f"a request it cannot read ({type(exc).__name__})"
        pid = -1
        if refusal is None:
            try:
                pid = os.fork()
            except OSError as exc:  # no memory or processes left for one more: the caller starts cold
                refusal = f"fork failed ({exc})"
        if refusal is not None:
            print(f"mergeflow resident: not serving {request.get('argv')}: {refusal}", file=sys.stderr, flush=True)
            _answer(conn, {"refused": refusal})
            for fd in fds:
                os.close(fd)
            return
        if pid == 0:
            try:
                sel.close()
                listener.close()
                conn.close()
                # Other commands' connections and exit descriptors are the resident's alone: a copy held
                # here would keep their callers waiting on this command should the resident end first.
                for other in self._children.values():
                    other.conn.close()
                    os.close(other.pidfd)
                for fd in self._inherited:
                    os.close(fd)
                _take_the_commands_place(request, fds)
            except BaseException as exc:  # noqa: BLE001 (a child that could not become the command)
                print(f"mergeflow: the resident could not start this command: {exc}", file=sys.stderr, flush=True)
                os._exit(1)
            try:
                self.become()  # ends the process itself, however the command ends
            finally:
                os._exit(1)  # never back into the resident's loop
        for fd in fds:
            os.close(fd)
        self.served += 1
        pidfd = os.pidfd_open(pid)
        served = _Served(pid, conn, pidfd)
        self._children[pid] = served
        sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        sel.register(conn, selectors.EVENT_READ, ("caller", pid))
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:
            self._caller_gone(sel, pid)

    def _refusal(self, request: dict[str, Any]) -> str | None:
        # The caller's key covers the interpreter and the code too; the environment is checked here again.
        if request.get("key") != self.key or read_at_import(self.import_env_of(request["env"])) != self.env_read_at_import:
            return "another environment, interpreter or installed code"
        shadowed = shadowing(request.get("path0", ""), self.imported_roots)
        if shadowed:
            return f"the working directory holds {shadowed}, which `python -m` would import instead of the installed one"
        import resource

        for which, soft, hard in request["rlimits"]:
            _, own_hard = resource.getrlimit(which)
            if own_hard != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > own_hard):
                return f"resource limit {which} above the resident's own"
        return None

    def _reap(self, sel: selectors.BaseSelector, pid: int) -> None:
        served = self._children.pop(pid)
        sel.unregister(served.pidfd)
        os.close(served.pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            sel.unregister(served.conn)
        except (KeyError, ValueError):
            pass
        try:
            served.conn.send(json.dumps({"status": status}).encode())
        except OSError:
            pass
        served.conn.close()

    def _caller_gone(self, sel: selectors.BaseSelector, pid: int) -> None:
        """The caller's end closed before its command ended: it was killed outright, and so is its command."""
        served = self._children.get(pid)
        if served is None:
            return
        try:
            if served.conn.recv(MESSAGE, socket.MSG_DONTWAIT):
                return  # not an end: a caller sends nothing after its request
        except BlockingIOError:
            return
        except OSError:
            pass
        try:
            sel.unregister(served.conn)
        except (KeyError, ValueError):
            pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _answer(conn: socket.socket, message: dict[str, Any]) -> None:
    """Send one answer and hang up; a caller already gone is no error of the resident's."""
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass
    conn.close()


def _peer_uid(conn: socket.socket) -> int:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def shadowing(path0: str, imported_roots: Iterable[str]) -> str | None:
    """A module or package in `path0` (first on the command's import path) that the command would import
    in place of the one the resident imported from elsewhere; None where there is none."""
    try:
        names = set(os.listdir(path0 or "."))
    except OSError:
        return None
    for root in sorted(imported_roots):
        for candidate in (root, f"{root}.py"):
            # A directory shadows as a regular package only: a namespace portion yields to a package found later.
            if candidate not in names or (candidate == root and not os.path.isfile(os.path.join(path0 or ".", root, "__init__.py"))):
                continue
            module = sys.modules.get(root)
            origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), None)
            here = os.path.realpath(os.path.join(path0 or ".", candidate))
            if origin is None or not (os.path.realpath(origin) + os.sep).startswith(here + os.sep):
                return candidate
    return None


def _take_the_commands_place(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: the command's process group, stdio, limits, environment and working directory."""
    import resource

    os.setsid()  # its own process group: the caller signals it, and all it starts, as a terminal would
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.umask(request["umask"])
    for which, soft, hard in request["rlimits"]:
        resource.setrlimit(which, (soft, hard))
    os.sched_setaffinity(0, request["affinity"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    if sys.path:
        sys.path[0] = request["path0"]
    _fresh_stdio()


def _fresh_stdio() -> None:
    """Python's stdio objects as a cold start would make them for these descriptors (a terminal's
    stdout is line-buffered, a pipe's is not; the encoding follows the command's environment)."""
    import io

    encoding = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or None
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        buffered: Any = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        line = mode == "w" and (tty or name == "stderr" or unbuffered)
        stream = io.TextIOWrapper(buffered, encoding=encoding, errors="backslashreplace" if name == "stderr" else None,
                                  line_buffering=line, write_through=name == "stderr" or unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_resident(import_env_of: Callable[[Mapping[str, str]], Mapping[str, str]], preload: Iterable[str],
                 become: Callable[[], NoReturn], idle_s: float) -> None:
    """The resident's process: import `preload`, say `ready` (one JSON line on stdout), serve until idle.

    `import_env_of`: the environment a command with a given environment imports Prefect under (the
    CLI's pre-import defaults applied): the resident imports under its own, and serves that key.
    """
    import importlib

    if not LINUX:
        raise ResidentError(f"a resident process needs Linux (pidfd_open, SO_PEERCRED), not {sys.platform}")
    import_env = import_env_of(os.environ)
    key = resident_key(import_env)  # before importing more, as a command computes it when it starts
    # Where it will listen, checked before the imports: a refusal costs no seconds of them.
    directory = private_socket_dir(create=True)
    if directory is None:
        raise ResidentError(f"{socket_dir()} must be a directory of this user's alone (mode 0700)")
    path = socket_path(key, directory)
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise ResidentError(f"its socket's path would be {len(os.fsencode(path))} bytes, more than a socket's "
                            f"{SOCKET_PATH_MAX}: set TMPDIR to a shorter directory")
    # Held for its whole life: of two residents started at once for one environment, one serves.
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise ResidentError(f"a resident already serves this environment ({path.name})") from None
    for name, value in import_env.items():
        os.environ.setdefault(name, value)
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork would lose those threads and the locks they hold
        raise ResidentError(f"threads started while importing: {[t.name for t in threading.enumerate()]}")
    imported = [name for name in NEVER_PRELOADED if name in sys.modules]
    if imported:
        raise ResidentError(f"imported while preloading, and they read HF_* at import: {imported}")
    path.unlink(missing_ok=True)  # left by a resident that was killed (its lock went with it)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    roots = frozenset(name.partition(".")[0] for name in sys.modules if not name.startswith("_"))
    resident = Resident(key=key, path=path, idle_s=idle_s, become=become, import_env_of=import_env_of,
                        env_read_at_import=read_at_import(import_env), imported_roots=roots, held=[lock])
    # What it imported lives as long as it does: out of the collector's sight, a child's collections
    # (its exit's too) never walk, and so never copy, the whole inherited heap.
    gc.freeze()

    def announce() -> None:
        print(json.dumps({"ready": True, "pid": os.getpid(), "socket": str(path)}), flush=True)
        os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # the starter stops reading; nothing else goes there

    try:
        resident.serve(listener, announce)
    finally:
        path.unlink(missing_ok=True)
