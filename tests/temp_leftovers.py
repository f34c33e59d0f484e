"""What a test run left in the temp dir: the names Prefect, Dask and Chromium use there, new since the run began.

Each of these was once left by every suite run, because a test started a real process without a temp
dir of its own: Prefect's Runner (`runner_storage/<uuid>`, mergeflow serve), its process workers
(`prefect-workspace-attempt-*`, killed ones in the cluster test), Chromium's singleton socket and
Dask's scratch space. A run that leaves one fails. Only these names are checked: other processes on a
shared machine write to the temp dir too, and pytest's own `pytest-of-<user>`, torch's compile cache
and the migrated database template (tests/prefect_server.py) are kept across runs by design.
Another test run or `mergeflow serve` on the same machine at the same time can leave them too.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile

PATTERNS = ("runner_storage/*", "prefect-workspace-*", "org.chromium.Chromium.*", "dask-scratch-space*",
            "dask-worker-space*")


def snapshot() -> set[str]:
    """The temp dir's entries, and those of Prefect's `runner_storage` in it, as relative names."""
    root = tempfile.gettempdir()
    names: set[str] = set()
    for top in ("", "runner_storage"):
        try:
            names.update(os.path.join(top, name) if top else name for name in os.listdir(os.path.join(root, top)))
        except OSError:
            continue  # runner_storage is made on first use
    return names


def left_since(before: set[str]) -> list[str]:
    """The checked names that are there now and were not in `before`, sorted."""
    return sorted(name for name in snapshot() - before if any(fnmatch.fnmatch(name, p) for p in PATTERNS))
