"""A flow run ends without waiting for its heartbeat thread, and still sends its heartbeats (flows/heartbeats.py)."""

from __future__ import annotations

import threading

import pytest
from prefect import flow
from prefect.flow_engine import FlowRunEngine
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

import mergeflow.flows.merge  # noqa: F401  # a module that defines flows installs the change
from mergeflow.flows.heartbeats import skip_heartbeat_join


def test_the_engine_is_changed_once_and_stays_changed() -> None:
    from prefect import flow_engine

    installed = flow_engine._send_heartbeats
    assert skip_heartbeat_join() is True
    assert flow_engine._send_heartbeats is installed  # idempotent: not wrapped twice


def test_a_flow_run_ends_without_joining_its_heartbeat_thread(prefect_api: object,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    emit = FlowRunEngine._emit_flow_run_heartbeat

    def record(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(str(self.flow_run.id))
        return emit(self, *args, **kwargs)

    joined: list[threading.Thread] = []
    join = threading.Thread.join

    def recording_join(self: threading.Thread, timeout: float | None = None) -> None:
        joined.append(self)
        join(self, timeout)

    monkeypatch.setattr(FlowRunEngine, "_emit_flow_run_heartbeat", record)
    monkeypatch.setattr(threading.Thread, "join", recording_join)
    before = set(threading.enumerate())
    started: list[threading.Thread] = []

    @flow
    def tiny() -> str:
        # The heartbeat thread starts before the flow's body runs: a daemon thread running a
        # copied context (`contextvars.Context.run`); Prefect's log and event workers live on.
        started.extend(t for t in threading.enumerate() if t not in before and t.daemon and t.name.endswith("(run)"))
        return "done"

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        assert tiny() == "done"
    assert len(sent) == 1, sent  # the heartbeat was sent, at the run's start
    assert len(started) == 1, started
    # Prefect's engine joins it (up to a second: it sleeps in one-second steps); here nothing did.
    assert started[0] not in joined, "the flow run waited for its heartbeat thread to end"
    join(started[0], 5)  # it stops at its next step: nothing outlives the test
    assert not started[0].is_alive()
