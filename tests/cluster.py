"""A throw-away multi-machine cluster on 127.0.0.1 for tests and benches, stopped by PID.

`with Cluster(root) as cluster:` then `cluster.start_postgres()`, `cluster.start_server()`,
`cluster.start_worker(name)`, `cluster.start_dask(workers=2)`: PostgreSQL (Debian's binaries,
an initdb in a temp dir, `pg_ctl start`), `prefect server start` on it, `prefect worker start`
processes each with their own PREFECT_HOME (two "machines" that share only the filesystem and
the server), and a `dask scheduler` with `dask worker` processes.

Every part runs in its own process group (its own session), and every group is killed when the
block ends, on an exception, on SIGTERM/SIGINT while the block runs, and at interpreter exit,
so nothing is left running when a test fails or is interrupted. (Only a SIGKILL of the test
process itself escapes that; PR_SET_PDEATHSIG would cover it, but it needs a preexec_fn, which is
unsafe in a process with threads, as Prefect's are.)
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

from prefect_server import _SERVER_SETTINGS, _without_prefect_vars, drain_events_and_logs, free_port

from mergeflow.ops.local_server import healthy

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PG_USER = "postgres"  # the Debian package's account: initdb and postgres refuse to run as root


def postgres_bindir() -> Path | None:
    """Where initdb and pg_ctl are: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (not on PATH)."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(bindir) / "initdb").is_file() and (Path(bindir) / "pg_ctl").is_file():
            return Path(bindir)
    return None


@dataclass
class Part:
    """One started part: a process group, its log, and how to tell it is up."""

    name: str
    pgid: int
    log: Path
    process: subprocess.Popen[bytes] | None = None
    stop_first: Callable[[], None] | None = None  # a graceful stop that reaps the part's children, if it needs one

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole group (the part and everything it started that stayed in its group), and what it
        started in a session of its own (Prefect's workspace supervisor starts a flow run's process so)."""
        if self.stop_first is not None:
            self.stop_first()
        strays = descendants(self.pgid)
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, chars: int = 3000) -> str:
        try:
            return f"--- {self.name} ({self.log}) ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Cluster:
    """The parts started so far; all are stopped when the `with` block ends, however it ends."""

    root: Path
    parts: list[Part] = field(default_factory=list)
    database_url: str = ""
    api_url: str = ""
    dask_address: str = ""
    env_extra: dict[str, str] = field(default_factory=dict)  # given to every worker and Dask worker
    _pgdata: Path | None = None
    _previous_handlers: dict[int, object] = field(default_factory=dict)

    # -- lifetime -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.root.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        if _in_main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self._previous_handlers.clear()
            atexit.unregister(self.stop)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt(f"signal {signum}")

    def stop(self) -> None:
        """Kill every part, newest first (workers before the server before the database)."""
        while self.parts:
            self.parts.pop().kill()
        if self._pgdata is not None:
            shutil.rmtree(self._pgdata, ignore_errors=True)
            self._pgdata = None

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.parts)

    def drain(self) -> None:
        """Send this process's queued Prefect logs and events while the server still runs (else Prefect's exit
        hook retries against the stopped server for over a minute)."""
        if not self.api_url:
            return
        with self.activated():
            drain_events_and_logs()

    def _spawn(self, name: str, command: list[str], env: dict[str, str], *, user: str | None = None,
               cwd: Path | None = None) -> Part:
        log = self.root / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, user=user,
                                       cwd=cwd or self.root)
        part = Part(name, process.pid, log, process)
        self.parts.append(part)
        return part

    def _wait(self, what: str, ready: Callable[[], bool], part: Part | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if part is not None and not part.alive():
                raise RuntimeError(f"{what} exited while starting\n{part.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout} s\n{part.tail() if part else ''}")
            time.sleep(0.2)

    # -- PostgreSQL ---------------------------------------------------------------------------

    def start_postgres(self, timeout: float = 60.0) -> str:
        """initdb in a temp dir and `pg_ctl start` on a free port of 127.0.0.1; the asyncpg URL for Prefect."""
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("no initdb/pg_ctl: install Debian's postgresql package")
        user = PG_USER if os.geteuid() == 0 else None
        # Outside pytest's tmp_path: that one is private to root, and the database runs as `postgres`.
        self._pgdata = Path(tempfile.mkdtemp(prefix="mergeflow-pg-"))
        data, sockets, log = self._pgdata / "data", self._pgdata / "sockets", self._pgdata / "postgres.log"
        sockets.mkdir()
        if user:
            shutil.chown(self._pgdata, user)
            shutil.chown(sockets, user)
        env = {"PATH": os.environ.get("PATH", ""), "LANG": "C", "LC_ALL": "C"}
        subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "prefect", "--auth=trust", "-E", "UTF8",
                        "--no-sync", "--no-instructions"], env=env, user=user, check=True, capture_output=True,
                       cwd=self._pgdata, timeout=timeout)
        port = free_port()
        options = (f"-h 127.0.0.1 -p {port} -k {sockets} -c fsync=off -c synchronous_commit=off "
                   "-c full_page_writes=off -c max_connections=200")
        # pg_ctl starts the postmaster in a session of its own (setsid): its pid is the group to kill.
        subprocess.run([str(bindir / "pg_ctl"), "start", "-D", str(data), "-l", str(log), "-o", options, "-w",
                        "-t", str(int(timeout))], env=env, user=user, check=True, capture_output=True,
                       cwd=self._pgdata, timeout=timeout + 10)
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        self.parts.append(Part("postgres", os.getpgid(pid), log, stop_first=lambda: _stop_postmaster(pid)))
        self.database_url = f"postgresql+asyncpg://prefect@127.0.0.1:{port}/postgres"
        return self.database_url

    # -- Prefect ------------------------------------------------------------------------------

    def spawn_server(self) -> Part:
        """`prefect server start` on PostgreSQL, not waited for (`wait_server`)."""
        home = self.root / "server-home"
        home.mkdir(exist_ok=True)
        port = free_port()
        env = _without_prefect_vars(dict(os.environ))
        env.update(_SERVER_SETTINGS)
        env.update({"PREFECT_HOME": str(home), "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url,
                    # A run held back by a deployment's concurrency limit tries again after 1 s, not 30 s.
                    "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
                    # Proactive automations (deployments/zombie-runs.yaml) evaluated every second, not 5 s.
                    "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S"})
        part = self._spawn("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(port), "--no-ui", "--analytics-off"], env)
        self.api_url = f"http://127.0.0.1:{port}/api"
        return part

    def wait_server(self, part: Part, timeout: float = 120.0) -> None:
        self._wait("prefect server", lambda: healthy(self.api_url, timeout=2), part, timeout)

    def start_server(self, timeout: float = 120.0) -> str:
        """`prefect server start` on PostgreSQL; the API URL once it is healthy."""
        self.wait_server(self.spawn_server(), timeout)
        return self.api_url

    def client(self) -> Any:
        """An async Prefect client of the cluster's server (whatever this process's settings say)."""
        from prefect.client.orchestration import PrefectClient

        return PrefectClient(self.api_url)

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """This process's flows and clients talk to the cluster's server for the block."""
        from prefect.settings import (
            PREFECT_API_AUTH_STRING,
            PREFECT_API_URL,
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            temporary_settings,
        )

        # No heartbeats from the flows run here (a test's or a bench's backfill: a client of the cluster, not a
        # worker's run): their events failed to send from this process, one EventsWorker error each.
        with temporary_settings(updates={PREFECT_API_URL: self.api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None},
                                restore_defaults={PREFECT_API_AUTH_STRING}):
            yield

    def client_env(self, home: Path | None = None) -> dict[str, str]:
        """The environment of a process on one "machine": its own PREFECT_HOME, the cluster's server."""
        env = _without_prefect_vars(dict(os.environ))
        env["PREFECT_HOME"] = str(home or (self.root / "client-home"))
        Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
        env["PREFECT_API_URL"] = self.api_url
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        env["PREFECT_LOGGING_LEVEL"] = "WARNING"
        # Temporary files inside the cluster's root, which goes with it: a worker killed with kill -9 (as the
        # test kills one) cannot remove the prefect-workspace-attempt-* directory Prefect made for each of
        # its runs, and they were left in /tmp after every suite run.
        scratch = self.root / "tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(scratch)
        env.update(self.env_extra)
        return env

    def prefect(self, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> str:
        """One `prefect ...` command against the cluster's server (from the repository root); its output."""
        done = subprocess.run([sys.executable, "-m", "prefect", *args], check=False, env=env or self.client_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        return done.stdout

    def spawn_worker(self, name: str, pool: str = "mergeflow", limit: int = 1) -> Part:
        """`prefect worker start --pool POOL` as one machine (its own PREFECT_HOME), not waited for (`wait_worker`)."""
        home = self.root / f"{name}-home"
        return self._spawn(name, [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--name", name,
                                  "--limit", str(limit), "--type", "process"], self.client_env(home), cwd=REPO)

    def wait_worker(self, part: Part, pool: str = "mergeflow", timeout: float = 60.0) -> None:
        """Until the worker has polled the pool (the pool lists it)."""
        self._wait(f"worker {part.name}", lambda: part.name in self._pool_workers(pool), part, timeout)

    def start_worker(self, name: str, pool: str = "mergeflow", limit: int = 1, timeout: float = 60.0) -> Part:
        part = self.spawn_worker(name, pool, limit)
        self.wait_worker(part, pool, timeout)
        return part

    def kill_with_descendants(self, name: str) -> None:
        """SIGKILL a part and every process below it (a worker's flow-run processes too), as a machine dies."""
        part = self.part(name)
        for pid in [part.pgid, *descendants(part.pgid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        part.kill()
        self.parts.remove(part)

    def part_of_pid(self, pid: int) -> str:
        """The name of the part that is `pid` or has it below it."""
        for part in self.parts:
            if pid == part.pgid or pid in descendants(part.pgid):
                return part.name
        raise LookupError(f"pid {pid} belongs to no part of the cluster")

    def _pool_workers(self, pool: str) -> set[str]:
        import asyncio

        async def read() -> set[str]:
            from prefect.client.orchestration import get_client
            from prefect.exceptions import ObjectNotFound
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
                async with get_client() as client:
                    try:
                        return {w.name for w in await client.read_workers_for_work_pool(pool)}
                    except ObjectNotFound:  # the pool is not there yet
                        return set()

        return asyncio.run(read())

    # -- Dask ---------------------------------------------------------------------------------

    def spawn_dask(self, workers: int = 2) -> None:
        """A `dask scheduler` and `workers` single-threaded `dask worker` processes (no nanny: a killed one stays dead)."""
        port = free_port()
        self._spawn("dask-scheduler", [sys.executable, "-m", "distributed.cli.dask_scheduler",
                                                   "--host", "127.0.0.1", "--port", str(port),
                                                   "--dashboard-address", ":0"],
                    self.client_env(self.root / "dask-home"))
        self.dask_address = f"tcp://127.0.0.1:{port}"
        for index in range(workers):
            name = f"dask-worker-{index}"
            self._spawn(name, [sys.executable, "-m", "distributed.cli.dask_worker", self.dask_address,
                               "--nthreads", "1", "--no-nanny", "--name", name, "--host", "127.0.0.1",
                               "--dashboard-address", ":0", "--local-directory", str(self.root / f"{name}-scratch")],
                        self.client_env(self.root / f"{name}-home"), cwd=REPO)

    def wait_dask(self, workers: int, timeout: float = 60.0) -> None:
        self._wait("dask workers", lambda: self.dask_worker_count() >= workers, self.part("dask-scheduler"), timeout)

    def start_dask(self, workers: int = 2, timeout: float = 60.0) -> str:
        self.spawn_dask(workers)
        self.wait_dask(workers, timeout)
        return self.dask_address

    def dask_keys_run(self) -> dict[str, list[str]]:
        """Dask worker name -> keys of the tasks it ran to the end (each worker's own transition log)."""
        from distributed import Client

        def finished(dask_worker: Any) -> tuple[str, list[str]]:
            keys = [str(e[0]) for e in dask_worker.state.log if len(e) > 2 and e[1] == "executing" and e[2] == "memory"]
            return str(dask_worker.name), keys

        with Client(self.dask_address, timeout=10) as client:
            return dict(client.run(finished).values())

    def dask_worker_count(self) -> int:
        from distributed import Client

        try:
            with Client(self.dask_address, timeout=5) as client:
                return len(client.scheduler_info()["workers"])
        except OSError:
            return 0


def _stop_postmaster(pid: int, timeout: float = 10.0) -> None:
    """SIGQUIT: PostgreSQL's immediate shutdown. The postmaster reaps its own backends first; killed all at
    once, they would be left to an init that may never reap them (zombies)."""
    try:
        os.kill(pid, signal.SIGQUIT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and descendants(pid):
        time.sleep(0.05)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (by /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass(frozen=True)
class Timer:
    start: float = field(default_factory=time.monotonic)

    def __call__(self) -> float:
        return round(time.monotonic() - self.start, 1)
