"""What every benchmark here measures the same way: the floor, a process's memory, a quiet start."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

BLOCK = 16 * 1024 * 1024


def floor_seconds(files: list[Path], out: Path, *, early_writeback: bool = False, durable: bool = True) -> float:
    """The machine's floor: read + sha256 + write of the same bytes in one pass, fsync at the end.

    durable=False: no fsync, the page-cache floor (what a write costs before the disk is involved).

    early_writeback: also start writeback every 64 MB (sync_file_range, as mergeflow's writer
    does), so the floor is not held back by a gigabyte of dirty pages waiting for the fsync.
    """
    from mergeflow.io.streamio import start_writeback

    digest = hashlib.sha256()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    start = time.perf_counter()
    written = flushed = 0
    with open(out, "wb", buffering=0) as dst:
        for path in files:
            with open(path, "rb", buffering=0) as src:
                while n := src.readinto(buf):
                    digest.update(view[:n])
                    dst.write(view[:n])
                    written += n
                    if early_writeback and written - flushed >= 64 * 1024 * 1024:
                        start_writeback(dst.fileno(), flushed, written - flushed)
                        flushed = written
        if durable:
            os.fsync(dst.fileno())
    elapsed = time.perf_counter() - start
    out.unlink()
    return elapsed


def status_kb(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, RssAnon = private memory) of a process in kB.

    /proc/PID/status keeps these as counters: O(1) to read. smaps_rollup walks every page
    table, which with gigabytes of mapped rank files costs real CPU on a two-core machine.
    """
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return rss, anon


def settle(seconds: float = 1.0) -> None:
    """Let the last run's writeback and deletes land, and the Prefect server digest its events."""
    os.sync()
    time.sleep(seconds)
    os.sync()

