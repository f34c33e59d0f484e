"""What an operator sees in the Prefect UI: run names, logs, artifacts and typed deployment forms,
read back through the Prefect client of the session's real server."""

from __future__ import annotations

import io
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from prefect_runs import flow_run_logs, latest_flow_run

from mergeflow import merge_model
from mergeflow.errors import ArtifactInvalidError
from mergeflow.flows.artifacts import artifact_key
from mergeflow.flows.run_names import export_label, slug, validate_label
from mergeflow.io.paths import staging_dir_for


def test_names_carry_the_training_run_and_step(tmp_path: Path) -> None:
    # Every run saves global_step_100: the run's name must be in the label, not only the leaf.
    assert export_label("/exports/run-a/global_step_100") == "run-a-step100"
    assert export_label("/exports/run-b/global_step_100") == "run-b-step100"
    assert export_label("/out/x/global_step_3/actor") == "x-step3"
    # A target outside verl's layout: the source's run and step, else the target's parent and leaf.
    assert export_label("/out/artifact-check", "/t/My_Run/global_step_12/actor") == "my-run-step12"
    assert export_label("/work/nan-out", "/t/somewhere/actor") == "work-nan-out"
    assert export_label(None) == "artifact"
    assert export_label("/exports/global_step_5") == "exports-step5"
    # The source's run and step win over the target's: myrun's step 7, not a run called "exports".
    assert export_label("exports/global_step_7", "myrun/global_step_7/actor") == "myrun-step7"
    assert export_label("/exports/run-a/global_step_100", "/t/run-b/global_step_100") == "run-b-step100"
    assert export_label("/exports/run-a/global_step_100", "/t/somewhere/actor") == "run-a-step100"  # else the target's
    # Names are what artifact keys accept: the label survives artifact_key unchanged.
    for label in ("run-a-step100", "work-nan-out", slug("Ünïcode run.v2 / x")):
        assert artifact_key("merge-manifest", label) == f"merge-manifest-{label}"
        assert all(c.islower() or c.isdigit() or c == "-" for c in label) and "--" not in label
    long = export_label(f"/e/{'r' * 300}/global_step_9")
    assert long.endswith("-step9") and len(artifact_key("merge-manifest", long)) <= 100
    # A kept staging dir is named after the target it would have published.
    staging = staging_dir_for(tmp_path / "run-c" / "global_step_4", "e" * 64)
    (staging / "artifact").mkdir(parents=True)
    assert validate_label(staging) == validate_label(staging / "artifact") == "run-c-step4-staging"
    assert validate_label(tmp_path / "run-c" / "global_step_4") == "run-c-step4"


def _artifact(key: str, flow_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert len(found) == 1, f"no artifact {key} of this run"
    return found[0]


def test_merge_run_name_logs_and_summary_through_the_client(tmp_path: Path, prefect_api: object,
                                                            pristine_flux_w2: Any) -> None:
    ex = pristine_flux_w2
    # The example: local_dir=<run>/global_step_7/actor, target_dir=exports/global_step_7. The
    # run is named after the source's training run and step, not "merge-exports-step7".
    actor = tmp_path / "run-ui" / "global_step_7" / "actor"
    shutil.copytree(ex.actor_dir, actor, symlinks=True)
    target = tmp_path / "exports" / "global_step_7"
    target.parent.mkdir(parents=True)
    result = merge_model(ex.config(target, local_dir=str(actor)))
    run = latest_flow_run("merge-run-ui-step7")
    assert run.name == "merge-run-ui-step7" and run.state.is_completed()

    messages = flow_run_logs(run.id, "Published")
    start = next(m for m in messages if m.startswith("Merging "))
    assert str(actor) in start and str(ex.base_dir) in start and str(target) in start and "format transformer" in start
    files = sorted(p for p in target.rglob("*") if p.is_file())
    end = next(m for m in messages if m.startswith("Published "))
    assert end.startswith(f"Published {result.output_dir}: {len(files)} files, {sum(p.stat().st_size for p in files)} bytes in ")
    assert end.endswith(" s")

    summary = _artifact("merge-summary-run-ui-step7", run.id).data
    assert f"| source | `{actor}` |" in summary and f"| base model | `{ex.base_dir}` |" in summary
    for layer in ("structure", "source_round_trip", "artifact_round_trip", "integrity", "runtime"):
        assert f"| {layer} |" in summary
    assert "| runtime | not_run | loaded with Diffusers and one denoising step run" in summary
    assert "| runtime check | not_run (merge without --smoke) |" in summary
    assert "| model card | README.md: finetune of not named" in summary
    assert f"mergeflow test --backend fsdp --test_hf_dir {result.output_dir}" in summary
    table = _artifact("merge-manifest-run-ui-step7", run.id).data
    rows = table if isinstance(table, list) else __import__("json").loads(table)
    assert rows and all(r["bytes"] == (target / r["file"]).stat().st_size and r["size"] for r in rows)
    digests = __import__("json").loads((target / "merge_manifest.json").read_text())["files"]
    assert all(r["sha256"] == digests[r["file"]][:16] + "…" for r in rows)  # readable; the full one in the manifest
    assert _artifact("merge-progress-run-ui-step7", run.id).type == "progress"


def test_validating_a_staging_dir_names_its_target_or_says_why_not(tmp_path: Path, prefect_api: object,
                                                                 pristine_flux_w2: Any) -> None:
    from mergeflow.flows.validate import validate_flow

    published = Path(merge_model(pristine_flux_w2.config(tmp_path / "published")).output_dir)
    staging = staging_dir_for(tmp_path / "nan-run" / "global_step_2", "d" * 64)
    shutil.copytree(published, staging / "artifact")
    assert validate_flow(test_hf_dir=str(staging))["integrity"] == "passed"
    assert latest_flow_run("validate-nan-run-step2-staging").state.is_completed()
    # A merge that failed while writing shards staged no manifest: refused, with the reason and the way on.
    (staging / "artifact" / "merge_manifest.json").unlink()
    with pytest.raises(ArtifactInvalidError, match="failed before writing its manifest.*rerun the same merge"):
        validate_flow(test_hf_dir=str(staging))


def test_deployment_forms_are_typed(tmp_path: Path, prefect_api: object) -> None:
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    from mergeflow.deployments.serve import ServeSettings, build_deployments
    from mergeflow.flows.checkpoint import merge_checkpoint_flow
    from mergeflow.flows.validate import validate_flow

    schema = parameter_schema(merge_checkpoint_flow.fn).model_dump()
    props = schema["properties"]
    assert props["output_format"]["enum"] == ["pipeline", "transformer", "single_file", "gguf"]
    assert props["dtype"]["enum"] == ["preserve", "float32", "float16", "bfloat16"]
    assert props["quantize"]["enum"] == ["none", "fp8", "bf16", "q8_0"]
    assert props["task_runner"]["enum"] == ["thread", "dask"]
    assert all(p.get("description") for p in props.values()), [k for k, p in props.items() if not p.get("description")]
    payload = schema["definitions"]["CheckpointPayload"]
    assert payload["required"] == ["local_dir"] and all(f["description"] for f in payload["properties"].values())
    assert "global_step_<N>/actor" in payload["properties"]["local_dir"]["description"]
    assert "staging" in parameter_schema(validate_flow.fn).model_dump()["properties"]["test_hf_dir"]["description"]

    # The deployments `serve` registers carry that schema to the server (and so to the UI's form).
    settings = ServeSettings(base_model=str(tmp_path), target_root=str(tmp_path), checkpoint_roots=(str(tmp_path),))
    deployments = build_deployments(settings)
    suffix = uuid4().hex[:8]
    ids = []
    with get_client(sync_client=True) as client:
        try:
            for deployment in deployments:
                deployment.name = f"{deployment.name}-ui-{suffix}"  # never the names a served test waits for
                deployment.triggers = []  # no automation left behind on the session's server
                ids.append(deployment.apply())
            merge, validate, backfill, smoke = (client.read_deployment(i) for i in ids)
        finally:
            for i in ids:
                client.delete_deployment(i)
    stored = merge.parameter_openapi_schema
    assert stored["properties"]["dtype"]["enum"] == props["dtype"]["enum"]
    assert stored["properties"]["quantize"]["enum"] == props["quantize"]["enum"]
    assert stored["definitions"]["CheckpointPayload"]["properties"]["step"]["description"]
    assert validate.parameter_openapi_schema["properties"]["test_hf_dir"]["description"]
    # The smoke (runtime check) form: typed device and dtype choices, every field described.
    smoke_props = smoke.parameter_openapi_schema["properties"]
    assert smoke_props["device"]["enum"] == ["cpu", "cuda"] and smoke_props["dtype"]["enum"] == ["float32", "bfloat16", "float16"]
    assert all(p.get("description") for p in smoke_props.values())
    # The backfill form: the same choices as the merge's, every field described, train_dir the one to fill in.
    backfill_schema = backfill.parameter_openapi_schema
    backfill_props = backfill_schema["properties"]
    assert backfill_schema["required"] == ["train_dir", "base_model", "target_root"]
    assert set(backfill.parameters) == {"base_model", "target_root", "output_format", "dtype", "max_shard_size", "workers",
                                        "task_runner", "dask_address", "checkpoint_roots", "quantize",
                                        "extract_lora", "extract_energy", "sign_key", "smoke", "smoke_device", "base_model_id"}
    assert all(backfill_props[k]["enum"] == props[k]["enum"] for k in ("output_format", "dtype", "quantize", "task_runner",
                                                                        "smoke_device"))
    assert (backfill_props["max_shard_size"]["type"], backfill_props["stable_seconds"]["type"]) == ("integer", "number")
    assert all(p.get("description") for p in backfill_props.values()), [k for k, p in backfill_props.items() if not p.get("description")]


def test_the_serve_feed_prints_one_line_per_run_started_and_finished() -> None:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Completed, Failed, Pending, Running

    from mergeflow.deployments.run_feed import RunFeed, run_lines

    a = FlowRun(flow_id=uuid4(), name="checkpoint-run-a-step1", state=Pending())
    seen: dict[Any, Any] = {}
    assert run_lines(seen, [a]) == []
    a.state, a.state_type = Running(), Running().type
    assert run_lines(seen, [a]) == [f"mergeflow serve: started checkpoint-run-a-step1 ({a.id})"]
    assert run_lines(seen, [a]) == []  # once per transition, not once per poll
    done = Completed()
    a.state, a.state_type, a.state_name, a.total_run_time = done, done.type, done.name, timedelta(seconds=3.25)
    assert run_lines(seen, [a]) == ["mergeflow serve: checkpoint-run-a-step1 Completed in 3.2 s"]
    # A run that started and failed between two polls gets both lines, with the first line of its reason.
    failed = Failed(message="the event's step must be a non-negative integer\ntraceback ...")
    b = FlowRun(flow_id=uuid4(), name="validate-x", state=failed, state_type=failed.type, state_name=failed.name)
    assert run_lines(seen, [a, b]) == [f"mergeflow serve: started validate-x ({b.id})",
                                       "mergeflow serve: validate-x Failed: the event's step must be a non-negative integer"]
    feed = RunFeed(["mergeflow-validate"], out=io.StringIO())
    assert feed.daemon and not feed.seen


def test_the_serve_feed_follows_a_deployment_run_on_the_server(tmp_path: Path, prefect_api: object) -> None:
    """RunFeed against the real server: a deployment's run moved to Running, then Completed, prints two lines."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from mergeflow.deployments.run_feed import RunFeed
    from mergeflow.deployments.serve import ServeSettings, build_deployments

    settings = ServeSettings(base_model=str(tmp_path), target_root=str(tmp_path), checkpoint_roots=(str(tmp_path),))
    validate = build_deployments(settings)[1]
    validate.name = f"feed-{uuid4().hex[:8]}"
    out = io.StringIO()
    feed = RunFeed(["mergeflow-validate"], out=out, poll_seconds=0.2)
    with get_client(sync_client=True) as client:
        deployment_id = validate.apply()
        try:
            feed.start()
            assert feed.ready.wait(20)  # the baseline: runs before serve started are not news
            run = client.create_flow_run_from_deployment(deployment_id, parameters={"test_hf_dir": str(tmp_path)})
            for state, expected in ((Running(), 1), (Completed(), 2)):  # each state seen by a poll before the next
                client.set_flow_run_state(run.id, state, force=True)
                deadline = time.monotonic() + 20
                while out.getvalue().count("\n") < expected and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            feed.stop.set()
            client.delete_deployment(deployment_id)
    lines = out.getvalue().splitlines()
    assert lines[:1] == [f"mergeflow serve: started {run.name} ({run.id})"], lines
    assert len(lines) == 2 and lines[1].startswith(f"mergeflow serve: {run.name} Completed"), lines


def test_a_mergeflow_failure_logs_its_reason_and_its_traceback_only_at_debug() -> None:
    import logging

    from mergeflow.tasks import ReasonFirst

    assert any(isinstance(f, ReasonFirst) for f in logging.getLogger("prefect.task_runs").filters)
    assert any(isinstance(f, ReasonFirst) for f in logging.getLogger("prefect.flow_runs").filters)
    logger = logging.getLogger(f"mergeflow-test-reason-{uuid4().hex}")
    logger.propagate = False
    logger.addFilter(ReasonFirst())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)

    def fail(exc: Exception) -> None:
        try:
            raise exc
        except Exception:
            logger.error("Task run failed with exception: %r - Retries are exhausted", exc, exc_info=True)

    logger.setLevel(logging.INFO)
    fail(ArtifactInvalidError("config.json does not match its sha256"))
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in records] == [
        ("ERROR", "Failed with ArtifactInvalidError: config.json does not match its sha256", None)]
    records.clear()
    logger.setLevel(logging.DEBUG)
    fail(ArtifactInvalidError("config.json does not match its sha256"))
    assert [r.levelname for r in records] == ["DEBUG", "ERROR"] and records[0].exc_info and not records[1].exc_info
    records.clear()
    fail(ValueError("a bug"))  # not a mergeflow error: the traceback stays with it
    assert len(records) == 1 and records[0].exc_info and "Retries are exhausted" in records[0].getMessage()
