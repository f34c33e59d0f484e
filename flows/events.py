"""Sending the `mergeflow.checkpoint.saved` event to the Prefect API, and waiting until it is sent."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from mergeflow.errors import EventError
from mergeflow.events import EVENT_CHECKPOINT_SAVED, build_checkpoint_event
from mergeflow.io.jsonfiles import JsonObject

DEFAULT_DELIVERY_TIMEOUT = 30.0
# Prefect's queue services swallow delivery errors and report them only as ERROR records
# on this logger (e.g. "Service 'EventsWorker' failed with 1 pending items.").
_PREFECT_SERVICE_LOGGER = "prefect._internal.concurrency"

_EMIT_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


def configured_api_url() -> str:
    """The Prefect API URL from the environment or profile; EventError when none is set."""
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    if not api_url:
        # Without an API URL, Prefect's emit_event silently starts a temporary local
        # server (or drops the event) that no deployment listens to.
        raise EventError(
            "No Prefect API is configured, so the event would go nowhere: set PREFECT_API_URL "
            "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api) to the server that serves mergeflow."
        )
    return str(api_url)


def reachable_api_url() -> str:
    """The configured Prefect API URL once it answers and accepts this process's credentials; EventError otherwise."""
    from prefect.client.orchestration import get_client

    api_url = configured_api_url()
    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
        if failure is None:
            denied = _access_denied(client)
    if failure is not None:
        raise EventError(
            f"The Prefect API at {api_url} is not reachable ({type(failure).__name__}: {failure}); "
            "start it (prefect server start) or fix PREFECT_API_URL."
        )
    if denied:
        raise EventError(denied)
    return api_url


def _access_denied(client: Any) -> str | None:
    """Why the API refuses this process (a server with PREFECT_SERVER_API_AUTH_STRING), or None.

    The health check is open on such a server; anything else answers 401, and Prefect's
    events worker would only log "failed with 1 pending items". Asking for the version tells.
    """
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        client.api_version()
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code not in (401, 403):
            return None  # not an access problem; sending reports whatever else is wrong
        from prefect.settings import PREFECT_API_AUTH_STRING

        url = str(client.api_url).rstrip("/")
        if PREFECT_API_AUTH_STRING.value():
            return (f"The Prefect API at {url} refused PREFECT_API_AUTH_STRING ({exc.response.status_code}): "
                    "set it to the server's PREFECT_SERVER_API_AUTH_STRING.")
        return (f"The Prefect API at {url} requires authentication ({exc.response.status_code}): "
                "set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING (user:password).")
    return None


class _ServiceFailures(logging.Handler):
    """Collects the ERROR records the events worker logs instead of raising."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "EventsWorker" in message:
            self.messages.append(message)


def _drain_events_worker(timeout: float) -> bool:
    """Flush and stop Prefect's events worker; True when it finished within timeout."""
    from prefect.events.worker import EventsWorker

    outcome: dict[str, bool] = {}

    def drain() -> None:
        done, not_done = EventsWorker.drain_all(timeout=timeout, at_exit=False)  # type: ignore[misc]
        outcome["ok"] = not not_done

    # drain_all returns a coroutine when the calling thread runs an event loop (async
    # training code); a fresh thread always gets the blocking, timeout-bounded variant.
    thread = threading.Thread(target=drain, name="mergeflow-drain-events", daemon=True)
    thread.start()
    thread.join(timeout + 5.0)
    return outcome.get("ok", False)


def checkpoint_saved(
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    run_name: str | None = None,
    base_model: str | None = None,
    target_dir: str | None = None,
    extra: JsonObject | None = None,
    timeout: float = DEFAULT_DELIVERY_TIMEOUT,
) -> str:
    """Emit `mergeflow.checkpoint.saved` for a saved actor dir, wait until sent, return the event id."""
    resource, payload = build_checkpoint_event(
        path, step=step, run_name=run_name, base_model=base_model, target_dir=target_dir, extra=extra
    )
    api_url = reachable_api_url()

    from prefect.events import Event, emit_event

    failures = _ServiceFailures()
    service_logger = logging.getLogger(_PREFECT_SERVICE_LOGGER)
    # The drain stops Prefect's events worker: a concurrent caller's send would hit a
    # stopped worker, so emit-and-flush runs one call at a time.
    with _EMIT_LOCK:
        service_logger.addHandler(failures)
        try:
            event = emit_event(EVENT_CHECKPOINT_SAVED, resource=resource, payload=payload)
            if not isinstance(event, Event):
                raise EventError(f"Prefect did not accept the event for {payload['local_dir']}; see the Prefect log above.")
            # A training process may exit right after this call (and spawned ranks exit
            # with os._exit, skipping Prefect's atexit flush): send the event now.
            delivered = _drain_events_worker(timeout)
        finally:
            service_logger.removeHandler(failures)
    if not delivered:
        raise EventError(f"The event for {payload['local_dir']} was not sent to {api_url} within {timeout:g} s.")
    if failures.messages:
        raise EventError(f"Sending the event to {api_url} failed: {failures.messages[0]}")
    logger.info("Emitted %s for %s (event %s).", EVENT_CHECKPOINT_SAVED, payload["local_dir"], event.id)
    return str(event.id)
