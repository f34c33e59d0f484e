"""Every write into a shard being written slowed down, from outside mergeflow: `slow_shard_writes(seconds)`.

Tests signal or kill a command while it writes shards; mergeflow has no hook for a delay, so the
one `os` function its shard writer writes through (`os.write`, in mergeflow.io.streamio) is
wrapped in the process that runs the export. Only writes to a shard's temporary file
(`*.safetensors.partial`) wait; the process's other writes (logs, pipes, configs) do not.
"""

from __future__ import annotations

import os
import time

_SHARD_SUFFIX = ".safetensors.partial"


def slow_shard_writes(seconds: float, within: str = "") -> None:
    """From now on in this process, each `os.write` into a shard file (whose path contains `within`) waits `seconds` first."""
    write = os.write

    def slow_write(fd: int, data: bytes | bytearray | memoryview, /) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith(_SHARD_SUFFIX) and within in target:
            time.sleep(seconds)
        return write(fd, data)

    os.write = slow_write
