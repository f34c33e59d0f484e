"""The `mergeflow.checkpoint.saved` event: its name, resource and payload (pure, no Prefect).

Training code (or `mergeflow watch`) calls `mergeflow.events.checkpoint_saved(actor_dir)`; a
served mergeflow deployment whose trigger matches the event then exports the checkpoint. The
sending lives in `mergeflow.flows.events` (it is a Prefect client); `checkpoint_saved` and
`configured_api_url` stay importable from here, loaded on first use, because training code
already imports them from this module.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mergeflow.errors import UsageError
from mergeflow.formats.verl_checkpoint import step_of
from mergeflow.io.jsonfiles import JsonObject

EVENT_CHECKPOINT_SAVED = "mergeflow.checkpoint.saved"
RESOURCE_PREFIX = "mergeflow.checkpoint."

_CORE_PAYLOAD_KEYS = frozenset({"local_dir", "step", "run_name", "base_model", "target_dir"})

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
    extra: JsonObject | None = None,
) -> tuple[dict[str, str], JsonObject]:
    """The (resource, payload) pair of a checkpoint-saved event; pure, no Prefect."""
    actor_dir = resolve_actor_dir(path)
    if step is None:
        step = infer_step(actor_dir)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative integer, got {step!r}.")
    if run_name is None and infer_step(actor_dir) is not None:
        # global_step_N lives directly in TRAIN_OUTPUT_DIR, whose name names the run.
        run_name = actor_dir.parent.parent.name
    payload: JsonObject = {"local_dir": str(actor_dir), "step": step, "run_name": run_name}
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


_SENDER = frozenset({"checkpoint_saved", "configured_api_url"})


def __getattr__(name: str) -> object:
    if name not in _SENDER:
        raise AttributeError(f"module 'mergeflow.events' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("mergeflow.flows.events"), name)
