"""The console script's exit (`end_process`): everything Python's own exit does that can be observed.

`mergeflow`'s process ends with os._exit after joining threads, running atexit handlers and flushing
stdio, instead of the interpreter's heap teardown. Each case runs a real child interpreter and checks
what a user or a parent process would see: files written by late threads and atexit handlers,
every byte of a large buffered stdout, the exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = "import sys, threading, atexit, time\nfrom mergeflow.deployments.cli import end_process\n"


def _child(code: str, *, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    # Buffered stdio, as a user's shell gives it: PYTHONUNBUFFERED (set on some CI machines) would write
    # every print at once and leave nothing for the exit to flush.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], stdout=stdout,
                          stderr=subprocess.PIPE, env=env, timeout=120, check=False)


def test_the_exit_status_is_the_commands() -> None:
    assert _child("end_process(3)").returncode == 3
    assert _child("end_process(0)").returncode == 0


def test_atexit_handlers_run_last_registered_first(tmp_path: Path) -> None:
    out = tmp_path / "order"
    result = _child(f"""
        atexit.register(lambda: open({str(out)!r}, "a").write("first-registered\\n"))
        atexit.register(lambda: open({str(out)!r}, "a").write("last-registered\\n"))
        end_process(0)
    """)
    assert result.returncode == 0, result.stderr
    assert out.read_text().splitlines() == ["last-registered", "first-registered"]


def test_a_running_non_daemon_thread_finishes_first(tmp_path: Path) -> None:
    out = tmp_path / "thread"
    result = _child(f"""
        def late():
            time.sleep(0.5)
            open({str(out)!r}, "w").write("done")
        threading.Thread(target=late).start()
        end_process(0)
    """)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "done"


def test_an_executors_queued_work_finishes_first(tmp_path: Path) -> None:
    # concurrent.futures joins its workers through threading's own exit hook, not atexit.
    out = tmp_path / "pool"
    result = _child(f"""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)
        pool.submit(time.sleep, 0.3)
        pool.submit(lambda: open({str(out)!r}, "w").write("ran"))
        end_process(0)
    """)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "ran"


def test_buffered_stdout_and_stderr_reach_the_parent_whole() -> None:
    result = _child("""
        sys.stdout.write("x" * 3_000_000)
        sys.stderr.write("last line, unflushed")
        end_process(0)
    """)
    assert result.returncode == 0
    assert len(result.stdout) == 3_000_000
    assert result.stderr.endswith(b"last line, unflushed")


def test_stdout_to_a_file_is_flushed(tmp_path: Path) -> None:
    out = tmp_path / "stdout"
    with open(out, "wb") as handle:
        result = _child('print("published", end=""); end_process(0)', stdout=handle.fileno())
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == b"published"


@pytest.mark.parametrize("status", [0, 4])
def test_stdout_that_cannot_be_flushed_is_a_failure(status: int) -> None:
    # The reader went away (a closed pipe): a success becomes 120, as Python's own exit makes it;
    # a failure keeps its status.
    result = _child(f"""
        import os, signal
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        sys.stdout.write("lost")
        end_process({status})
    """)
    assert result.returncode == (120 if status == 0 else status)
