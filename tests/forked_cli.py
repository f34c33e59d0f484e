"""`python -m mergeflow ...` as a real child process, forked from an interpreter that has imported torch and Prefect.

A cold `python -m mergeflow merge` of a tiny model spends about 3.5 of its 5 CPU seconds importing
torch and Prefect; the suite starts a few dozen of them. Here one "zygote" interpreter per
environment imports them once and forks a child for each command. The child is a separate process
with its own pid, session, stdio, signal handlers, exit status and interpreter shutdown (atexit
handlers, Prefect's log and event drains), so `kill -9`, SIGINT/SIGTERM and exit codes reach and
come from it as they do from a cold start. What it skips is the import, and only where that makes
no difference:

- Prefect reads its settings when it is imported. A zygote imports it under exactly the
  environment the command would have at that moment (the caller's environment plus the CLI's own
  pre-import defaults, `mergeflow.flows.cli.pre_import_environment`), and a command is forked only
  from a zygote whose environment equals that, apart from MERGEFLOW_* variables, which mergeflow
  reads when it uses them, pytest's PYTEST_CURRENT_TEST, and HF_* variables: huggingface_hub reads
  those when it is imported, and the zygote never imports it (checked before it serves), so a
  forked command imports it itself, under its own environment, as a cold one does. The child runs
  with exactly the command's environment.
- The zygote moves what it imported out of the garbage collector's sight (`gc.freeze()`, as
  Python's documentation advises before forking without exec): otherwise every full collection in
  a child, the ones at interpreter shutdown included, walks and so copies on write the whole
  inherited heap (a forked `mergeflow test` took 2 s instead of 0.5 s). Those objects stay reachable
  from their modules for the whole command, so collecting them finds nothing while it runs;
  everything the command itself creates is collected as usual. Only at interpreter shutdown are
  they not swept, as nothing there is promised to be.
- Resource limits (`rlimits=`, what a test would set in `preexec_fn`) are set in the child before
  the command runs, for a cold start in its `preexec_fn`.
- A command that could start its own Prefect server (no PREFECT_API_URL), `--debug` (another
  console log level) and anything that is not `-m mergeflow`, a script in tests/ or `-c CODE` get
  a cold `subprocess.Popen`, as before.

`run(...)` is `subprocess.run(..., capture_output=True, text=True)`; `popen(...)` returns an
object with Popen's pid/poll/wait/send_signal/kill/communicate and text `stdout`/`stderr` pipes.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
_PRELOAD = ("torch", "safetensors.torch", "torch.distributed.tensor", "prefect", "prefect.flows", "prefect.flow_engine",
            "prefect.task_engine", "prefect.utilities.visualization", "fastapi.encoders",
            "mergeflow.deployments.cli", "mergeflow.flows.merge", "mergeflow.flows.validate", "mergeflow.flows.progress")
_MESSAGE = 1 << 20


# --- the caller's side ---------------------------------------------------------------------------


class ForkedCommand:
    """A command forked from a zygote: the parts of subprocess.Popen the tests use."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._take_status(self._conn.recv(_MESSAGE))
            except BlockingIOError:
                pass
            finally:
                self._conn.setblocking(True)
            if self.returncode is not None:
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._take_status(self._conn.recv(_MESSAGE))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                self._conn.settimeout(None)
            self._conn.close()
        assert self.returncode is not None
        return self.returncode

    def _take_status(self, data: bytes) -> None:
        if not data:
            raise RuntimeError(f"the zygote went away while {self.args} ran")
        self.returncode = os.waitstatus_to_exitcode(json.loads(data)["status"])

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the child writes to stdout and stderr until it exits (both pipes read together)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[IO[str], list[str]] = {self.stdout: [], self.stderr: []}
        with selectors.DefaultSelector() as sel:
            for stream in chunks:
                if not stream.closed:
                    sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fileobj].append(data.decode(errors="replace"))  # type: ignore[index]
                    else:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(chunks[self.stdout]), "".join(chunks[self.stderr])


RLimits = dict[int, tuple[int, int]]  # resource.RLIMIT_* -> (soft, hard), for resource.setrlimit


def _set_rlimits(rlimits: RLimits) -> None:
    import resource

    for which, (soft, hard) in rlimits.items():
        resource.setrlimit(which, (soft, hard))


def popen(args: list[str], env: dict[str, str], cwd: Path | str = REPO,
          rlimits: RLimits | None = None) -> ForkedCommand | subprocess.Popen[str]:
    """Start `python ARGS` (its stdout and stderr piped, text) from a zygote where that is faithful, else cold.

    `rlimits` apply to the command from its start (a cold one gets them in `preexec_fn`).
    """
    zygote = _zygote_for(args, env)
    if zygote is None:
        limits = dict(rlimits or {})
        return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=(lambda: _set_rlimits(limits)) if limits else None)
    return zygote.fork(args, env, Path(cwd), rlimits or {})


def run(args: list[str], env: dict[str, str], cwd: Path | str = REPO, timeout: float = 300,
        rlimits: RLimits | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, *args], capture_output=True, text=True, timeout=...)`, forked where faithful."""
    proc = popen(args, env, cwd, rlimits)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode is not None
    return subprocess.CompletedProcess([sys.executable, *args], proc.returncode, out, err)


def mergeflow(args: list[str], env: dict[str, str], timeout: float = 300,
              rlimits: RLimits | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m mergeflow ARGS` as users type it."""
    return run(["-m", "mergeflow", *args], env, timeout=timeout, rlimits=rlimits)


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mergeflow-zygote-"))
        self.socket_path = self.dir / "socket"
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(self.socket_path)], env=env, cwd=REPO,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(self.dir / "zygote.log", "wb"),
            start_new_session=True,
        )
        self.ready = threading.Event()
        self.failed = False
        threading.Thread(target=self._await_ready, daemon=True).start()

    def _await_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        self.failed = line.strip() != b"ready"
        self.ready.set()

    def usable(self) -> bool:
        self.ready.wait(120)
        return self.ready.is_set() and not self.failed and self.process.poll() is None

    def fork(self, args: list[str], env: dict[str, str], cwd: Path, rlimits: RLimits) -> ForkedCommand:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(str(self.socket_path))
            request = json.dumps({"args": args, "env": env, "cwd": str(cwd),
                                  "rlimits": [[which, soft, hard] for which, (soft, hard) in rlimits.items()]}).encode()
            socket.send_fds(conn, [request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        reply = conn.recv(_MESSAGE)
        if not reply:
            raise RuntimeError(f"the zygote refused {args}; see {self.dir / 'zygote.log'}")
        return ForkedCommand([sys.executable, *args], conn, json.loads(reply)["pid"],
                             open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0))  # type: ignore[arg-type]

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTES: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_LOCK = threading.Lock()
_FORKED_ENVIRONMENTS: set[tuple[tuple[str, str], ...]] = set()


def fork_commands_of(env: dict[str, str]) -> None:
    """Let commands whose environment is `env` (MERGEFLOW_* aside) be forked; the zygote starts on first use.

    Only environments that many commands share are worth a zygote (it costs a cold start itself);
    the session's Prefect server registers its client environment.
    """
    wanted = _import_environment(["-m", "mergeflow"], env)
    if wanted is not None:
        _FORKED_ENVIRONMENTS.add(_key(wanted))


# Not read by what the zygote imports: pytest rewrites PYTEST_CURRENT_TEST in every test phase, so an
# environment captured at fixture setup would otherwise never equal a command's. HF_* are read by
# huggingface_hub at import, which only ever happens in the command itself (_NEVER_PRELOADED).
_NOT_READ_AT_IMPORT = ("MERGEFLOW_", "PYTEST_CURRENT_TEST", "HF_")
# Modules that read HF_* when imported: a zygote that had imported one of them would serve no command.
_NEVER_PRELOADED = ("huggingface_hub", "transformers", "diffusers", "peft")


def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_NOT_READ_AT_IMPORT)))


def _import_environment(args: list[str], env: dict[str, str]) -> dict[str, str] | None:
    """The environment the command has when it imports Prefect, or None when a cold start is the faithful one."""
    if "--debug" in args or not env.get("PREFECT_API_URL"):
        return None
    if args[:2] != ["-m", "mergeflow"] and not (args and args[0] == "-c" and len(args) > 1) \
            and not (args and Path(args[0]).resolve().parent == TESTS):
        return None
    from mergeflow.flows.cli import pre_import_environment

    return {**env, **{k: v for k, v in pre_import_environment(debug=False).items() if k not in env}}


def _zygote_for(args: list[str], env: dict[str, str]) -> _Zygote | None:
    wanted = _import_environment(args, env)
    if wanted is None or os.environ.get("MERGEFLOW_TEST_COLD_PROCESSES"):
        return None
    key = _key(wanted)
    if key not in _FORKED_ENVIRONMENTS:
        return None
    with _LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None:
            zygote = _ZYGOTES[key] = _Zygote(wanted)
    return zygote if zygote.usable() else None


@atexit.register
def stop_zygotes() -> None:
    with _LOCK:
        for zygote in _ZYGOTES.values():
            zygote.stop()
        _ZYGOTES.clear()


# --- the zygote ----------------------------------------------------------------------------------


def _serve(socket_path: str) -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork would lose those threads' locks
        print(f"threads started while importing: {threading.enumerate()}", file=sys.stderr)
        raise SystemExit(1)
    imported = [name for name in _NEVER_PRELOADED if name in sys.modules]
    if imported:  # they would hold the zygote's HF_* settings, not the command's (_NOT_READ_AT_IMPORT)
        print(f"imported while preloading, which reads HF_* at import: {imported}", file=sys.stderr)
        raise SystemExit(1)
    # Everything imported so far lives as long as the process: out of the collector's sight, a child's
    # collections (at shutdown too) do not touch, and so copy, the pages of the whole inherited heap.
    gc.freeze()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(16)
    waiting: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while os.getppid() == parent:  # the test process is gone: so is the zygote
        for _key, _ in sel.select(0.05):
            conn, _ = listener.accept()
            data, fds, _flags, _addr = socket.recv_fds(conn, _MESSAGE, 3)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                conn.close()
                _become_the_command(request, fds)  # never returns: exits like `python ARGS` would
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"status": status}).encode())
                except OSError:
                    pass
                conn.close()


def _become_the_command(request: dict[str, Any], fds: list[int]) -> None:
    import runpy

    os.setsid()  # its own session, as start_new_session=True: signals to its group reach it alone
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _set_rlimits({which: (soft, hard) for which, soft, hard in request["rlimits"]})
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args: list[str] = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = request["cwd"]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":  # as `python -c CODE ARGS`: argv[0] "-c", the working directory first on the path
        import types

        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")
    raise SystemExit(0)


if __name__ == "__main__":
    _serve(sys.argv[1])
