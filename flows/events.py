"""Sending the `mergeflow.checkpoint.saved` event to the Prefect API, and waiting until it is sent."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import sys
import threading
from typing import IO, Any

from mergeflow.errors import ApiAccessError, EventError, UsageError
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
        raise EventError(f"No Prefect API is configured, so the event would go nowhere: {_where_serve_listens()}")
    return str(api_url)


def _where_serve_listens() -> str:
    """What to set PREFECT_API_URL to: the local background server's API when it runs, else how to find it."""
    from mergeflow.ops.local_server import healthy, read_state

    state = read_state()
    if state is not None and healthy(state.api_url):
        return (f"mergeflow's local background server answers at {state.api_url}; "
                f"export PREFECT_API_URL={state.api_url} if that is the server `mergeflow serve` uses.")
    return ("set PREFECT_API_URL to the API of the server that `mergeflow serve` uses "
            "(serve prints it when it starts; `mergeflow server status` prints the local background server's api_url).")


def use_prefect_api(command: str | None = None, *, own_server: bool = True, stream: IO[str] | None = None) -> str:
    """Point this command at a Prefect API and return its URL; call it before Prefect is imported.

    The user's configured API (environment or profile) once it answers and accepts our
    credentials; else mergeflow's local background server, started if needed; else, with
    MERGEFLOW_LOCAL_SERVER=0, a server of this command's own. `own_server=False` (watch) refuses
    that last one: events sent to a server nobody else knows reach no deployment. With `command`
    (serve, watch, backfill), one line on stderr says which server it is, because a watcher,
    training code and `serve` only meet on the same one.
    """
    from mergeflow.io.os_errors import check_prefect_home
    from mergeflow.ops import local_server
    from mergeflow.ops.plain_http import skip_certificate_store

    # Before any server or Prefect import: an unusable PREFECT_HOME named as such, not as a bad target.
    check_prefect_home(local_server.prefect_home())
    out = stream or sys.stderr
    if not own_server and not local_server.local_server_enabled() and not local_server.configured_api_url():
        raise UsageError(f"{command} sends events to the server `mergeflow serve` uses, and {local_server.OPT_OUT_VAR}=0 "
                         "turns off the local background server they would share: set PREFECT_API_URL to serve's API")
    background = local_server.ensure_local_server(out)
    own = None if background is not None else local_server.ensure_command_server()
    # The URL Prefect will use: a server started just above put its own in the environment. A URL that only a
    # profile or settings file names is not read again here (that can take a subprocess).
    skip_certificate_store(os.environ.get("PREFECT_API_URL"))
    if "prefect.context" in sys.modules:
        # Imported already (a command forked from a resident process): Prefect read its settings then,
        # before PREFECT_API_URL was set just above. Its own refresh makes it read them again.
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
    if background is not None:
        api_url = background.api_url
        which = f"mergeflow's local background Prefect server at {api_url} (UI {background.ui_url}; mergeflow server stop ends it)"
    elif own is not None:
        api_url = own.api_url
        which = (f"a Prefect server of its own at {api_url}, which ends with it ({local_server.OPT_OUT_VAR}=0); "
                 f"watchers and training jobs reach it with PREFECT_API_URL={api_url}")
    else:
        api_url = reachable_api_url()
        which = f"the configured Prefect API at {api_url}"
    if command is not None:
        if background is not None or own is not None:
            reachable_api_url()  # a server started with PREFECT_SERVER_API_AUTH_STRING may still refuse us
        print(f"mergeflow: {command} uses {which}", file=out, flush=True)
    return api_url


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
        raise ApiAccessError(denied)
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
