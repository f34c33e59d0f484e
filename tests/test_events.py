"""mergeflow.checkpoint.saved: refused without a Prefect API, delivered to a real server with one."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect_server import PrefectServer, free_port

from mergeflow.errors import EventError, UsageError
from mergeflow.events import (
    EVENT_CHECKPOINT_SAVED,
    build_checkpoint_event,
    checkpoint_resource_id,
    checkpoint_saved,
)

REPO = Path(__file__).resolve().parents[1]


def make_actor_dir(root: Path, step: int = 12) -> Path:
    """A checkpoint directory; the event only names it, so its content does not matter here."""
    actor = root / "my-run" / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}, indent=4))
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"\0" * 16)
    (actor / "huggingface" / "config.json").write_text("{}")
    return actor


def child_env(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def test_event_fields_are_inferred_from_the_layout(tmp_path: Path) -> None:
    actor = make_actor_dir(tmp_path)
    resource, payload = build_checkpoint_event(actor.parent, base_model="base", extra={"dtype": "bfloat16"})
    assert payload == {
        "local_dir": str(actor),
        "step": 12,
        "run_name": "my-run",
        "base_model": str(Path.cwd() / "base"),
        "dtype": "bfloat16",
    }
    assert resource["prefect.resource.id"] == checkpoint_resource_id(actor)
    assert resource["prefect.resource.id"].startswith("mergeflow.checkpoint.")
    assert resource["prefect.resource.name"] == "my-run/global_step_12"
    other = make_actor_dir(tmp_path / "other")
    assert checkpoint_resource_id(other) != checkpoint_resource_id(actor)
    _, explicit = build_checkpoint_event(actor, step=3, run_name="r", target_dir="/out/x")
    assert (explicit["step"], explicit["run_name"], explicit["target_dir"]) == (3, "r", "/out/x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"extra": {"local_dir": "/elsewhere"}}, "must not redefine"),
        ({"extra": {"when": object()}}, "JSON-serialisable"),
        ({"step": -1}, "non-negative"),
    ],
)
def test_bad_event_arguments_are_usage_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_checkpoint_event(make_actor_dir(tmp_path), **kwargs)
    with pytest.raises(UsageError, match="does not exist"):
        build_checkpoint_event(tmp_path / "nowhere")


_NO_API_SCRIPT = """
import json, os, sys, time
import mergeflow.events as events
from mergeflow.errors import EventError
imported_prefect = "prefect" in sys.modules
started = time.monotonic()
try:
    events.checkpoint_saved(sys.argv[1])
    outcome = "emitted"
except EventError as exc:
    outcome = "EventError: " + str(exc)
elapsed = time.monotonic() - started
children = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
        children.append(pid)
print(json.dumps({"outcome": outcome, "elapsed": elapsed, "children": children,
                  "imported_prefect": imported_prefect,
                  "server_module": "prefect.server.api.server" in sys.modules}))
"""


def test_without_api_url_it_fails_loudly_and_starts_no_server(tmp_path: Path) -> None:
    actor = make_actor_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "empty-prefect-home")  # no profile with an API URL either
    result = subprocess.run(
        [sys.executable, "-c", _NO_API_SCRIPT, str(actor)],
        env=child_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["outcome"].startswith("EventError:") and "PREFECT_API_URL" in report["outcome"]
    assert "4200" not in report["outcome"] and "mergeflow server status" in report["outcome"]  # no guessed port
    assert report["children"] == [] and not report["server_module"]
    assert not report["imported_prefect"], "mergeflow.events must import Prefect lazily"
    assert report["elapsed"] < 10


def test_unreachable_api_is_an_event_error(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        with pytest.raises(EventError, match="not reachable"):
            checkpoint_saved(make_actor_dir(tmp_path))


class _HealthOnly(http.server.BaseHTTPRequestHandler):
    """A web server that is not Prefect: /api/health answers, the events websocket does not."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_undelivered_event_is_an_event_error(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HealthOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{server.server_port}/api"}):
            with pytest.raises(EventError, match="Sending the event to .* failed: "):
                checkpoint_saved(make_actor_dir(tmp_path))
    finally:
        server.shutdown()
        server.server_close()


def read_event(server: PrefectServer, event_id: str, timeout: float = 30.0) -> Any:
    """Poll the server's event store (persisted in batches) until the event appears."""
    # limit=50: Prefect 3.9.1's client defaults to 100, which its own server rejects (422).
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventIDFilter

    deadline = time.monotonic() + timeout
    with server.activated(), get_client(sync_client=True) as client:
        while True:
            page = client.read_events(filter=EventFilter(id=EventIDFilter(id=[UUID(event_id)])), limit=50)
            if page.events:
                return page.events[0]
            assert time.monotonic() < deadline, f"event {event_id} never reached the server"
            time.sleep(0.25)


def test_short_lived_training_process_delivers_the_event(tmp_path: Path, prefect_events_server: PrefectServer) -> None:
    actor = make_actor_dir(tmp_path)
    # os._exit skips atexit hooks (Prefect's own late flush), like multiprocessing-spawned ranks do:
    # only checkpoint_saved's explicit flush gets the event out.
    script = (
        "import os, sys; from mergeflow.events import checkpoint_saved; "
        "print(checkpoint_saved(sys.argv[1], base_model='/models/base', extra={'dtype': 'bfloat16'}), flush=True); "
        "os._exit(0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(actor)],
        env=child_env(prefect_events_server.client_env()), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    event = read_event(prefect_events_server, result.stdout.strip().splitlines()[-1])
    assert event.event == EVENT_CHECKPOINT_SAVED
    assert event.resource.id == checkpoint_resource_id(actor)
    assert event.payload == {
        "local_dir": str(actor), "step": 12, "run_name": "my-run",
        "base_model": "/models/base", "dtype": "bfloat16",
    }


def test_in_process_emit_and_watch_reach_the_server(tmp_path: Path, prefect_events_server: PrefectServer) -> None:
    from mergeflow.flows.watch import watch

    first = make_actor_dir(tmp_path, step=1)
    with prefect_events_server.activated():
        event_id = checkpoint_saved(first, target_dir=str(tmp_path / "export-1"))
    assert read_event(prefect_events_server, event_id).payload["target_dir"] == str(tmp_path / "export-1")

    train_dir = first.parent.parent
    make_actor_dir(tmp_path, step=2)
    with prefect_events_server.activated():
        emitted = watch(train_dir, target_dir_template=str(tmp_path / "out" / "{run_name}-{step}"),
                        stable_seconds=0.3, poll_seconds=0.2, timeout=3.0)
    assert [c.step for c in emitted] == [1, 2]

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = checkpoint_resource_id(train_dir / "global_step_2" / "actor")
    deadline = time.monotonic() + 30
    with prefect_events_server.activated(), get_client(sync_client=True) as client:
        while True:
            page = client.read_events(filter=EventFilter(
                event=EventNameFilter(name=[EVENT_CHECKPOINT_SAVED]), resource=EventResourceFilter(id=[wanted])), limit=50)
            if page.events:
                break
            assert time.monotonic() < deadline, "the watcher's event never reached the server"
            time.sleep(0.25)
    assert len(page.events) == 1
    assert page.events[0].payload["target_dir"] == str(tmp_path / "out" / "my-run-2")
    assert page.events[0].payload["step"] == 2


def _served_layout(tmp_path: Path) -> tuple[Path, Path]:
    """A served run's directories: a checkpoint below `ckpt/`, an empty `base/`, and the `exports/` target root."""
    actor = tmp_path / "ckpt" / "train" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (tmp_path / "base").mkdir()
    exports = tmp_path / "exports"
    exports.mkdir()
    return actor, exports


# The served event cases: a run name must be a safe slug, whatever the event says.
UNSAFE_RUN_NAMES = ["a/b", ".", "..", "a\x1bb", "a\nb", "a b", "x" * 101, "", 3, ["run"]]


@pytest.mark.parametrize("run_name", UNSAFE_RUN_NAMES, ids=[repr(n)[:12] for n in UNSAFE_RUN_NAMES])
def test_an_unsafe_run_name_is_refused_and_leaves_nothing(tmp_path: Path, run_name: Any) -> None:
    from mergeflow.flows.checkpoint import resolve_checkpoint_config
    from mergeflow.io.confinement import Confinement

    actor, exports = _served_layout(tmp_path)
    confinement = Confinement.of([str(tmp_path / "ckpt")], str(exports), [str(tmp_path / "base")])
    payload = {"local_dir": str(actor), "step": 3, "run_name": run_name}
    with pytest.raises(UsageError, match="run_name .* cannot name a directory"):
        resolve_checkpoint_config(payload, confinement=confinement, base_model=str(tmp_path / "base"), target_root=str(exports))
    assert list(exports.iterdir()) == []


@pytest.mark.parametrize("payload,reason", [
    ({"local_dir": ["/x"], "step": 3}, "local_dir must be an absolute path"),
    ({"step": "three"}, "step must be a non-negative integer"),
    ({"step": [3]}, "step must be a non-negative integer"),
    ({"run_name": "bad/name"}, "cannot name a directory"),
], ids=["local_dir-list", "step-word", "step-list", "run_name-slash"])
def test_a_malformed_event_is_a_failed_flow_run_with_the_reason(tmp_path: Path, prefect_server: PrefectServer,
                                                                payload: dict[str, Any], reason: str) -> None:
    """Raw payload values reach the flow (no parameter validation drops the run): it fails with one reason."""
    from mergeflow.flows.checkpoint import merge_checkpoint_flow

    actor, exports = _served_layout(tmp_path)
    with prefect_server.activated():
        state = merge_checkpoint_flow(checkpoint={"local_dir": str(actor), **payload}, base_model=str(tmp_path / "base"),
                                      target_root=str(exports), checkpoint_roots=[str(tmp_path / "ckpt")], return_state=True)
    assert state.is_failed(), state
    assert reason in (state.message or ""), state.message
    assert list(exports.iterdir()) == []


def test_a_failed_export_leaves_no_empty_run_folder(tmp_path: Path, prefect_server: PrefectServer) -> None:
    """The per-run folder made for the target is removed again when the export fails (here: no checkpoint files)."""
    from mergeflow.flows.checkpoint import merge_checkpoint_flow

    actor, exports = _served_layout(tmp_path)
    with prefect_server.activated():
        state = merge_checkpoint_flow(checkpoint={"local_dir": str(actor), "step": 3, "run_name": "train"},
                                      base_model=str(tmp_path / "base"), target_root=str(exports),
                                      checkpoint_roots=[str(tmp_path / "ckpt")], return_state=True)
    assert state.is_failed(), state
    assert list(exports.iterdir()) == [], list(exports.iterdir())
