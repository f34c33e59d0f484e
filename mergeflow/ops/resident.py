"""A resident mergeflow process: commands hand their work to an interpreter that has already imported
torch and Prefect, which forks a fresh process for each.

Why: importing torch and Prefect is most of what a command costs before it does anything (2-4 s on
this project's 2-core machines, whatever the model's size). `mergeflow resident start` pays it once;
every later command of the same environment finds the resident's socket, passes its argv, environment,
working directory and its own stdin/stdout/stderr, and the resident forks a child that becomes the
command. The child is a process of its own (pid, process group, stdio, exit status, interpreter exit),
so the command behaves as a cold one does: the same output on the same terminal, the same exit status.

It serves a command only where that is faithful; otherwise the command starts cold, as without it:

- The environment the command would import torch and Prefect under (the caller's plus the CLI's
  pre-import defaults) must equal the resident's, apart from variables nothing it imported reads at
  import: MERGEFLOW_* (read where used), HF_* (huggingface_hub reads them when imported, and the
  resident never imports it: checked before it serves) and the shell's PWD, OLDPWD, SHLVL and _.
- The same interpreter with the same flags, the same installed packages (each import directory's
  mtime) and the same mergeflow source files (each file's size and mtime): an upgrade or an edit makes
  every resident of the old code unused; it ends after its idle time.
- The command's working directory must not shadow what the resident imported (`python -m` puts it
  first on the import path), and its resource limits must be ones the child can take.

Signals the command would get (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) are passed on to the child's process
group; a caller killed outright (kill -9) takes its command with it, as a cold command's death would.
The socket lives in a directory only its user can enter, and the resident serves only its own user.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from mergeflow.errors import UsageError

OPT_OUT_VAR = "MERGEFLOW_RESIDENT"  # =0: every command starts cold, even where a resident would serve it
# pidfd_open, SO_PEERCRED, sched_getaffinity: Linux's. Elsewhere there is no resident, and every command starts cold.
LINUX = sys.platform.startswith("linux")
MESSAGE = 1 << 20  # the largest message either side sends (a request carries the whole environment)
SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, one for the terminating NUL
# Variables no module the resident imports reads at import time (see the module's docstring).
_UNREAD_PREFIXES = ("MERGEFLOW_", "HF_")
_UNREAD_NAMES = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
# mergeflow's own packages (flows, tasks and deployments live outside mergeflow/ in the source tree).
_OWN_PACKAGES = ("mergeflow", "mergeflow.flows", "mergeflow.tasks", "mergeflow.deployments")


class ResidentError(UsageError):
    """The resident process could not be started, reached or stopped."""


# --- where residents are found, and what they must share with a command ----------------------------


def socket_dir() -> Path:
    """This user's directory of resident sockets (short: a socket's path is limited to 107 bytes)."""
    return Path(tempfile.gettempdir()) / f"mergeflow-{os.getuid()}"


def private_socket_dir(create: bool) -> Path | None:
    """The socket directory once it is this user's alone (a directory, not a link, mode 0700); else None."""
    path = socket_dir()
    if create:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def socket_path(key: str, directory: Path) -> Path:
    return directory / f"r-{key[:24]}.sock"


def read_at_import(env: Mapping[str, str]) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in env.items() if k not in _UNREAD_NAMES and not k.startswith(_UNREAD_PREFIXES))


def _mtime(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return -1


def _own_source_files() -> list[tuple[str, int, int]]:
    """(path, size, mtime) of every .py file of mergeflow's packages, in a stable order."""
    found: list[tuple[str, int, int]] = []
    for name in _OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            stack = [root]
            while stack:
                with os.scandir(stack.pop()) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False) and entry.name != "__pycache__":
                            stack.append(entry.path)
                        elif entry.name.endswith(".py"):
                            st = entry.stat()
                            found.append((entry.path, st.st_size, st.st_mtime_ns))
    return sorted(found)


def resident_key(import_env: Mapping[str, str]) -> str:
    """What a command and a resident must share for the resident to serve it, as one digest."""
    identity = {
        "env": read_at_import(import_env),
        # The binary, not the name it was started by (python, python3.11, a console script's shebang);
        # a virtual environment is told apart by its prefix and import path.
        "executable": os.path.realpath(sys.executable),
        "prefix": sys.prefix,
        "version": sys.version,
        "flags": repr(sys.flags),
        "uid": os.getuid(),
        # sys.path[0] is the script's or working directory (checked per command); the rest is where
        # packages are installed: installing or removing one changes its directory's mtime.
        "path": [(p, _mtime(p)) for p in sys.path[1:]],
        "source": _own_source_files(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


# --- asking a resident ------------------------------------------------------------------------------


class ResidentStatus(TypedDict):
    """One resident, as `mergeflow resident status` lists it."""

    pid: int
    socket: str
    serves_this_environment: bool
    served: int
    running: int
    idle_minutes: float
    started: float


def ask(path: Path, op: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """A resident's answer to `op` (status, stop), or None where nothing answers at `path`."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        conn.send(json.dumps({"op": op}).encode())
        data = conn.recv(MESSAGE)
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


def residents(key: str) -> list[ResidentStatus]:
    """Every resident of this user that answers, stale sockets removed on the way."""
    directory = private_socket_dir(create=False)
    found: list[ResidentStatus] = []
    for path in sorted(directory.glob("r-*.sock")) if directory is not None else []:
        answer = ask(path, "status")
        if answer is None:
            if _nobody_listens(path):
                path.unlink(missing_ok=True)  # its resident was killed: nothing will answer there again
            continue
        found.append({"pid": answer["pid"], "socket": path.name, "serves_this_environment": answer["key"] == key,
                      "served": answer["served"], "running": answer["running"],
                      "idle_minutes": answer["idle_minutes"], "started": answer["started"]})
    return found


def _nobody_listens(path: Path) -> bool:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(str(path))
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        conn.close()
    return False
