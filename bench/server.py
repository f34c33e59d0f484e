"""A Prefect server for a benchmark run: the caller's PREFECT_API_URL, or mergeflow's own local
server (mergeflow/ops/local_server.py) under a temporary PREFECT_HOME, stopped at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def prefect_api() -> Iterator[dict[str, str]]:
    """The environment a child needs to reach a Prefect server."""
    if os.environ.get("PREFECT_API_URL"):
        yield {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]}
        return
    from mergeflow.ops.local_server import start_local_server, stop_local_server

    home = Path(tempfile.mkdtemp(prefix="bench-prefect-"))
    try:
        state, _ = start_local_server(home)
        yield {"PREFECT_API_URL": state.api_url, "PREFECT_HOME": str(home)}
    finally:
        stop_local_server(home)
        shutil.rmtree(home, ignore_errors=True)
