"""`mergeflow resident`: commands forked from a process that has imported torch and Prefect behave as cold ones.

One real resident per module (`python -m mergeflow resident start`, its imports paid once) in an
environment of its own (its TMPDIR holds the socket directory); each command is a real cold client,
`python -m mergeflow ...` in a new process, which hands itself to the resident. Whether a command was
served is read from the resident's own count (`mergeflow resident status`), never assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import forked_cli
import pytest
from builders import Export, clone_export, tree_digest

from mergeflow.ops.resident import socket_dir


def mergeflow(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300,
              **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mergeflow", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]


def status(env: dict[str, str]) -> list[dict[str, object]]:
    proc = mergeflow(["resident", "status"], env, Path(env["TMPDIR"]))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["residents"]  # type: ignore[no-any-return]


def served(env: dict[str, str]) -> int:
    """How many commands the resident of `env` has forked so far."""
    mine = [r for r in status(env) if r["serves_this_environment"]]
    assert len(mine) == 1, mine
    return int(mine[0]["served"])  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def resident_env(prefect_server) -> Iterator[dict[str, str]]:  # type: ignore[no-untyped-def]
    # A short TMPDIR of its own: the socket directory lies in it, and a socket's path is limited to 107 bytes.
    tmp = tempfile.mkdtemp(prefix="mfr-", dir="/tmp")
    env = prefect_server.client_env()
    env.update({"HF_HUB_OFFLINE": "1", "TMPDIR": tmp})
    started = mergeflow(["resident", "start", "--idle-minutes", "30"], env, Path(tmp))
    assert started.returncode == 0, started.stderr
    info = json.loads(started.stdout)
    assert info["started"] is True
    try:
        yield env
    finally:
        stopped = mergeflow(["resident", "stop", "--all"], env, Path(tmp))
        assert json.loads(stopped.stdout)["stopped"] == [info["pid"]], stopped.stdout
        _wait_gone(info["pid"])
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_a_served_merge_writes_what_a_cold_one_writes(tmp_path: Path, resident_env: dict[str, str],
                                                      prefect_server, pristine_flux_w2: Export) -> None:  # type: ignore[no-untyped-def]
    ex = clone_export(pristine_flux_w2, tmp_path / "ckpt")
    args = ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
            "--output_format", "transformer", "--target_dir"]
    before = served(resident_env)
    warm = mergeflow([*args, str(tmp_path / "warm")], resident_env, tmp_path)
    assert warm.returncode == 0, warm.stderr
    assert served(resident_env) == before + 1
    # The same command, cold (forked_cli: a fresh process, or one forked from the suite's own zygote).
    cold_env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    cold = forked_cli.mergeflow([*args, str(tmp_path / "cold")], cold_env)
    assert cold.returncode == 0, cold.stderr
    assert json.loads(warm.stdout.splitlines()[-1])["output_dir"] == str(tmp_path / "warm")
    # Its progress and its flow run's link reach the caller's stderr, as a cold command's do.
    assert "mergeflow: wrote " in warm.stderr and "/runs/flow-run/" in warm.stderr and "Traceback" not in warm.stderr
    digests = {name: tree_digest(tmp_path / name) for name in ("warm", "cold")}
    manifests = {name: json.loads((tmp_path / name / "merge_manifest.json").read_text()) for name in digests}
    for name in digests:
        digests[name].pop("merge_manifest.json")
    assert digests["warm"] == digests["cold"]
    assert manifests["warm"]["files"] == manifests["cold"]["files"]
    checked = mergeflow(["test", "--backend", "fsdp", "--test_hf_dir", str(tmp_path / "warm")], resident_env, tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert served(resident_env) == before + 2


def test_refusals_and_exit_statuses_reach_the_caller(tmp_path: Path, resident_env: dict[str, str]) -> None:
    before = served(resident_env)
    missing = mergeflow(["inspect", "--local_dir", str(tmp_path / "nothing")], resident_env, tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "does not exist" in missing.stderr
    bad_flag = mergeflow(["merge", "--dtype", "float64"], resident_env, tmp_path)  # argparse's own exit, in the child
    assert bad_flag.returncode == 2 and "invalid choice" in bad_flag.stderr
    usage = mergeflow(["resident", "--help"], resident_env, tmp_path)  # never handed over: it manages residents
    helped = mergeflow(["merge", "--help"], resident_env, tmp_path)
    assert usage.returncode == 0 and helped.returncode == 0 and "--target_dir" in helped.stdout
    assert served(resident_env) == before + 3


def test_what_a_command_does_not_share_with_the_resident_starts_cold(tmp_path: Path, resident_env: dict[str, str]) -> None:
    before = served(resident_env)
    # Variables read when torch or Prefect is imported, the opt-out, --debug (another console log level):
    # each starts cold, and works.
    for extra, args in (({"PREFECT_LOGGING_LEVEL": "WARNING"}, ["--version"]), ({"MERGEFLOW_RESIDENT": "0"}, ["--version"]),
                        ({}, ["inspect", "--debug", "--local_dir", str(tmp_path / "nothing")])):
        proc = mergeflow(args, {**resident_env, **extra}, tmp_path)
        assert proc.returncode in (0, 2), proc.stderr
    assert served(resident_env) == before
    # A working directory holding a package `python -m` would import in place of the resident's.
    shadow = tmp_path / "shadow"
    (shadow / "safetensors").mkdir(parents=True)
    (shadow / "safetensors" / "__init__.py").write_text("")
    mergeflow(["--version"], resident_env, shadow)  # cold: what it then does with that package is Python's business
    assert served(resident_env) == before
    # What nothing imported reads at import (MERGEFLOW_*, HF_*, the shell's PWD) is the command's own: served.
    own = mergeflow(["--version"], {**resident_env, "MERGEFLOW_CACHE_DIR": str(tmp_path / "cache"), "PWD": "/"}, tmp_path)
    assert own.returncode == 0 and own.stdout.startswith("mergeflow ")
    assert served(resident_env) == before + 1


def test_limits_reach_the_served_command(tmp_path: Path, resident_env: dict[str, str], pristine_flux_w2: Export) -> None:
    import resource

    ex = clone_export(pristine_flux_w2, tmp_path / "ckpt")
    before = served(resident_env)
    limit = 100_000  # smaller than the first shard: the disk is "full" for this command alone (as tests/test_cli.py)
    proc = mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
                      "--output_format", "transformer", "--target_dir", str(tmp_path / "out")], resident_env, tmp_path,
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert served(resident_env) == before + 1
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("mergeflow: 0 tensors")]
    assert lines[-1].startswith("mergeflow: error: no space left") and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def _served_watch(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    train = tmp_path / "train"
    train.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "mergeflow", "watch", str(train), "--poll-seconds", "0.2"], env=env,
                            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "mergeflow: watch uses ...": the command runs
    assert "watch uses" in line, line
    return proc


def test_signals_reach_the_served_command(tmp_path: Path, resident_env: dict[str, str]) -> None:
    before = served(resident_env)
    for signum in (signal.SIGTERM, signal.SIGINT):
        (tmp_path / signum.name).mkdir()
        proc = _served_watch(tmp_path / signum.name, resident_env)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        # The command's own answer to the signal, whichever moment it came at: the watcher stops and reports
        # what it emitted, or, still starting, the command ends with one line and 128 + the signal.
        if proc.returncode == 0:
            assert json.loads(out.splitlines()[-1]) == {"emitted": []}
        else:
            assert proc.returncode == 128 + signum, err
            assert err.strip().splitlines()[-1].startswith(f"mergeflow: interrupted ({signum.name})"), err
    assert served(resident_env) == before + 2


def _running(env: dict[str, str]) -> int:
    return int([r for r in status(env) if r["serves_this_environment"]][0]["running"])  # type: ignore[call-overload]


def test_a_caller_killed_outright_takes_its_command_with_it(tmp_path: Path, resident_env: dict[str, str]) -> None:
    # Two at once: only the killed caller's command ends.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    killed = _served_watch(tmp_path / "a", resident_env)
    other = _served_watch(tmp_path / "b", resident_env)
    assert _running(resident_env) == 2
    killed.kill()
    killed.wait()
    deadline = time.monotonic() + 30
    while _running(resident_env) != 1:
        assert time.monotonic() < deadline, "the served command outlived its caller"
        time.sleep(0.2)
    other.send_signal(signal.SIGTERM)
    other.communicate(timeout=60)
    assert other.returncode in (0, 143)
    assert _running(resident_env) == 0


def test_the_socket_directory_must_be_this_users_alone(tmp_path: Path, resident_env: dict[str, str]) -> None:
    directory = Path(resident_env["TMPDIR"]) / socket_dir().name
    before = served(resident_env)
    directory.chmod(0o755)
    try:
        cold = mergeflow(["--version"], resident_env, tmp_path)
        refused = mergeflow(["resident", "start"], resident_env, tmp_path)
    finally:
        directory.chmod(0o700)
    assert cold.returncode == 0
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1 and "0700" in refused.stderr, refused.stderr
    assert served(resident_env) == before


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    """A TMPDIR short enough for a socket path (pytest's own can pass 107 bytes under xdist)."""
    tmp = Path(tempfile.mkdtemp(prefix="mfr-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _bare_resident(tmp_path: Path, idle_s: float) -> tuple[subprocess.Popen[str], Path]:
    """The serving loop alone: nothing preloaded, a trivial command."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("import os, sys\n"
            "from mergeflow.ops.resident_server import run_resident\n"
            "run_resident(dict, (), lambda: os._exit(7), float(sys.argv[1]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(idle_s)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    path = Path(json.loads(proc.stdout.readline())["socket"])
    assert path.exists()
    return proc, path


def test_an_idle_resident_ends_by_itself(short_tmp: Path) -> None:
    proc, path = _bare_resident(short_tmp, 1.0)
    assert proc.wait(timeout=30) == 0
    assert not path.exists()


def test_sigterm_ends_a_resident_at_once(short_tmp: Path) -> None:
    proc, path = _bare_resident(short_tmp, 600.0)
    proc.terminate()
    assert proc.wait(timeout=30) == 0  # not after its idle time
    assert not path.exists()


def test_a_socket_path_too_long_is_one_line(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    proc = mergeflow(["resident", "start"], {**os.environ, "TMPDIR": str(deep), "HF_HUB_OFFLINE": "1"}, tmp_path)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "set TMPDIR to a shorter directory" in proc.stderr


def test_one_resident_per_environment(short_tmp: Path) -> None:
    first, path = _bare_resident(short_tmp, 600.0)
    try:
        code = "from mergeflow.ops.resident_server import run_resident; run_resident(dict, (), None, 600.0)"
        second = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(short_tmp)},
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "a resident already serves this environment" in second.stderr
        assert path.exists()  # the first one's socket, untouched
    finally:
        first.terminate()
        assert first.wait(timeout=30) == 0



def test_a_request_it_cannot_read_is_refused_and_the_resident_serves_on(short_tmp: Path) -> None:
    import socket

    proc, path = _bare_resident(short_tmp, 600.0)
    try:
        key = json.loads(_ask(path, {"op": "status"}))["key"]
        for request in ({"op": "run"}, {"op": "run", "key": key}, {"op": "run", "key": key, "env": "not a mapping"}):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(str(path))
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            assert "refused" in json.loads(conn.recv(1 << 20)), request
            conn.close()
        assert json.loads(_ask(path, {"op": "status"}))["served"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _ask(path: Path, request: dict[str, object]) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(str(path))
        conn.send(json.dumps(request).encode())
        return conn.recv(1 << 20)
