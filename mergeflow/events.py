"""Tell Prefect that training saved a checkpoint: the `mergeflow.checkpoint.saved` event.

Training code (or `mergeflow watch`) calls `checkpoint_saved(actor_dir)`; a served mergeflow
deployment whose trigger matches the event then exports the checkpoint. Prefect is imported
inside the functions only, so importing this module never pulls Prefect in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from mergeflow.checkpoint import step_of
from mergeflow.errors import EventError, UsageError

EVENT_CHECKPOINT_SAVED = "mergeflow.checkpoint.saved"
RESOURCE_PREFIX = "mergeflow.checkpoint."
DEFAULT_DELIVERY_TIMEOUT = 30.0

_CORE_PAYLOAD_KEYS = frozenset({"local_dir", "step", "run_name", "base_model", "target_dir"})
# Prefect's queue services swallow delivery errors and report them only as ERROR records
# on this logger (e.g. "Service 'EventsWorker' failed with 1 pending items.").
_PREFECT_SERVICE_LOGGER = "prefect._internal.concurrency"

_EMIT_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


def resolve_actor_dir(path: str | os.PathLike[str]) -> Path:
    """The absolute `.../actor` directory for an actor dir or its `global_step_N` parent."""
    candidate = Path(path).expanduser().absolute()
    if (candidate / "actor").is_dir():
        candidate = candidate / "actor"
    if not candidate.is_dir():
        raise UsageError(f"Checkpoint directory {candidate} does not exist; pass the global_step_N/actor directory that training saved.")
    return candidate


def infer_step(actor_dir: Path) -> int | None:
    """The N of a `global_step_N/actor` directory, or None when the layout is different."""
    return step_of(actor_dir.parent.name)


def checkpoint_resource_id(actor_dir: Path) -> str:
    """Stable Prefect resource id of one checkpoint directory (same path, same id)."""
    digest = hashlib.sha256(str(actor_dir).encode("utf-8")).hexdigest()[:16]
    return f"{RESOURCE_PREFIX}{digest}"


def build_checkpoint_event(
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    run_name: str | None = None,
    base_model: str | None = None,
    target_dir: str | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """The (resource, payload) pair of a checkpoint-saved event; pure, no Prefect."""
    actor_dir = resolve_actor_dir(path)
    if step is None:
        step = infer_step(actor_dir)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative integer, got {step!r}.")
    if run_name is None and infer_step(actor_dir) is not None:
        # global_step_N lives directly in TRAIN_OUTPUT_DIR, whose name names the run.
        run_name = actor_dir.parent.parent.name
    payload: dict[str, Any] = {"local_dir": str(actor_dir), "step": step, "run_name": run_name}
    # The deployment runs in another process and cwd: relative paths would point elsewhere.
    if base_model is not None:
        payload["base_model"] = os.path.abspath(os.path.expanduser(base_model))
    if target_dir is not None:
        payload["target_dir"] = os.path.abspath(os.path.expanduser(target_dir))
    if extra:
        clashes = sorted(_CORE_PAYLOAD_KEYS & set(extra))
        if clashes:
            raise UsageError(f"extra must not redefine {clashes}; pass them as keyword arguments instead.")
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"extra must be JSON-serialisable for the event payload: {exc}.") from exc
        payload.update(extra)
    name = f"{run_name}/global_step_{step}" if run_name and step is not None else str(actor_dir)
    resource = {"prefect.resource.id": checkpoint_resource_id(actor_dir), "prefect.resource.name": name}
    return resource, payload


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


def _check_api_reachable(api_url: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        raise EventError(
            f"The Prefect API at {api_url} is not reachable ({type(failure).__name__}: {failure}); "
            "start it (prefect server start) or fix PREFECT_API_URL."
        )


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
    extra: dict[str, Any] | None = None,
    timeout: float = DEFAULT_DELIVERY_TIMEOUT,
) -> str:
    """Emit `mergeflow.checkpoint.saved` for a saved actor dir, wait until sent, return the event id."""
    resource, payload = build_checkpoint_event(
        path, step=step, run_name=run_name, base_model=base_model, target_dir=target_dir, extra=extra
    )
    api_url = configured_api_url()
    _check_api_reachable(api_url)

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
