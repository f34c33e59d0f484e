"""The mergeflow command line with every write into a shard slowed down: `python slow_cli.py SECONDS ARGS...`.

Tests signal or kill this process while it writes shards; the delay exists only here
(tests/slow_writes.py wraps the write syscall), never in mergeflow itself.
"""

from __future__ import annotations

import sys

from slow_writes import slow_shard_writes

from mergeflow.flows.cli import main

if __name__ == "__main__":
    slow_shard_writes(float(sys.argv[1]))
    raise SystemExit(main(sys.argv[2:]))
