"""Served deployments on a real Prefect server: an event (direct or from the watcher) becomes a merge; a backfill run catches up."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import Export, assert_bit_exact, clone_export, output_state, tree_digest
from prefect_runs import flow_runs

from mergeflow import validate_artifact

REPO = Path(__file__).resolve().parent.parent
MERGE = "mergeflow-merge-checkpoint/on-checkpoint"
VALIDATE = "mergeflow-validate/validate"
BACKFILL = "mergeflow-backfill/backfill"


async def _deployment_ready(name: str) -> Any:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        try:
            deployment = await client.read_deployment_by_name(name)
        except Exception:  # not registered yet
            return None
        automations = await client.read_automations_by_name("mergeflow-checkpoint-saved")
        return deployment if automations or not name.startswith("mergeflow-merge") else None


async def _forget_served() -> None:
    """Deletes the served deployments, their scheduled runs and their event automations from the shared server.

    The test server lives for the whole session: without this, an automation left by an earlier serve turns any
    later checkpoint event (other tests emit them) into a scheduled run that the next serve picks up first.
    """
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        for name in (MERGE, VALIDATE, BACKFILL):
            try:
                deployment = await client.read_deployment_by_name(name)
            except Exception:  # never registered
                continue
            await client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
            await client.delete_deployment(deployment.id)


def wait_for(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)  # each check is one cheap API read; a run's end is seen within 0.1 s
    tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture()
def served(tmp_path: Path, prefect_events_server: Any, prefect_events_api: Any, pristine_flux_w2: Export) -> Iterator[dict[str, Any]]:
    """`python -m mergeflow serve` in its own process group, stopped (with its flow runs) at the end."""
    with _serving(tmp_path, prefect_events_server, pristine_flux_w2) as info:
        yield info


@contextlib.contextmanager
def _serving(tmp_path: Path, prefect_server: Any, pristine: Export, *, max_shard_size: str = "60000",
             extra_env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    ex = clone_export(pristine, tmp_path)  # the real W=2 checkpoint, copied: no torch build here
    root = tmp_path / "exports"
    root.mkdir()
    env = {**prefect_server.client_env(), **(extra_env or {})}
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # pick up triggered runs within a second
    scratch = tmp_path / "serve-tmp"  # serve's own temporary files, to see what it leaves behind
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    log = tmp_path / "serve.log"
    asyncio.run(_forget_served())
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mergeflow", "serve", "--base_model", str(ex.base_dir), "--target-root", str(root),
             "--checkpoint-root", str(tmp_path),
             "--output_format", "transformer", "--max_shard_size", max_shard_size],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        deployment = wait_for(lambda: asyncio.run(_deployment_ready(MERGE)), 120, "the served deployments", proc, log)
        wait_for(lambda: asyncio.run(_deployment_ready(VALIDATE)), 30, "the validate deployment", proc, log)
        wait_for(lambda: asyncio.run(_deployment_ready(BACKFILL)), 30, "the backfill deployment", proc, log)
        yield {"export": ex, "root": root, "deployment": deployment, "proc": proc, "log": log}
    finally:
        _stop_group(proc)
        asyncio.run(_forget_served())
    # Stopped (Ctrl-C, or SIGTERM in a test): the runner's scratch directory went with it.
    assert not list(scratch.glob("runner_storage/*")), "serve left its runner's scratch directory behind"


def completed_runs(deployment_id: Any) -> list[Any]:
    runs = flow_runs(deployment_id=deployment_id)
    failed = [r for r in runs if r.state is not None and r.state.is_final() and not r.state.is_completed()]
    assert not failed, f"a triggered run ended {failed[0].state}"
    return [r for r in runs if r.state is not None and r.state.is_completed()]


def copy_slowly(src: Path, dst: Path) -> None:
    """What a saving trainer does: rank files one by one, configs after, verl's tracker last."""
    dst.mkdir(parents=True)
    for path in sorted(src.glob("*_rank_*.pt")):
        shutil.copyfile(path, dst / path.name)
        time.sleep(0.3)
    shutil.copytree(src / "huggingface", dst / "huggingface")
    shutil.copyfile(src / "fsdp_config.json", dst / "fsdp_config.json")
    (dst.parent.parent / "latest_checkpointed_iteration.txt").write_text(dst.parent.name.removeprefix("global_step_"))


def _final_state(run_id: Any) -> Any:
    """The flow run's state once final, else None."""
    from prefect.client.orchestration import get_client

    async def read() -> Any:
        async with get_client() as client:
            return (await client.read_flow_run(run_id)).state

    state = asyncio.run(read())
    return state if state is not None and state.is_final() else None


async def _served_backfill() -> tuple[Any, list[Any]]:
    """The backfill deployment as serve registered it, and the automations that would start it (none)."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        deployment = await client.read_deployment_by_name(BACKFILL)
        automations = await client.read_automations()
    return deployment, [a for a in automations if any(getattr(x, "deployment_id", None) == deployment.id for x in a.actions)]


def test_event_and_watcher_start_merges_validate_and_backfill_run_alone(tmp_path: Path, served: dict[str, Any]) -> None:
    from prefect.deployments import run_deployment

    from mergeflow.events import checkpoint_saved
    from mergeflow.flows.watch import watch

    ex, root, deployment = served["export"], served["root"], served["deployment"]
    # 1. Training code emits the event; the payload has no base_model/target: serve's defaults apply.
    checkpoint_saved(ex.actor_dir)
    wait_for(lambda: len(completed_runs(deployment.id)) == 1, 240, "the triggered merge", served["proc"], served["log"])
    target = root / "ckpt" / "global_step_1"  # <target-root>/<run_name>/global_step_<step>
    assert_bit_exact(ex.actor.state_dict(), output_state(target))
    assert validate_artifact(target)["integrity"] == "passed"

    # 2. The validate deployment reruns validation alone. Requested now and checked after step 3: the
    # runner's start of it (a fresh interpreter) overlaps the slow copy the watcher waits out.
    validation = run_deployment(VALIDATE, parameters={"test_hf_dir": str(target)}, timeout=0)

    # 3. The watcher sees a checkpoint written slowly, emits one event, and that becomes a merge too.
    train = tmp_path / "run-b"
    train.mkdir()
    stop = threading.Event()
    emitted: list[Any] = []
    # Prefect's settings (the API URL) live in context variables, which a new thread does not inherit.
    context = contextvars.copy_context()
    watcher = threading.Thread(target=context.run, args=(lambda: emitted.extend(
        watch(train, stable_seconds=1.0, poll_seconds=0.2, stop_event=stop, timeout=240)),), daemon=True)
    watcher.start()
    try:
        copy_slowly(ex.actor_dir, train / "global_step_2" / "actor")
        wait_for(lambda: len(completed_runs(deployment.id)) == 2, 240, "the watcher's merge", served["proc"], served["log"])
    finally:
        stop.set()
        watcher.join(timeout=15)
    validated = wait_for(lambda: _final_state(validation.id), 180, "the validate run", served["proc"], served["log"])
    assert validated.is_completed(), validated
    assert [c.step for c in emitted] == [2]
    assert validate_artifact(root / "run-b" / "global_step_2")["integrity"] == "passed"
    assert len(flow_runs(deployment_id=deployment.id)) == 2  # exactly one run per checkpoint

    # 4. The backfill deployment: registered with serve's settings and a typed form, started by nothing
    # but a run request; it exports the step saved while nothing watched and leaves the published one.
    backfill, automations = asyncio.run(_served_backfill())
    assert automations == []
    assert backfill.parameters["target_root"] == str(root) and backfill.parameters["checkpoint_roots"] == [str(tmp_path)]
    assert backfill.parameters["output_format"] == "transformer" and backfill.parameters["max_shard_size"] == 60000
    props = backfill.parameter_openapi_schema["properties"]
    assert backfill.parameter_openapi_schema["required"] == ["train_dir", "base_model", "target_root"]
    assert props["output_format"]["enum"] == ["pipeline", "transformer", "single_file", "gguf"] and props["task_runner"]["enum"] == ["thread", "dask"]
    assert props["stable_seconds"]["type"] == "number" and "global_step_<N>" in props["train_dir"]["description"]
    shutil.copytree(ex.actor_dir, train / "global_step_3" / "actor")
    (train / "latest_checkpointed_iteration.txt").write_text("3")
    published = tree_digest(root / "run-b" / "global_step_2")
    run = run_deployment(BACKFILL, parameters={"train_dir": str(train), "stable_seconds": 0}, timeout=240, poll_interval=0.2)
    assert run.state is not None and run.state.is_completed(), (run.state, served["log"].read_text(errors="replace")[-3000:])
    assert run.name == "backfill-run-b"
    step3 = root / "run-b" / "global_step_3"
    assert_bit_exact(ex.actor.state_dict(), output_state(step3))
    assert validate_artifact(step3)["integrity"] == "passed"
    # Written as serve's triggered merge of the same checkpoint was (its --max_shard_size, its format).
    assert sorted(p.name for p in step3.iterdir()) == sorted(p.name for p in (root / "run-b" / "global_step_2").iterdir())
    assert len(list(step3.glob("*.safetensors"))) > 1
    assert tree_digest(root / "run-b" / "global_step_2") == published  # skipped, untouched
    assert len(flow_runs(deployment_id=deployment.id)) == 2  # the backfill started no triggered merge


def test_prefect_yaml_deploys_with_prefect_deploy_all(tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from mergeflow.deployments.serve import ServeSettings

    async def create_pool() -> None:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name="mergeflow", type="process"), overwrite=True)

    asyncio.run(create_pool())
    env = prefect_server.client_env()
    env.update(MERGEFLOW_BASE_MODEL="/models/base", MERGEFLOW_TARGET_ROOT="/exports", MERGEFLOW_CHECKPOINT_ROOT="/checkpoints")
    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                           "deployments/prefect.yaml"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    async def read() -> tuple[Any, Any, Any, list[Any], list[Any]]:
        async with get_client() as client:
            merge = await client.read_deployment_by_name(MERGE)
            validate = await client.read_deployment_by_name(VALIDATE)
            backfill = await client.read_deployment_by_name(BACKFILL)
            automations = await client.read_automations()
            owned = [a for a in automations if any(getattr(x, "deployment_id", None) == merge.id for x in a.actions)]
            backfill_owned = [a for a in automations if any(getattr(x, "deployment_id", None) == backfill.id for x in a.actions)]
            for deployment in (merge, validate, backfill):  # leave the session's server as we found it
                await client.delete_deployment(deployment.id)
            return merge, validate, backfill, owned, backfill_owned

    merge, validate, backfill, automations, backfill_automations = asyncio.run(read())
    assert {merge.work_pool_name, validate.work_pool_name, backfill.work_pool_name} == {"mergeflow"}
    # The backfill deployment: the flow serve serves, serve's parameter names, run on demand only.
    assert backfill.entrypoint == "mergeflow.flows.backfill_flow.backfill_flow" and backfill_automations == []
    assert backfill.parameters["checkpoint_roots"] == ["/checkpoints"] and backfill.parameters["target_root"] == "/exports"
    assert backfill.parameters["base_model"] == "/models/base"
    served = ServeSettings(base_model="/b", target_root="/t", checkpoint_roots=("/c",)).backfill_parameters()
    assert set(backfill.parameters) <= set(served), set(backfill.parameters) - set(served)
    assert backfill.parameter_openapi_schema["properties"]["dtype"]["enum"] == ["preserve", "float32", "float16", "bfloat16"]
    assert backfill.parameters["quantize"] == merge.parameters["quantize"] == "none"
    assert merge.entrypoint == "mergeflow.flows.checkpoint.merge_checkpoint_flow"
    assert merge.parameters["base_model"] == "/models/base" and merge.parameters["target_root"] == "/exports"
    assert merge.parameters["checkpoint_roots"] == ["/checkpoints"] and merge.parameters["allowed_base_models"] == []
    assert validate.parameters == {"within": "/exports"}
    assert len(automations) == 1
    trigger = automations[0].trigger
    assert trigger.expect == {"mergeflow.checkpoint.saved"}
    assert automations[0].actions[0].parameters == {"checkpoint": "{{ event.payload }}"}


def test_a_malformed_served_event_is_a_failed_run_with_its_reason(tmp_path: Path, served: dict[str, Any]) -> None:
    """A wrongly typed step reaches the served flow (no run dropped by parameter validation): a failed run, one reason."""
    from prefect.events import emit_event

    from mergeflow.events import build_checkpoint_event

    ex, root, deployment = served["export"], served["root"], served["deployment"]
    resource, payload = build_checkpoint_event(ex.actor_dir)
    emit_event(event="mergeflow.checkpoint.saved", resource=resource, payload={**payload, "step": [1]})
    runs = wait_for(lambda: [r for r in flow_runs(deployment_id=deployment.id) if r.state is not None and r.state.is_final()],
                    240, "the malformed event's run", served["proc"], served["log"])
    assert runs[0].state.is_failed(), runs[0].state
    assert "step must be a non-negative integer" in (runs[0].state.message or ""), runs[0].state.message
    assert list(root.iterdir()) == []  # nothing created under the target root


def test_sigterm_stops_a_served_runs_writers_between_tensors(tmp_path: Path, prefect_events_server: Any, prefect_events_api: Any,
                                                            pristine_flux_w2: Export) -> None:
    """A scheduler's SIGTERM to a served flow run's process stops its writers at the next tensor, as on the CLI:
    the bytes written after the signal are bounded by one tensor per writer, never the rest of the shard."""
    import psutil
    from prefect.events import emit_event
    from test_interrupts import _largest_tensor_bytes

    from mergeflow.events import build_checkpoint_event

    slow = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "slow_site"), os.environ.get("PYTHONPATH", "")]),
            "MERGEFLOW_TEST_SLOW_TENSOR_S": "0.3"}
    with _serving(tmp_path, prefect_events_server, pristine_flux_w2, max_shard_size="100000000", extra_env=slow) as info:
        ex, root, deployment = info["export"], info["root"], info["deployment"]

        def staged() -> int:
            return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and "mergeflow-staging" in str(f))

        resource, payload = build_checkpoint_event(ex.actor_dir)
        emit_event(event="mergeflow.checkpoint.saved", resource=resource, payload=payload)
        wait_for(lambda: staged() >= 20000, 240, "the served run writing its one shard", info["proc"], info["log"])
        children = psutil.Process(info["proc"].pid).children(recursive=True)
        runners = [p for p in children if p.cmdline()[1:] == ["-m", "prefect.engine"]]
        assert len(runners) == 1, [p.cmdline() for p in children]  # the flow run's own spawned process
        at_signal = staged()
        runners[0].send_signal(signal.SIGTERM)
        runs = wait_for(lambda: [r for r in flow_runs(deployment_id=deployment.id) if r.state is not None and r.state.is_final()],
                        120, "the signalled run's final state", info["proc"], info["log"])
        after = staged() - at_signal
    per_tensor = _largest_tensor_bytes(ex)
    print(f"served run: bytes after SIGTERM: {after} (largest tensor {per_tensor}, at signal {at_signal})")
    assert not runs[0].state.is_completed(), runs[0].state
    assert after <= 2 * per_tensor + 4096, (after, per_tensor)  # two writers, one tensor each, and a shard header
    assert not any(p.is_dir() and "mergeflow-staging" not in p.name and (p / "merge_manifest.json").exists()
                   for p in root.rglob("*")), "nothing may be published"
