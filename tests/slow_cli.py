"""The mergeflow command line with every written tensor slowed down: `python slow_cli.py SECONDS ARGS...`.

Tests kill this process while it writes shards; the delay only exists in this wrapper,
never in mergeflow itself.
"""

from __future__ import annotations

import sys
import time

from mergeflow.flows.cli import main
from mergeflow.export import shard_writer as write

if __name__ == "__main__":
    delay = float(sys.argv[1])
    write.PROGRESS_HOOKS.append(lambda nbytes, ntensors: time.sleep(delay))
    raise SystemExit(main(sys.argv[2:]))
