"""The mergeflow command line with every written tensor slowed down: `python slow_cli.py SECONDS ARGS...`.

Tests kill this process while it writes shards; the delay only exists in this wrapper,
never in mergeflow itself.
"""

from __future__ import annotations

import sys
import time

from mergeflow.export.progress import WRITE_PROGRESS
from mergeflow.flows.cli import main

if __name__ == "__main__":
    delay = float(sys.argv[1])
    with WRITE_PROGRESS.listening(lambda nbytes, ntensors: time.sleep(delay)):
        raise SystemExit(main(sys.argv[2:]))
