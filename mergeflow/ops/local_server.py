"""A local Prefect server in the background, started by the first command and reused by the next.

Without PREFECT_API_URL every Prefect process starts a temporary server of its own (seconds
per command) whose runs vanish when it exits. The command line instead keeps one
`prefect server start` running in the background: a state file under PREFECT_HOME records
it, a file lock keeps two first commands from starting two, and later commands find it
healthy and point PREFECT_API_URL at it. `mergeflow server status|start|stop` manage it.

This module never imports prefect: it must set PREFECT_API_URL before Prefect reads its
settings, and the server is a subprocess that needs no prefect in this one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Required, TypedDict

import tomllib

from mergeflow.errors import MergeflowError

STATE_FILE = "mergeflow-server.json"
LOG_FILE = "mergeflow-server.log"
LOCK_FILE = "mergeflow-server.lock"
OPT_OUT_VAR = "MERGEFLOW_LOCAL_SERVER"  # "0" / "off": a temporary server per command (start_command_server)
STARTUP_TIMEOUT_VAR = "MERGEFLOW_SERVER_STARTUP_TIMEOUT"
DEFAULT_STARTUP_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


class LocalServerError(MergeflowError):
    """The background Prefect server could not be started or stopped."""


@dataclass(frozen=True)
class ServerState:
    """What the state file records about the background server."""

    pid: int
    port: int
    api_url: str
    ui_url: str
    started_at: float  # time.time() when it answered its first health check
    log_path: str


def prefect_home() -> Path:
    """PREFECT_HOME as Prefect resolves it (default ~/.prefect)."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def local_server_enabled() -> bool:
    return os.environ.get(OPT_OUT_VAR, "").strip().lower() not in ("0", "off", "false", "no")


def configured_api_url() -> str | None:
    """The API URL the user configured (environment or Prefect profile), read without importing Prefect."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if _settings_files_in_cwd():
        return _api_url_from_prefect()
    return _profile_api_url()


def _api_url_from_prefect() -> str | None:
    """Ask Prefect itself, in a child process: .env, prefect.toml and [tool.prefect] have many spellings.

    Not in this process: once Prefect has built its settings here, a PREFECT_API_URL set
    afterwards is ignored. About a second, and only for users who keep such files.
    """
    code = "from prefect.settings import get_current_settings as s; print(s().api.url or '')"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None  # Prefect cannot read its own settings: the flow will say why
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else None


def _settings_files_in_cwd() -> bool:
    if Path("prefect.toml").is_file():
        return True
    if Path(".env").is_file() and "PREFECT_" in _read_text(Path(".env")):
        return True
    return Path("pyproject.toml").is_file() and "[tool.prefect" in _read_text(Path("pyproject.toml"))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _profile_api_url() -> str | None:
    """PREFECT_API_URL of the active profile in profiles.toml (how Prefect chooses it), or None."""
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or prefect_home() / "profiles.toml").expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None  # no file: Prefect's built-in default profile, which sets no API URL
    active = os.environ.get("PREFECT_PROFILE") or data.get("active")
    profile = data.get("profiles", {}).get(active, {}) if isinstance(active, str) else {}
    url = profile.get("PREFECT_API_URL") if isinstance(profile, dict) else None
    return str(url) if url else None


def healthy(api_url: str, timeout: float = 1.0) -> bool:
    """True when a Prefect API answers GET /health at `api_url`."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_state(home: Path | None = None) -> ServerState | None:
    path = (home or prefect_home()) / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ServerState(**{k: data[k] for k in ServerState.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: treated as no server


def _write_state(home: Path, state: ServerState) -> None:
    path = home / STATE_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def _server_lock(home: Path) -> Iterator[None]:
    """One process at a time decides whether to start the server (the others wait, then reuse it)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_FILE, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a container's init may not reap it at once)."""
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # only succeeds when this process started it


def _is_our_server(state: ServerState) -> bool:
    """The recorded pid still runs our `prefect server start` (not a reused pid of something else)."""
    if not is_running(state.pid):
        return False
    try:
        cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc: trust the pid
    return all(part in cmdline for part in (b"prefect", b"server", b"start", str(state.port).encode()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _startup_timeout() -> float:
    try:
        return float(os.environ.get(STARTUP_TIMEOUT_VAR, DEFAULT_STARTUP_TIMEOUT_S))
    except ValueError:
        return DEFAULT_STARTUP_TIMEOUT_S


# The UI asks this address for its data (GET /ui-settings reports it). Prefect derives it from
# PREFECT_SERVER_API_PORT, never from `--port`: a server on a free port whose UI still asked
# 127.0.0.1:4200 showed a blank page, or another server's runs when one listened there.
UI_API_URL_VARS = ("PREFECT_SERVER_UI_API_URL", "PREFECT_UI_API_URL")


def _server_env(home: Path, api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_UI_URL", *UI_API_URL_VARS)}
    env["PREFECT_HOME"] = str(home)
    env["PREFECT_SERVER_UI_API_URL"] = api_url
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # The CLI silences its own console logs; the server's log file should still say what happens.
    env.pop("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", None)
    for name, value in RECORDER_BATCHING.items():
        env.setdefault(name, value)  # the user's own setting wins
    return env


# Prefect's task-run recorder writes each task-run event in its own transaction; after a flow of
# a dozen tasks the next flow run's creation waits about 2 s behind that queue (measured on the
# tests' server: a tiny merge took 0.5 s or 2.4 s, alternately; batched, 0.5 s every time).
# Back-to-back runs (backfill, a served deployment, a rerun) pay it each time. The interval is
# whole seconds: Prefect truncates it, and 0 would be a busy loop.
RECORDER_BATCHING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}


def _start(home: Path, *, ends_with_this_process: bool = False) -> ServerState:
    """Start `prefect server start` detached (its own session, so Ctrl-C here leaves it) and wait for health."""
    port = _free_port()
    api_url = f"http://{HOST}:{port}/api"
    log_path = home / LOG_FILE
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port), "--analytics-off"]
    if ends_with_this_process:
        command.append("--no-ui")  # its runs vanish with it: no UI to link to
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, env=_server_env(home, api_url), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True, cwd=home,
                                   preexec_fn=_end_with_parent if ends_with_this_process else None)
    try:
        _wait_healthy(process, api_url, log_path)
    except BaseException:  # Ctrl-C included: a server nobody recorded must not keep running
        _stop_group(process.pid)
        raise
    state = ServerState(pid=process.pid, port=port, api_url=api_url, ui_url=f"http://{HOST}:{port}",
                        started_at=time.time(), log_path=str(log_path))
    _write_state(home, state)
    return state


def _wait_healthy(process: subprocess.Popen[bytes], api_url: str, log_path: Path) -> None:
    timeout = _startup_timeout()
    deadline = time.monotonic() + timeout
    while not healthy(api_url):
        if process.poll() is not None:
            raise LocalServerError(f"the local Prefect server exited with code {process.returncode} while starting; "
                                   f"see {log_path} (or set PREFECT_API_URL to a running server)")
        if time.monotonic() > deadline:
            raise LocalServerError(f"the local Prefect server did not answer within {timeout:g} s; see {log_path} "
                                   f"(raise {STARTUP_TIMEOUT_VAR}, or set PREFECT_API_URL to a running server)")
        time.sleep(0.2)


def _alive_and_healthy(state: ServerState, patience_s: float = 10.0) -> bool:
    """A recorded server that still runs gets some patience: a busy machine may answer slowly."""
    if healthy(state.api_url):
        return True
    deadline = time.monotonic() + patience_s
    while _is_our_server(state) and time.monotonic() < deadline:
        if healthy(state.api_url, timeout=2.0):
            return True
        time.sleep(0.5)
    return False


def _ui_asks_itself(state: ServerState) -> bool:
    """The server's UI asks its own API for data (a server started by an older mergeflow asked port 4200)."""
    try:
        with urllib.request.urlopen(f"{state.ui_url}/ui-settings", timeout=5) as response:
            return json.loads(response.read()).get("api_url") == state.api_url
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return False


def start_local_server(home: Path | None = None, *, before_start: Callable[[], None] | None = None) -> tuple[ServerState, bool]:
    """The running background server, started if needed (`before_start` called first); True when this call started it."""
    home = home or prefect_home()
    with _server_lock(home):
        state = read_state(home)
        if state is not None and _alive_and_healthy(state) and _ui_asks_itself(state):
            return state, False
        if state is not None and _is_our_server(state):
            _stop_group(state.pid)  # running but not answering: replace it rather than leave it behind
        if before_start is not None:
            before_start()
        return _start(home), True


def _end_with_parent() -> None:
    """In the server's child before exec: SIGTERM it when the command's process ends, however it ends."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_command_server() -> ServerState:
    """With MERGEFLOW_LOCAL_SERVER=0 and no API configured: a server for this one command.

    Prefect's own temporary server is a child in the command's process group, so a terminal's
    Ctrl-C killed it with the command, and the interrupted export then spent a minute retrying
    sends to it and printing their errors. This one is in its own session, ends with the
    command's process (PR_SET_PDEATHSIG, so even a kill -9 leaves none behind) and is stopped by
    an exit hook registered before Prefect's, which therefore still reach it when they drain.
    """
    import atexit
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="mergeflow-command-server-"))
    state = _start(home, ends_with_this_process=True)

    def stop() -> None:
        _stop_group(state.pid)
        shutil.rmtree(home, ignore_errors=True)

    atexit.register(stop)
    return state


def ensure_command_server() -> ServerState | None:
    """Opted out of the background server and no API configured: start this command's own (see above).

    Must run before Prefect is imported in this process, like ensure_local_server.
    """
    if local_server_enabled() or configured_api_url():
        return None
    state = start_command_server()
    os.environ["PREFECT_API_URL"] = state.api_url
    os.environ["PREFECT_UI_URL"] = ""  # --no-ui: no flow-run link at all (a user's PREFECT_UI_URL names another server)
    return state


# Measured here (2 cores, fresh PREFECT_HOME, `mergeflow server start`): 12.5-17.7 s quiet, 31 s busy, most of it
# Prefect creating its SQLite database and importing its server; the README quotes the same.
FIRST_START_HINT = "about 10-35 s on a small machine"


def ensure_local_server(stream: IO[str] = sys.stderr) -> ServerState | None:
    """For a command about to run a flow: point PREFECT_API_URL at the background server.

    Does nothing when the user configured an API (environment or profile) or opted out
    with MERGEFLOW_LOCAL_SERVER=0. Must run before Prefect is imported in this process.
    """
    if not local_server_enabled() or configured_api_url():
        return None
    began = time.monotonic()

    def say_starting() -> None:  # the first start is the slowest moment of a first try: say so before it
        print(f"mergeflow: starting a local Prefect server (once; {FIRST_START_HINT}, later commands reuse it)",
              file=stream, flush=True)

    state, started = start_local_server(before_start=say_starting)
    if started:
        print(f"mergeflow: started a local Prefect server at {state.ui_url} in {time.monotonic() - began:.0f} s "
              "(runs stay visible there; stop it with 'mergeflow server stop')", file=stream, flush=True)
    os.environ["PREFECT_API_URL"] = state.api_url
    os.environ["PREFECT_UI_URL"] = state.ui_url  # the links name this server's UI, whatever PREFECT_UI_URL said
    return state


def _stop_group(pid: int, wait_s: float = 10.0) -> None:
    """SIGTERM the server's process group (uvicorn and services), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not is_running(pid):
                return
            time.sleep(0.1)


class ServerStatus(TypedDict, total=False):
    """`mergeflow server status` (and `start`): whether our server runs, and where, when one is recorded."""

    running: Required[bool]
    state_file: Required[str]
    ui_url: str
    url: str  # the older name of ui_url
    api_url: str
    pid: int
    port: int
    log: str
    configured_api_url: str  # the PREFECT_API_URL commands use instead
    started: bool  # `start` only: whether this call started it


class ServerStopped(TypedDict):
    """`mergeflow server stop`: whether a server of ours was stopped, and its pid."""

    stopped: bool
    pid: int | None


def server_status(home: Path | None = None) -> ServerStatus:
    """What `mergeflow server status` prints."""
    home = home or prefect_home()
    state = read_state(home)
    running = state is not None and _is_our_server(state) and healthy(state.api_url)
    out: ServerStatus = {"running": running, "state_file": str(home / STATE_FILE)}
    if state is not None:
        # `url` is the older key; `ui_url` says what it is: the address to open in a browser.
        out.update(ui_url=state.ui_url, url=state.ui_url, api_url=state.api_url, pid=state.pid, port=state.port, log=state.log_path)
    if configured_api_url():
        out["configured_api_url"] = configured_api_url()  # commands use this one, not the local server
    return out


def stop_local_server(home: Path | None = None) -> ServerStopped:
    """Stop the background server if one is recorded; safe to call again."""
    home = home or prefect_home()
    with _server_lock(home):
        state = read_state(home)
        stopped = state is not None and _is_our_server(state)
        if stopped:
            assert state is not None
            _stop_group(state.pid)
            if is_running(state.pid):
                raise LocalServerError(f"the local Prefect server (pid {state.pid}) did not stop; kill it by hand")
        with contextlib.suppress(FileNotFoundError):
            (home / STATE_FILE).unlink()
    return {"stopped": stopped, "pid": state.pid if state else None}
