"""Prefect's flow-run heartbeats, without the wait for their thread at the end of every flow run.

Prefect (3.9) sends a flow run's heartbeats from a daemon thread that sleeps in one-second steps,
and joins it when the run ends: every flow run's end waits up to a second (half a second on
average) for nothing, which is a sixth of a tiny `mergeflow merge`. The heartbeats themselves stay
(an automation may use them to mark a killed run Crashed); only the join goes. The thread is a
daemon that stops at its next step, or with the process: it holds no state that needs it to finish.

Installed by every module that defines a flow (the flows run in this process, in a served
deployment's runner, or in a worker's flow-run process: each imports its flow's module first).
If a Prefect release changes the engine so that this no longer fits, nothing is changed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

_MARK = "_mergeflow_no_join"


def skip_heartbeat_join() -> bool:
    """Make Prefect's sync flow engine end a run without joining its heartbeat thread; returns
    whether the engine is (now) so configured. Idempotent."""
    from prefect import flow_engine

    original: Callable[..., Any] | None = getattr(flow_engine, "_send_heartbeats", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    if "join_on_exit" not in inspect.signature(original).parameters:
        return False

    @functools.wraps(original)
    def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Any:
        return original(engine, join_on_exit=False)

    setattr(send_heartbeats, _MARK, True)
    flow_engine._send_heartbeats = send_heartbeats  # type: ignore[attr-defined]  # looked up at each run
    return True
