"""Sending the `mergeflow.checkpoint.saved` event to the Prefect API, and waiting until it is sent."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
from typing import Any

from mergeflow.errors import EventError
from mergeflow.events import EVENT_CHECKPOINT_SAVED, build_checkpoint_event
from mergeflow.io.jsonfiles import JsonObject

DEFAULT_DELIVERY_TIMEOUT = 30.0

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


def _send_confirmed(event: Any, timeout: float) -> BaseException | None:
    """Send `event` on its own websocket and wait for the server's pong; the failure, or None.

    Not Prefect's background events worker: it reports a failed send only as a log record,
    and draining it right after `emit_event` can return before its thread has even started
    (a busy machine), so an undelivered event looked sent. A ping after the send (one
    checkpoint per event) returns only once the server has read everything sent before it.
    """
    from prefect.events.clients import get_events_client

    async def send() -> None:
        async with get_events_client(reconnection_attempts=2, checkpoint_every=1) as client:
            await client.emit(event)

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(send(), timeout))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    # A fresh thread with a copy of this context: the caller may run an event loop (async
    # training code), and Prefect's settings (the API URL) live in context variables.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(run,), name="mergeflow-send-event", daemon=True)
    thread.start()
    thread.join(timeout + 5.0)
    if not outcome:
        return TimeoutError(f"no answer within {timeout:g} s")
    return outcome[0]


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

    from prefect.events import Event

    event = Event(event=EVENT_CHECKPOINT_SAVED, resource=resource, payload=payload)
    # A training process may exit right after this call (and spawned ranks exit with
    # os._exit): the event is sent, and confirmed, before it returns.
    failure = _send_confirmed(event, timeout)  # its own connection: concurrent callers do not wait on each other
    if isinstance(failure, (TimeoutError, asyncio.TimeoutError)):
        raise EventError(f"The event for {payload['local_dir']} was not sent to {api_url} within {timeout:g} s.")
    if failure is not None:
        raise EventError(f"Sending the event to {api_url} failed: {type(failure).__name__}: {failure}")
    logger.info("Emitted %s for %s (event %s).", EVENT_CHECKPOINT_SAVED, payload["local_dir"], event.id)
    return str(event.id)
