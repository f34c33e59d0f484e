"""A real, throw-away Prefect server for tests: `with start_prefect_server(tmp_path) as server`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergeflow.ops.local_server import RECORDER_BATCHING, healthy
from mergeflow.ops.plain_http import ONE_CERTIFICATE

_SERVER_SETTINGS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_UI_ENABLED": "false",
    # Faster event persistence than the 5 s default, so tests that read events back wait less.
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5",
    # The batching mergeflow's own background server uses (mergeflow/ops/local_server.py says why).
    **RECORDER_BATCHING,
    "PREFECT_LOGGING_LEVEL": "WARNING",
}

# Off on a server started with events=False (the session's own: tests/conftest.py). Storing each event and
# evaluating it against the automations is about a quarter of the server's CPU per tiny merge and validation
# (0.22-0.25 CPU seconds with both, 0.15-0.18 without; 20 of each, measured), and the suite's two session
# servers spent ~62 CPU seconds apiece, a sixth of the suite's CPU. Recording the task runs from their state
# events is a quarter of what was left: 0.13-0.16 CPU seconds per tiny merge with it, 0.11 without (30 merges,
# twice each, 2026-12-08). Only the tests that read events or task runs back, or start runs from events, need
# any of the three: they take the server that has them (the `prefect_events_server` fixture), as the
# cluster's server has. tests/prefect_runs.py refuses to read task runs from a server that does not record them.
_WITHOUT_EVENTS = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
}
# The API URLs of this process's servers that do not record task runs (tests/prefect_runs.py reads it).
NO_TASK_RUNS: set[str] = set()


@dataclass(frozen=True)
class PrefectServer:
    """A running `prefect server start` subprocess with its own PREFECT_HOME and SQLite file."""

    api_url: str
    home: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    auth_string: str | None = None  # PREFECT_SERVER_API_AUTH_STRING of the server, when it has one
    routes_events: bool = False  # activating it sends this process's events and API logs to it (the session's servers)

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process that should talk to this server."""
        env = _without_prefect_vars(dict(os.environ) if base is None else base)
        env["PREFECT_HOME"] = str(self.home)
        env["PREFECT_API_URL"] = self.api_url
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        if self.auth_string:
            env["PREFECT_API_AUTH_STRING"] = self.auth_string
        return env

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """Point this process's Prefect settings at the server for the duration of the block."""
        # Prefect reads the environment once at import; a settings context is the
        # supported way to change PREFECT_API_URL inside a running process.
        import prefect.context

        if self.routes_events:
            _send_events_and_logs_to(self.api_url)
        current = prefect.context.get_settings_context()
        with prefect.context.SettingsContext(profile=current.profile, settings=_pointed_at(current.settings, self.api_url)):
            yield

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


_EVENTS_TO: list[str] = []  # the API URL this process's Prefect events and API-log workers were last started for


def _send_events_and_logs_to(api_url: str) -> None:
    """Prefect keeps one events worker and one API-log worker per process, keyed without the API URL: the first
    server they send to gets every later test's events and logs. Activating another of the session's servers
    (the one that stores events, or back) drains both, so the next event or log starts a worker for it."""
    if _EVENTS_TO == [api_url]:
        return
    drain_events_and_logs()
    _EVENTS_TO[:] = [api_url]


def drain_events_and_logs() -> None:
    """Send this process's queued Prefect logs and events now, and end the workers that send them.

    Before a server stops: otherwise Prefect's exit hook retries against the stopped server for over a minute.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


_LAST_POINTED: list[tuple[Any, str, Any]] = []  # (settings, api_url, those settings pointed at it): the last one


def _pointed_at(settings: Any, api_url: str) -> Any:
    """`settings` with the API URL, no in-process heartbeats and the one-certificate CA file.

    The CA file is the product's own (mergeflow/ops/plain_http.py): the server is plain http://, and
    certifi's bundle took 13-100 ms per in-process client.

    What `temporary_settings(updates=...)` would build, built once: validating a whole Settings copy per
    activation cost 9.5 of the workers' ~430 sampled CPU seconds in a py-spy profile of the suite, and
    most tests enter this (the prefect_api fixture), always from the same settings. The cached
    entry holds `settings` itself, so an `is` test cannot match another object that reused its id.
    """
    if _LAST_POINTED and _LAST_POINTED[0][0] is settings and _LAST_POINTED[0][1] == api_url:
        return _LAST_POINTED[0][2]
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    # No flow-run heartbeats in-process: each would be one more event per run to the shared
    # server, and only tests/test_heartbeats.py needs them (it turns them on). The CLI
    # subprocesses run with Prefect's default (a heartbeat every 180 s), as users do.
    pointed = settings.copy_with_update(updates={PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                                                 PREFECT_API_SSL_CERT_FILE: str(ONE_CERTIFICATE)})
    _LAST_POINTED[:] = [(settings, api_url, pointed)]
    return pointed


def _without_prefect_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("PREFECT_")}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(api_url: str) -> bool:
    return healthy(api_url, timeout=2)  # the product's own check (mergeflow/ops/local_server.py)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    # The server spawns helpers (uvicorn, services); the whole session must go.
    # SIGKILL at once: a graceful stop took 5 s, at the end of every worker's session, and nothing of
    # a throw-away server (its home and database are deleted next) needs it.
    for sig, wait_s in ((signal.SIGKILL, 10.0),):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _migrated_template() -> Path:
    """Where a database that a server of this Prefect version has just created (migrated, empty) is kept.

    Creating Prefect's SQLite database (its migrations) was half of a test server's start on the
    loaded two-core machine: 9 of its 19 CPU seconds, 33 s of its 56 s to healthy. A
    server started on a copy still runs its migrations at start, which find nothing to do (or bring
    an older copy up to date), so the copy only saves their work. Kept across runs, in the
    temporary directory, per Prefect version; only the suite's own servers use it, never a server
    whose start a test is about (mergeflow's local server, Prefect's per-command one).
    """
    from importlib.metadata import version

    return Path(tempfile.gettempdir()) / f"mergeflow-tests-migrated-prefect-{version('prefect')}.db"


def _keep_as_template(database: Path, template: Path) -> None:
    """A consistent copy of a new server's database (SQLite's online backup), moved into place atomically."""
    if template.exists() or not database.is_file():
        return
    partial = template.with_name(f"{template.name}.{os.getpid()}.partial")
    try:
        with contextlib.closing(sqlite3.connect(database)) as source, contextlib.closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
        os.replace(partial, template)
    except (OSError, sqlite3.Error):  # a template is only a saving: the next server migrates a new database
        partial.unlink(missing_ok=True)


def seeded_prefect_home(home: Path) -> Path:
    """A new PREFECT_HOME holding an already-migrated, empty database, for a test whose server (mergeflow's
    local background one) is not what it is about.

    Such a server then starts on the copy and its migrations find nothing to do: about 5 of the 8-13 CPU
    seconds of each start on the two-core machine, spent once per suite instead of once per server.
    The first-run path keeps fresh homes elsewhere (test_local_server.py's reuse test; the per-command
    server, which makes its own temporary home, is never seeded).
    """
    home.mkdir(parents=True, exist_ok=True)
    template = _migrated_template()
    if not template.is_file():
        _migrate_template(template)
    if template.is_file() and not (home / "prefect.db").exists():
        shutil.copyfile(template, home / "prefect.db")
    return home


def _migrate_template(template: Path) -> None:
    """Create the template with Prefect's own migrations, in a home of its own (nothing else runs there)."""
    with tempfile.TemporaryDirectory(prefix="mergeflow-tests-migrate-") as scratch:
        env = _without_prefect_vars(dict(os.environ))
        env.update(PREFECT_HOME=scratch, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{Path(scratch) / 'prefect.db'}")
        done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                              capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
        if done.returncode == 0:
            _keep_as_template(Path(scratch) / "prefect.db", template)


@contextlib.contextmanager
def start_prefect_server(tmp_path: Path, *, startup_timeout: float = 90.0, auth_string: str | None = None,
                         events: bool = True) -> Iterator[PrefectServer]:
    """Start `prefect server start` on a free port with a temp PREFECT_HOME; stop it on exit.

    With `auth_string`, the server requires basic authentication (PREFECT_SERVER_API_AUTH_STRING).
    With `events=False` it neither stores events nor runs automations on them (_WITHOUT_EVENTS).
    """
    home = Path(tmp_path) / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "server.log"
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = _without_prefect_vars(dict(os.environ))
    env.update(_SERVER_SETTINGS)
    if not events:
        env.update(_WITHOUT_EVENTS)
    env["PREFECT_HOME"] = str(home)
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{home / 'prefect.db'}"
    template = _migrated_template()
    if template.is_file() and not (home / "prefect.db").exists():
        shutil.copyfile(template, home / "prefect.db")
    if auth_string:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    command = [
        sys.executable, "-m", "prefect", "server", "start",
        "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--analytics-off",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = PrefectServer(api_url=api_url, home=home, log_path=log_path, process=process, auth_string=auth_string)
    if not events:
        NO_TASK_RUNS.add(api_url)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _healthy(api_url):
            if process.poll() is not None:
                raise RuntimeError(f"prefect server exited with {process.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy after {startup_timeout} s:\n{server.log_tail()}")
            time.sleep(0.25)
        _keep_as_template(home / "prefect.db", template)
        yield server
    finally:
        _stop(process)
        NO_TASK_RUNS.discard(api_url)
