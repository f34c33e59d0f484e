"""Test environment: offline Hugging Face, a private PREFECT_HOME, one real Prefect server."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Before anything imports huggingface_hub or prefect (both read these at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
# In-process flow runs print Prefect's INFO lines ("Finished in state Completed()", one per task run) through
# its rich console handler, which pytest only captures: 8 of the workers' ~430 sampled CPU seconds in a
# py-spy profile of the suite. Warnings and errors still print; the API log handler (which tests read
# back) keeps its own level. Commands under test never see this: their environment drops PREFECT_* vars.
os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "WARNING"
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
# This process's own two directories go when it exits (each xdist worker imports this file and makes its own):
# a suite run leaves nothing in the temp dir.
_OWN_DIRS = (os.environ["PREFECT_HOME"], os.environ["MERGEFLOW_CACHE_DIR"])


@atexit.register
def _remove_own_dirs() -> None:
    for path in _OWN_DIRS:
        shutil.rmtree(path, ignore_errors=True)


sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import temp_leftovers  # noqa: E402
from prefect_server import PrefectServer, drain_events_and_logs, start_prefect_server  # noqa: E402


class _EarlyServer:
    """A session's server, started in a thread, so that the session's own 10-15 s start-up overlaps test
    collection instead of stalling the first test that needs it.

    The session's own (events=False) neither stores events, runs automations nor records task runs
    (tests/prefect_server.py, _WITHOUT_EVENTS): the tests that need them take `prefect_events_server`, a
    second one started for them alone on first use."""

    def __init__(self, *, events: bool = False) -> None:
        self._home = Path(tempfile.mkdtemp(prefix="mergeflow-tests-server-"))
        self._context = start_prefect_server(self._home, auth_string=os.environ["PREFECT_API_AUTH_STRING"], events=events)
        self._result: PrefectServer | BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self._result = self._context.__enter__()
        except BaseException as exc:  # noqa: BLE001 - handed to the fixture, which raises it in the test
            self._result = exc

    def server(self) -> PrefectServer:
        self._thread.join()
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return dataclasses.replace(self._result, routes_events=True)

    def stop(self) -> None:
        self._thread.join()
        if not isinstance(self._result, BaseException):
            self._context.__exit__(None, None, None)
        shutil.rmtree(self._home, ignore_errors=True)


_early: list[_EarlyServer] = []


def _runs_tests(session: pytest.Session) -> bool:
    """An xdist worker or a plain -n 0 run; not the xdist controller, which only deals tests out."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "numprocesses", None))


def pytest_sessionstart(session: pytest.Session) -> None:
    if _runs_tests(session):
        _early.append(_EarlyServer())
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the whole run's view: the controller, or a -n 0 run
        _temp_before[:] = [temp_leftovers.snapshot()]


def pytest_sessionfinish(session: pytest.Session) -> None:
    for each in _early:
        each.stop()
    if _temp_before:
        left = temp_leftovers.left_since(_temp_before[0])
        if left:  # what Prefect, Dask or Chromium leave behind when a test does not give them a place of their own
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            message = "the run left these in the temp dir (tests/temp_leftovers.py): " + ", ".join(left)
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(message, red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_temp_before: list[set[str]] = []


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[PrefectServer]:
    """One real `prefect server start` on 127.0.0.1 for the whole session, stopped at the end."""
    import forked_cli

    if not _early:  # a session that skipped pytest_sessionstart
        _early.append(_EarlyServer())
    server = _early[0].server()
    forked_cli.fork_commands_of(server.client_env())  # CLI runs against it skip the cold import (tests/forked_cli.py)
    yield server
    forked_cli.stop_zygotes()
    drain_events_and_logs()


@pytest.fixture(scope="session")
def prefect_events_server() -> Iterator[PrefectServer]:
    """A server that stores events, runs automations (deployment triggers) on them and records task runs, for
    the tests that read events or task runs back or start runs from events; started on first use and stopped
    at the end. Those tests are all dealt to one worker (tests/longest_first.py, ONE_WORKER), so one run starts
    one; a test the other worker steals starts a second there."""
    started = _EarlyServer(events=True)
    try:
        yield started.server()
    finally:
        drain_events_and_logs()
        started.stop()


@pytest.fixture()
def prefect_events_api(prefect_events_server: PrefectServer) -> Iterator[PrefectServer]:
    """Run flows of this test in-process against the server that stores events."""
    with prefect_events_server.activated():
        yield prefect_events_server


@pytest.fixture(scope="session")
def pristine_flux_w2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real W=2 FSDP2 Flux checkpoint and its base, built once per worker; tests edit clones (builders.clone_export)."""
    from builders import make_export

    return make_export(tmp_path_factory.mktemp("flux-w2"), "FluxTransformer2DModel", 2)


def _shared_dcp(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: Any) -> Any:
    """A DCP written once per test session: the xdist workers share the base temp dir's parent, and the
    first to take the lock runs the gloo ranks (seconds); the others reuse what it wrote. Tests never
    change it (they copy it first)."""
    from filelock import FileLock

    from tests.fixtures.dcp_writers import write_dcp_checkpoint

    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base temp is pytest-N/popen-gwK: its parent is this session's alone.
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-dcp"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / f"{name}.lock")):
        return write_dcp_checkpoint(shared / name, **kwargs)


@pytest.fixture(scope="session")
def accelerate_dcp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real DCP of 3 gloo ranks (float32; uneven and empty shards), keys prefixed "model." as accelerate's
    FSDP2 save writes them (tests.fixtures.dcp_writers.DcpCheckpoint)."""
    return _shared_dcp(tmp_path_factory, "dcp3", world_size=3, prefix="model.")


@pytest.fixture(scope="session")
def bf16_lora_dcp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real DCP of 2 gloo ranks, bfloat16 weights, a PEFT model (base_model.model. prefix, base_layer +
    lora_A/B keys)."""
    import torch

    return _shared_dcp(tmp_path_factory, "dcp2", world_size=2, dtype=torch.bfloat16, lora=True)


@pytest.fixture()
def prefect_api(prefect_server: PrefectServer) -> Iterator[PrefectServer]:
    """Run flows of this test in-process against the session's server."""
    with prefect_server.activated():
        yield prefect_server


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the blocks are of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest tests first, dealt out to the xdist workers' blocks by length (tests/longest_first.py).
    import longest_first

    items[:] = longest_first.longest_first(items, longest_first.workers())


def pytest_collection_finish(session: pytest.Session) -> None:
    # Collection imported torch, diffusers, transformers, peft and Prefect: millions of objects that
    # live until the worker exits. Out of the collector's sight (gc.freeze), the full collections that
    # the tests' own allocations trigger no longer walk them each time.
    import gc

    if os.environ.get("MERGEFLOW_TEST_NO_GC_FREEZE"):
        return
    gc.collect()
    gc.freeze()
    _frozen_with_modules[0] = len(sys.modules)


_frozen_with_modules = [0]  # len(sys.modules) at the last gc.freeze (0: none yet, or freezing is off)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Tests import more on first use (diffusers' lazy model classes, flows.api, peft, scipy, FSDP):
    # about 1,300 modules and 130,000 objects in test_merge_flow's first test, which every later full
    # collection walked again (0.15-0.25 s each on the loaded machine; the demo checkpoint builder
    # collects once per rank). When a test has imported modules, once its fixtures are torn down,
    # what is left (modules, session and module fixtures) joins the frozen heap. The test's own
    # garbage is collected first, so nothing it left behind is frozen.
    result = yield
    if _frozen_with_modules[0] and len(sys.modules) > _frozen_with_modules[0]:
        import gc

        gc.collect()
        gc.freeze()
        _frozen_with_modules[0] = len(sys.modules)
    return result
