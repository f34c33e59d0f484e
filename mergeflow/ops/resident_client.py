"""A command's side of the resident (mergeflow.ops.resident): hand itself over, pass signals on, end as its child ended."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

from mergeflow.ops.resident import LINUX, MESSAGE, OPT_OUT_VAR, private_socket_dir, resident_key, socket_path

CONNECT_TIMEOUT_S = 5.0
# Signals a command gets from its terminal or its supervisor, passed on to the served child.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def hand_over(argv: list[str], env: Mapping[str, str], import_env: Mapping[str, str]) -> None:
    """Run this command in the resident of its environment and end this process as the command ended;
    returns (start cold) where no resident serves it.

    `env`: the environment the command runs with; `import_env`: the one it would import Prefect under.
    """
    if env.get(OPT_OUT_VAR) == "0" or not LINUX:
        return None
    directory = private_socket_dir(create=False)
    if directory is None:
        return None
    key = resident_key(import_env)
    path = socket_path(key, directory)
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)  # a resident that does not even accept: start cold instead
        conn.connect(str(path))
        conn.settimeout(None)  # from the request on, the resident may have forked it: never run it twice
        request = {"op": "run", "key": key, "argv": argv, "env": dict(env), "cwd": os.getcwd(),
                   "path0": sys.path[0] if sys.path else "", "umask": _umask(),
                   "rlimits": _rlimits(), "affinity": sorted(os.sched_getaffinity(0))}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(MESSAGE) or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None  # gone, stale or busy: a cold start is the command as it always was
    pid = reply.get("pid")
    if not isinstance(pid, int):
        conn.close()
        return None  # refused (its reason is in the resident's log): cold
    _end_as(_await_child(conn, pid))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _rlimits() -> list[tuple[int, int, int]]:
    import resource

    limits = []
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            which = getattr(resource, name)
            try:
                soft, hard = resource.getrlimit(which)
            except (OSError, ValueError):
                continue
            limits.append((which, soft, hard))
    return limits


def _await_child(conn: socket.socket, pid: int) -> int:
    """Pass signals on to the child's process group until the resident reports its wait status."""

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    data = conn.recv(MESSAGE)  # restarted after each forwarded signal (PEP 475)
    if data:
        return int(json.loads(data)["status"])
    # The resident ended first (killed): the command may still run; its status is lost with the resident.
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = None
    if fd is not None:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            sel.select()
        os.close(fd)
    print("mergeflow: the resident process ended while serving this command; its exit status is unknown",
          file=sys.stderr, flush=True)
    return 1 << 8


def _end_as(status: int) -> NoReturn:
    """End this process the way the served command ended: its exit code, or the signal that killed it."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
