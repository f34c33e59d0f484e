"""Slows every write into a shard in each Python process started with this folder on PYTHONPATH.

A served flow run executes in a process Prefect's runner spawns, which no test wrapper can
reach; `sitecustomize` is imported by every interpreter at start-up, that one included. With
MERGEFLOW_TEST_SLOW_TENSOR_S set, each write into a shard file waits that long first
(tests/slow_writes.py), so a test can signal the run mid-shard; with MERGEFLOW_TEST_SLOW_WITHIN set too, only
writes into shards whose path contains it (one run's targets: the cluster's other exports run at full speed). The delay exists only here,
never in mergeflow itself.
"""

import os
import sys

_DELAY = os.environ.get("MERGEFLOW_TEST_SLOW_TENSOR_S")
if _DELAY:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for slow_writes (last: shadows nothing)
    from slow_writes import slow_shard_writes

    slow_shard_writes(float(_DELAY), os.environ.get("MERGEFLOW_TEST_SLOW_WITHIN", ""))
