"""Operations without a server: trigger parameters, event -> config, staging list/clean, runners, tracker."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mergeflow.errors import (
    BaseModelError,
    ConcurrentExportError,
    EventError,
    UsageError,
)
from mergeflow.events import build_checkpoint_event
from mergeflow.flows.checkpoint import resolve_checkpoint_config
from mergeflow.flows.cli import main
from mergeflow.io.confinement import Confinement
from mergeflow.io.fs import TargetLock
from mergeflow.io.paths import lock_path_for, staging_dir_for
from mergeflow.io.staging import (
    artifact_root,
    clean_staging,
    list_staging,
    staged_file_state,
    staging_id,
    target_of,
)

REPO = Path(__file__).resolve().parent.parent


def actor_dir(root: Path, run: str = "run-a", step: int = 7) -> Path:
    actor = root / run / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    return actor


def render_trigger(parameters: dict[str, object], payload: dict[str, object]) -> dict[str, object]:
    """Render trigger parameters the way the Prefect server does for a RunDeployment action."""
    import copy

    from prefect.events import Event
    from prefect.server.events.actions import RunDeployment
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    params = copy.deepcopy(parameters)
    RunDeployment._upgrade_v1_templates(params)
    event = Event(event="mergeflow.checkpoint.saved", resource={"prefect.resource.id": "mergeflow.checkpoint.x"}, payload=payload)
    return hydrate(params, HydrationContext(raise_on_error=True, render_jinja=True, jinja_context={"event": event}))


def test_trigger_passes_the_whole_payload_even_without_optional_keys(tmp_path: Path) -> None:
    from prefect.utilities.schema_tools.hydration import HydrationError

    from mergeflow.deployments.serve import TRIGGER_PARAMETERS, checkpoint_trigger

    _, payload = build_checkpoint_event(actor_dir(tmp_path))
    assert "base_model" not in payload and "target_dir" not in payload
    rendered = render_trigger(TRIGGER_PARAMETERS, payload)
    assert rendered == {"checkpoint": payload} and rendered["checkpoint"]["step"] == 7  # an int, not "7"
    # Why one parameter: a per-key template of an absent key makes Prefect drop the whole run.
    with pytest.raises(HydrationError):
        render_trigger({"base_model": "{{ event.payload.base_model }}"}, payload)
    trigger = checkpoint_trigger()
    assert trigger.expect == {"mergeflow.checkpoint.saved"} and trigger.parameters == TRIGGER_PARAMETERS
    assert trigger.match.model_dump()["prefect.resource.id"] == "mergeflow.checkpoint.*"


def confined(root: Path, target_root: str = "/exports", *bases: str) -> Confinement:
    return Confinement.of([str(root)], target_root, ["/models/base", "/b", *bases])


def test_event_payload_resolves_against_serve_defaults(tmp_path: Path) -> None:
    actor = actor_dir(tmp_path)
    _, payload = build_checkpoint_event(actor)
    config = resolve_checkpoint_config(payload, confinement=confined(tmp_path), base_model="/models/base", target_root="/exports",
                                       dtype="bfloat16", hf_upload_path="org/{run_name}-step{step}")
    assert config.local_dir == str(actor.resolve()) and config.base_model == "/models/base"
    assert config.target_dir == "/exports/run-a/global_step_7" and config.dtype == "bfloat16"
    assert config.hf_upload_path == "org/run-a-step7"
    _, named = build_checkpoint_event(actor, base_model="/other/base", target_dir="/exports/elsewhere/out", run_name="r2", step=9)
    config = resolve_checkpoint_config(named, confinement=confined(tmp_path, "/exports", "/other/base"),
                                       base_model="/models/base", target_root="/exports")
    assert (config.base_model, config.target_dir) == ("/other/base", "/exports/elsewhere/out")
    again = resolve_checkpoint_config(dict(payload, run_name="r2", step=9), confinement=confined(tmp_path, "/x"), base_model="/b", target_root="/x")
    assert again.target_dir == "/x/r2/global_step_9"


@pytest.mark.parametrize("payload,defaults,message", [
    ({}, {"base_model": "/b", "target_root": "/x"}, "no local_dir"),
    ({"local_dir": "relative/actor"}, {"base_model": "/b", "target_root": "/x"}, "absolute path"),
    ({"local_dir": "/t/run/global_step_1/actor", "run_name": "../up"}, {"base_model": "/b", "target_root": "/x"}, "plain name"),
    ({"local_dir": "/t/run/global_step_1/actor", "step": -1}, {"base_model": "/b", "target_root": "/x"}, "non-negative"),
    ({"local_dir": "/t/run/global_step_1/actor"}, {"target_root": "/x"}, "no base model"),
    ({"local_dir": "/t/run/global_step_1/actor"}, {"base_model": "/b"}, "no target"),
    ({"local_dir": "/t/run/global_step_1/actor"}, {"base_model": "/b", "target_root": "/x", "hf_upload_path": "o/{epoch}"}, "only {run_name}"),
])
def test_bad_event_payloads_are_refused(payload: dict[str, object], defaults: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("{", r"\{").replace("}", r"\}")):
        resolve_checkpoint_config(payload, confinement=confined(Path("/t"), "/x"), **defaults)  # type: ignore[arg-type]


def test_serve_refuses_without_an_api_and_with_bad_paths(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mergeflow.deployments.serve import ServeSettings, serve_deployments

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    roots = (str(tmp_path),)
    with pytest.raises(UsageError, match="target-root"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path / "absent"), checkpoint_roots=roots).checked()
    with pytest.raises(UsageError, match="base_model"):
        ServeSettings(base_model=str(tmp_path / "absent"), target_root=str(tmp_path), checkpoint_roots=roots).checked()
    with pytest.raises(UsageError, match="--checkpoint-root is required"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path)).checked()
    with pytest.raises(UsageError, match="--checkpoint-root .*absent is not a directory"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path), checkpoint_roots=(str(tmp_path / "absent"),)).checked()
    with pytest.raises(UsageError, match="--allow-base-model"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path), checkpoint_roots=roots,
                      allowed_base_models=(str(tmp_path / "absent"),)).checked()
    # merge's base checks: a transformer-only base cannot give pipeline output (the default).
    with pytest.raises(UsageError, match="--output_format pipeline needs a base pipeline"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path), checkpoint_roots=roots).checked()
    (tmp_path / "other").mkdir()
    with pytest.raises(BaseModelError, match="--allow-base-model .*other: config.json of the base"):
        ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path), checkpoint_roots=roots,
                      output_format="transformer", allowed_base_models=(str(tmp_path / "other"),)).checked()
    # The Python API has no server to choose (the command line does: tests/test_serve_startup.py).
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(EventError, match="PREFECT_API_URL"):
            serve_deployments(ServeSettings(base_model=str(tmp_path / "base"), target_root=str(tmp_path), checkpoint_roots=roots,
                                            output_format="transformer"))


def test_task_runner_choice() -> None:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from mergeflow.flows.runners import make_task_runner

    thread = make_task_runner("thread", workers=3)
    assert isinstance(thread, ThreadPoolTaskRunner) and thread._max_workers == 3
    dask = make_task_runner("dask", dask_address="tcp://10.0.0.1:8786")
    assert isinstance(dask, DaskTaskRunner) and dask.address == "tcp://10.0.0.1:8786"
    with pytest.raises(UsageError, match="needs --task-runner dask"):
        make_task_runner("thread", dask_address="tcp://10.0.0.1:8786")
    with pytest.raises(UsageError, match="thread, dask"):
        make_task_runner("ray")


def make_staging(parent: Path, target_name: str, shards: int, *, manifest: bool = False) -> Path:
    """A kept staging directory as a failed export leaves it: shard files, their records, maybe a manifest."""
    target = parent / target_name
    staging = staging_dir_for(target, "f" * 64)
    artifact = staging / "artifact"
    (staging / "work").mkdir(parents=True)
    artifact.mkdir()
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards + 1:05d}.safetensors"
        (artifact / name).write_bytes(os.urandom(1000 + i))
        (staging / "work" / f"shard-{i:05d}.json").write_text(json.dumps({"file_name": name, "size": 1000 + i}))
    (staging / "work" / f"diffusion_pytorch_model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors.partial").write_bytes(b"x" * 10)
    if manifest:
        (artifact / "merge_manifest.json").write_text("{}")
    return staging


def test_staging_list_and_clean_respect_the_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "exports" / "run-a"
    runs.mkdir(parents=True)
    first = make_staging(runs, "global_step_1", 3, manifest=True)
    second = make_staging(runs, "global_step_2", 2)
    (first / "artifact" / "diffusion_pytorch_model-00002-of-00004.safetensors").write_bytes(b"truncated")  # not resumable
    assert target_of(first) == runs / "global_step_1" and artifact_root(first) == first / "artifact"
    assert artifact_root(runs) == runs

    assert main(["staging", "list", str(tmp_path)]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["staging"]
    assert [(e["target"], e["resumable_shards"], e["has_manifest"], e["locked"]) for e in listed] == [
        (str(runs / "global_step_1"), 2, True, False), (str(runs / "global_step_2"), 2, False, False)]
    assert listed[0]["size_bytes"] >= 2000 and listed[0]["age_seconds"] >= 0

    assert clean_staging(tmp_path, older_than=3600) == {"removed": [], "refused": [], "kept": [str(first), str(second)]}
    with TargetLock(lock_path_for(runs / "global_step_1")):  # an export of step 1 is running
        assert [i.locked for i in list_staging(tmp_path)] == [True, False]
        assert main(["staging", "clean", str(tmp_path)]) == 2
        assert "running export holds" in capsys.readouterr().err
        assert first.is_dir() and not second.exists()
    assert main(["staging", "clean", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["removed"] == [str(first)]
    assert list_staging(tmp_path) == [] and sorted(p.name for p in runs.iterdir()) == []


def test_a_killed_holders_lock_file_does_not_block(tmp_path: Path) -> None:
    lock = tmp_path / ".out.mergeflow.lock"
    lock.write_text("4194304\n")  # left by a SIGKILLed export: the file stays, the kernel dropped its flock
    with TargetLock(lock):
        assert lock.read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConcurrentExportError):
            TargetLock(lock).acquire()
    assert not lock.exists()


def test_staged_file_state_and_staging_id(tmp_path: Path) -> None:
    from mergeflow.io.staging import file_stamp

    staging = tmp_path / ".out.mergeflow-staging-0123"
    final, record = staging / "artifact" / "shard.safetensors", staging / "work" / "shard-00000.json"
    first = staging_id(staging)
    assert staging_id(staging) == first and len(first) == 32
    assert staged_file_state(final, record) == "intact"  # nothing written yet
    final.parent.mkdir(parents=True)
    final.write_bytes(b"abc")
    assert staged_file_state(final, record).startswith("changed")  # written, but never recorded
    record.write_text(json.dumps({"stamp": file_stamp(final)}))
    assert staged_file_state(final, record) == "intact"
    time.sleep(0.01)
    final.write_bytes(b"abd")
    assert staged_file_state(final, record).startswith("changed")
    final.unlink()
    assert staged_file_state(final, record).startswith("changed")  # recorded, then deleted
    import shutil

    shutil.rmtree(staging)
    assert staging_id(staging) != first  # a recreated staging dir never matches old cache entries


def test_verl_tracker_holds_back_a_step_it_has_not_marked_saved(tmp_path: Path) -> None:
    from mergeflow.ops.watch import inspect_checkpoint

    actor = actor_dir(tmp_path, "run", 20)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    (actor / "huggingface").mkdir()
    (actor / "huggingface" / "config.json").write_text("{}")
    assert inspect_checkpoint(actor).ready  # no tracker: the file set decides
    tracker = tmp_path / "run" / "latest_checkpointed_iteration.txt"
    tracker.write_text("10")
    snapshot = inspect_checkpoint(actor)
    assert not snapshot.ready and not snapshot.fault and "step 20" in snapshot.reason
    tracker.write_text("20")
    assert inspect_checkpoint(actor).ready


def test_prefect_yaml_entrypoints_and_trigger_match_the_served_ones() -> None:
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    from mergeflow.deployments.serve import (
        BACKFILL_DEPLOYMENT,
        MERGE_DEPLOYMENT,
        SMOKE_DEPLOYMENT,
        TRIGGER_NAME,
        TRIGGER_PARAMETERS,
        VALIDATE_DEPLOYMENT,
        served_names,
    )

    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {MERGE_DEPLOYMENT, VALIDATE_DEPLOYMENT, BACKFILL_DEPLOYMENT, SMOKE_DEPLOYMENT}
    # The engine started directly, not through Prefect's workspace supervisor (docs/operations.md section 4).
    assert {d["work_pool"]["job_variables"]["command"] for d in deployments.values()} == {"python -m prefect.engine"}
    merge, validate, backfill, smoke = (load_flow_from_entrypoint(deployments[name]["entrypoint"], use_placeholder_flow=False)
                                        for name in (MERGE_DEPLOYMENT, VALIDATE_DEPLOYMENT, BACKFILL_DEPLOYMENT, SMOKE_DEPLOYMENT))
    assert (merge.name, validate.name, backfill.name, smoke.name) == (
        "mergeflow-merge-checkpoint", "mergeflow-validate", "mergeflow-backfill", "mergeflow-smoke")
    assert [f"{f.name}/{name}" for f, name in ((merge, MERGE_DEPLOYMENT), (validate, VALIDATE_DEPLOYMENT),
                                               (backfill, BACKFILL_DEPLOYMENT), (smoke, SMOKE_DEPLOYMENT))] == served_names()
    assert set(deployments[SMOKE_DEPLOYMENT].get("parameters") or {}) <= set(smoke.parameters.properties)
    assert set(deployments[BACKFILL_DEPLOYMENT]["parameters"]) <= set(backfill.parameters.properties)
    assert not deployments[BACKFILL_DEPLOYMENT].get("triggers")  # run on demand only
    assert set(deployments[MERGE_DEPLOYMENT]["parameters"]) <= set(merge.parameters.properties)
    (trigger,) = deployments[MERGE_DEPLOYMENT]["triggers"]
    assert trigger["name"] == TRIGGER_NAME and trigger["parameters"] == TRIGGER_PARAMETERS
    assert trigger["expect"] == ["mergeflow.checkpoint.saved"] and trigger["match"] == {"prefect.resource.id": "mergeflow.checkpoint.*"}


def test_every_task_is_cached_by_file_stamps_or_not_at_all() -> None:
    """Prefect's default cache policy hashes all inputs on every call: seconds for a big plan."""
    import importlib
    import pkgutil

    from prefect import Task
    from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy

    import mergeflow.tasks

    found = {}
    for info in pkgutil.iter_modules(mergeflow.tasks.__path__):
        module = importlib.import_module(f"mergeflow.tasks.{info.name}")
        found.update({f"{info.name}.{k}": v for k, v in vars(module).items() if isinstance(v, Task) and v.__module__ == module.__name__})
    small_inputs = {"upload.upload_to_hub", "upload.verify_hub_upload", "validate.validate_artifact_task"}  # paths and names only
    cached = {name for name, t in found.items() if isinstance(t.cache_policy, CacheKeyFnPolicy)}
    assert {"load.load_rank_shards", "write.write_shard"} <= cached
    offenders = [n for n, t in found.items() if n not in cached | small_inputs and t.cache_policy is not NO_CACHE]
    assert not offenders, offenders
