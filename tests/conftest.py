"""Test environment: offline Hugging Face, a private PREFECT_HOME, one real Prefect server."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Before anything imports huggingface_hub or prefect (both read these at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="mergeflow-tests-prefect-")
os.environ.pop("PREFECT_API_URL", None)
# The session's server has basic authentication on (tests/prefect_server.py), as a served
# deployment should: every client here and every child process presents the auth string.
os.environ["PREFECT_API_AUTH_STRING"] = "mergeflow:test-auth"
# CLI subprocesses without PREFECT_API_URL must not leave a background server behind; the tests
# of that server unset this for their own subprocesses (and stop what they start).
os.environ["MERGEFLOW_LOCAL_SERVER"] = "0"
# The remembered model schemas (mergeflow.architectures.schema.model_schema) of this run only, never the user's.
os.environ["MERGEFLOW_CACHE_DIR"] = tempfile.mkdtemp(prefix="mergeflow-tests-cache-")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from prefect_server import PrefectServer, start_prefect_server  # noqa: E402


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One real `prefect server start` on 127.0.0.1 for the whole session, stopped at the end."""
    with start_prefect_server(tmp_path_factory.mktemp("prefect"), auth_string=os.environ["PREFECT_API_AUTH_STRING"]) as server:
        yield server
        _drain_prefect_services()


def _drain_prefect_services() -> None:
    """Send queued logs and events while the server still runs.

    Otherwise Prefect's exit hook retries against the stopped server for over a minute.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


@pytest.fixture(scope="session")
def pristine_flux_w2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real W=2 FSDP2 Flux checkpoint and its base, built once per worker; tests edit clones (builders.clone_export)."""
    from builders import make_export

    return make_export(tmp_path_factory.mktemp("flux-w2"), "FluxTransformer2DModel", 2)


@pytest.fixture()
def prefect_api(prefect_server: PrefectServer) -> Iterator[PrefectServer]:
    """Run flows of this test in-process against the session's server."""
    with prefect_server.activated():
        yield prefect_server
