"""Prefect's side of an interrupted export: whether its API still answers, and the crashed run's message.

The signal handling itself (one stop, one line, exit 130/143) is mergeflow.ops.signals; these
two need Prefect: the settings' API URL, and the client that rewrites a crashed run's state.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from mergeflow.ops.signals import kept_staging

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import State


def api_answers() -> bool:
    """Whether what Prefect queued (logs, states) can still be sent: for `end_soon` after an interrupt."""
    if "prefect" not in sys.modules:  # stopped before any flow ran: nothing is queued
        return True
    from prefect.settings import get_current_settings

    from mergeflow.ops.local_server import healthy

    url = get_current_settings().api.url
    return bool(url) and healthy(str(url), timeout=1.0)


def name_the_kept_staging(flow: Any, flow_run: FlowRun, state: State) -> None:
    """`on_crashed` hook: the crashed run's state message also names the staging kept for a resume.

    Prefect's own message ("Execution was aborted by a termination signal.") is all the UI showed;
    the staging directory was only in the command's last line, which a served run has no console for.
    """
    config = flow_run.parameters.get("config")
    target = config.get("target_dir") if isinstance(config, dict) else getattr(config, "target_dir", None)
    kept = kept_staging(target if isinstance(target, str) else None)
    if not kept:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    message = f"{state.message or 'Crashed.'} Work kept for resume in {kept[-1]} (rerun the same export to resume)."
    # A failed update leaves Prefect's own message: the hook must never change how the command ends.
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Crashed(message=message, data=state.data), force=True)
