"""Slows every written tensor in each Python process started with this folder on PYTHONPATH.

A served flow run executes in a process Prefect's runner spawns, which no test wrapper can
reach; `sitecustomize` is imported by every interpreter at start-up, that one included. With
MERGEFLOW_TEST_SLOW_TENSOR_S set, each tensor the shard writers report waits that long, so a
test can signal the run mid-shard. The delay exists only here, never in mergeflow itself.
"""

import os

_DELAY = os.environ.get("MERGEFLOW_TEST_SLOW_TENSOR_S")
if _DELAY:
    import time

    from mergeflow.export.progress import WRITE_PROGRESS

    WRITE_PROGRESS.add(lambda nbytes, ntensors: time.sleep(float(_DELAY)))
