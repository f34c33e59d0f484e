"""`mergeflow watch`: emit `mergeflow.checkpoint.saved` once per completed checkpoint (the watcher: mergeflow.ops.watch)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from mergeflow.errors import UsageError
from mergeflow.ops.watch import CheckpointCandidate, CheckpointWatcher

logger = logging.getLogger("mergeflow.ops.watch")  # one logger for the watcher and its entry point


def watch(
    train_dir: str | os.PathLike[str],
    *,
    base_model: str | None = None,
    target_dir_template: str | None = None,
    run_name: str | None = None,
    stable_seconds: float = 5.0,
    poll_seconds: float = 1.0,
    state_file: str | os.PathLike[str] | None = None,
    stop_event: threading.Event | None = None,
    timeout: float | None = None,
) -> list[CheckpointCandidate]:
    """Emit `mergeflow.checkpoint.saved` once per completed checkpoint (`mergeflow watch`)."""
    from mergeflow.flows.events import checkpoint_saved, reachable_api_url

    if target_dir_template is not None:
        try:
            target_dir_template.format(step=0, run_name="run")
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise UsageError(f"target_dir_template may use only {{step}} and {{run_name}}: {exc!r}.") from exc
    # Fail at start, not at the first checkpoint hours later: no API, none answering, or credentials refused.
    reachable_api_url()
    resolved_run = run_name or Path(train_dir).expanduser().absolute().name

    def emit(actor_dir: Path, step: int) -> None:
        target = target_dir_template.format(step=step, run_name=resolved_run) if target_dir_template else None
        checkpoint_saved(actor_dir, step=step, run_name=resolved_run, base_model=base_model, target_dir=target)

    watcher = CheckpointWatcher(train_dir, emit, stable_seconds=stable_seconds, poll_seconds=poll_seconds, state_file=state_file)
    logger.info("Watching %s for checkpoints (state in %s).", watcher.train_dir, watcher.state_file)
    return watcher.run(stop_event=stop_event, timeout=timeout)
