"""Ctrl-C (once or twice) and SIGTERM during a real CLI export: one line, 130/143, work kept, a rerun publishes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import forked_cli
import pytest
from builders import Export, clone_export

from mergeflow.export.check.artifact_check import check_artifact

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _final_state(server: Any, run_id: str, timeout: float = 30.0) -> Any:
    import asyncio
    from uuid import UUID

    from prefect.client.orchestration import get_client

    async def read() -> Any:
        async with get_client() as client:
            return (await client.read_flow_run(UUID(run_id))).state

    deadline = time.monotonic() + timeout
    with server.activated():
        while True:
            state = asyncio.run(read())
            if (state is not None and state.is_final()) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)  # a crashed run's final state lands a moment after the process ends


def merge_args(ex: Any, target: Path) -> list[str]:
    # Small shards (the 272 kB output in a dozen or more): the first shard record, which the signal waits
    # for, is written after a few slowed tensors, and many shards are still to write when it lands.
    return ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
            "--target_dir", str(target), "--output_format", "transformer", "--max_shard_size", "20000"]


@pytest.mark.parametrize("signum,times,status", [(signal.SIGINT, 1, 130), (signal.SIGINT, 2, 130), (signal.SIGTERM, 1, 143)],
                         ids=["ctrl-c", "ctrl-c-twice", "sigterm"])
def test_an_interrupted_export_ends_with_one_line_and_resumes(tmp_path: Path, prefect_server: Any, pristine_flux_w2: Export,
                                                              signum: int, times: int, status: int) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)  # the real W=2 checkpoint, copied: no torch build per test
    target = tmp_path / "out"
    env = prefect_server.client_env()
    # Every written tensor slowed down (tests/slow_cli.py), so the signal lands mid-write.
    proc = forked_cli.popen([str(TESTS / "slow_cli.py"), "0.15", *merge_args(ex, target)], env)
    try:
        _wait_until_writing(proc, tmp_path)
        sent = time.monotonic()
        for press in range(times):
            if press:
                # The second press while the first one's cleanup runs: the case that once aborted the process.
                # 0.2 s later, a quick cleanup had sometimes already ended the command, and the zygote
                # (tests/forked_cli.py) had reaped it, so the press found no process (ProcessLookupError). The
                # cleanup waits at least for the slowed write in flight (0.15 s), and Prefect's final state.
                time.sleep(0.02)
            os.kill(proc.pid, signum)
        _, text = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended (and reaped) since poll(): nothing to kill
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == status, text[-3000:]
    assert took < 15, f"took {took:.1f} s to stop"
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(line.startswith("mergeflow: ") for line in lines), text[-3000:]  # no traceback, no abort message
    name = signal.Signals(signum).name
    assert lines[-1].startswith(f"mergeflow: interrupted ({name}); nothing was published; work kept for resume in "), lines[-1]
    kept = Path(lines[-1].split("work kept for resume in ")[1].split(" (rerun")[0])
    # The UI shows why the run ended: the flow run's final state, read back from the server.
    run_ids = re.findall(r"/runs/flow-run/([0-9a-f-]{36})", text)
    assert run_ids, text[-2000:]
    state = _final_state(prefect_server, run_ids[0])
    assert state.type.value in ("CRASHED", "CANCELLED"), state
    assert state.message and "aborted by" in state.message, state.message  # e.g. "... by a termination signal."
    assert f"Work kept for resume in {kept} " in state.message, state.message  # the UI names the kept staging too
    assert kept.is_dir() and kept.parent == tmp_path and not target.exists()
    if times == 1:
        return  # the resume after a kill is proven elsewhere (test_resume, test_crash_recovery); once here
    rerun = forked_cli.mergeflow(merge_args(ex, target), env, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert check_artifact(str(target))["integrity"] == "passed"
    assert not kept.exists()


def _wait_until_writing(proc: Any, root: Path) -> None:
    """Until the slowed export has finished a shard record (so a signal lands mid-write); it must still run."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if list(root.glob(".out.mergeflow-staging-*/work/shard-*.json")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"finished before the signal: {proc.communicate()[1][-2000:]!r}"


def test_ctrl_c_without_a_server_is_one_line_too(tmp_path: Path, pristine_flux_w2: Export) -> None:
    """No PREFECT_API_URL and no background server: Prefect's temporary per-command server dies with
    the Ctrl-C (it is in the command's process group); the export still ends with one line and 130."""
    ex = clone_export(pristine_flux_w2, tmp_path)
    target = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", MERGEFLOW_LOCAL_SERVER="0")
    proc = forked_cli.popen([str(TESTS / "slow_cli.py"), "0.15", *merge_args(ex, target)], env)  # cold: no API to fork for
    try:
        _wait_until_writing(proc, tmp_path)
        servers = _command_servers_of(proc.pid)
        assert len(servers) == 1, servers  # mergeflow's own temporary server, in a session of its own
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: the whole foreground group
        _, text = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, text[-3000:]
    assert took < 15, f"took {took:.1f} s to stop"
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(line.startswith("mergeflow: ") for line in lines), text[-3000:]  # no EventsWorker or ConnectError traceback
    assert lines[-1].startswith("mergeflow: interrupted (SIGINT); nothing was published; work kept for resume in "), lines[-1]
    assert not target.exists() and len(list(tmp_path.glob(".out.mergeflow-staging-*"))) == 1
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in servers), "the command's temporary Prefect server outlived it"


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _command_servers_of(pid: int) -> list[int]:
    """Live `prefect server start` processes that mergeflow started for command `pid` (their parent)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"mergeflow-command-server-" in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if f"PPid:\t{pid}\n" in status and "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _staged_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob(".out.mergeflow-staging-*/**/*") if f.is_file())


def _largest_tensor_bytes(ex: Any) -> int:
    from safetensors import safe_open

    largest = 0
    for path in Path(ex.base_dir).rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                largest = max(largest, n * 4)  # float32 at most: the exported dtype is never wider
    return largest


def test_sigterm_stops_the_writers_between_tensors(tmp_path: Path, prefect_server: Any, pristine_flux_w2: Export) -> None:
    """SIGTERM, like Ctrl-C, stops the shard writers at their next tensor: the bytes written after the
    signal are bounded by one tensor per writer, never the rest of a shard (one big shard here)."""
    ex = clone_export(pristine_flux_w2, tmp_path)
    target = tmp_path / "out"
    args = [a for a in merge_args(ex, target)]
    args[args.index("--max_shard_size") + 1] = "100000000"  # the whole output in one shard
    proc = forked_cli.popen([str(TESTS / "slow_cli.py"), "0.3", *args], prefect_server.client_env())
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and _staged_bytes(tmp_path) < 20000:
            time.sleep(0.02)  # until the one shard is being written
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        at_signal = _staged_bytes(tmp_path)
        os.kill(proc.pid, signal.SIGTERM)
        _, text = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    after = _staged_bytes(tmp_path) - at_signal
    assert proc.returncode == 143, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[-1].startswith("mergeflow: interrupted (SIGTERM); nothing was published; work kept for resume in "), lines[-1]
    per_tensor = _largest_tensor_bytes(ex)
    print(f"bytes after SIGTERM: {after} (largest tensor {per_tensor}, at signal {at_signal})")
    assert after <= 2 * per_tensor + 4096, (after, per_tensor)  # two writers, one tensor each, and a shard header
    assert not target.exists()
