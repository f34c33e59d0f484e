"""Resume: a failed or killed merge keeps its staging; a retry or rerun reuses finished shards (Cached)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import syscall_faults
from builders import Export, assert_bit_exact, clone_export, output_state, tree_digest
from prefect_runs import flow_run_logs, latest_flow_run, shard_states, task_runs

from mergeflow import merge_model, validate_artifact
from mergeflow.errors import ArtifactInvalidError
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.runners import make_task_runner
from mergeflow.io.staging import list_staging

TESTS = Path(__file__).parent
SHARD = 60_000  # the tiny Flux (~270 KB) splits into several shards
# Each test merges its own copy of the session's W=2 Flux checkpoint (conftest.pristine_flux_w2, builders.clone_export).


def corrupt_one_shard_before_validation(monkeypatch: pytest.MonkeyPatch, index: int) -> list[Path]:
    """Flip one byte of the index-th staged shard after it was written and verified, just before validation.

    Validation is handed the writer's proven digests; the changed file must be hashed anyway.
    """
    import mergeflow.tasks.validate as validate_module

    original = validate_module.validate_staged
    hit: list[Path] = []

    def corrupting(plan: Any, manifest: dict[str, Any], verified: Any = None) -> Any:
        path = sorted(Path(plan.output.tensor_dir).glob("*.safetensors"))[index]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        hit.append(path)
        assert verified and any(name.endswith(path.name) for name in verified)
        return original(plan, manifest, verified)

    monkeypatch.setattr(validate_module, "validate_staged", corrupting)
    return hit


def failing_merge(config: Any) -> tuple[Any, Any]:
    state = merge_flow.with_options(task_runner=make_task_runner(workers=2))(config=config, return_state=True)
    assert state.is_failed(), state
    return state, state.state_details.flow_run_id


def shard_names(target: Path) -> list[str]:
    return sorted(p.name for p in target.glob("*.safetensors"))


def test_failed_validation_keeps_staging_and_a_fresh_run_reuses_shards(tmp_path: Path, prefect_events_api: Any,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    reference = Path(merge_model(ex.config(tmp_path / "reference", max_shard_size=SHARD)).output_dir)
    names = shard_names(reference)
    assert len(names) >= 4
    bad = names[1]  # write-shard-00001

    target = tmp_path / "exports" / "step1"
    target.parent.mkdir()
    config = ex.config(target, max_shard_size=SHARD)
    hit = corrupt_one_shard_before_validation(monkeypatch, 1)
    state, first_id = failing_merge(config)
    assert [p.name for p in hit] == [bad] and not target.exists()
    with pytest.raises(ArtifactInvalidError):
        state.result()
    staged = list_staging(tmp_path / "exports")
    assert len(staged) == 1 and staged[0].target == str(target) and not staged[0].locked
    assert staged[0].resumable_shards == len(names) and staged[0].has_manifest

    # The validate flow runs alone on the kept staging directory and names the damaged shard.
    with pytest.raises(ArtifactInvalidError, match=bad.replace(".", r"\.")):
        validate_artifact(staged[0].path)

    monkeypatch.undo()  # the cause is gone
    fresh = merge_model(config)
    second_id = latest_flow_run("merge-ckpt-step1").id
    assert second_id != first_id
    runs = task_runs(second_id, lambda r: len(shard_states(r)) == len(names))
    states = shard_states(runs)
    assert states.pop(f"write-shard-{names.index(bad):05d}") == "Completed"  # rewritten: its stamp changed
    assert set(states.values()) == {"Cached"}, states
    # The run's log (the UI) says that it resumed, and how much it reused.
    said = f"Resumed the staging an earlier run kept: reused {len(names) - 1} of {len(names)} shards"
    assert said in flow_run_logs(second_id, said), said
    out = Path(fresh.output_dir)
    assert tree_digest(out) == tree_digest(reference)
    assert_bit_exact(ex.actor.state_dict(), output_state(out))
    assert list_staging(tmp_path / "exports") == []
    assert validate_artifact(out)["integrity"] == "passed"


def test_retry_of_the_same_flow_run_reuses_shards(tmp_path: Path, prefect_events_api: Any, monkeypatch: pytest.MonkeyPatch,
                                                  pristine_flux_w2: Export) -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH

    ex = clone_export(pristine_flux_w2, tmp_path)
    target = tmp_path / "retried"
    config = ex.config(target, max_shard_size=SHARD)
    hit = corrupt_one_shard_before_validation(monkeypatch, 1)
    _, flow_run_id = failing_merge(config)
    monkeypatch.undo()
    count = len(list(hit[0].parent.glob("*.safetensors")))
    assert count >= 4

    # Exactly what a user types; it needs this process's result storage to find the cached shards.
    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()),
               PREFECT_LOCAL_STORAGE_PATH=str(PREFECT_LOCAL_STORAGE_PATH.value()))
    retry = subprocess.run(
        [sys.executable, "-m", "prefect", "flow-run", "retry", str(flow_run_id), "--entrypoint", "mergeflow.flows.merge.merge_flow"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert (target / "merge_manifest.json").is_file()
    runs = task_runs(flow_run_id, lambda r: len(shard_states(r, attempt=2)) == count)
    first, second = shard_states(runs, attempt=1), shard_states(runs, attempt=2)
    assert set(first.values()) == {"Completed"} and len(first) == count
    assert second.pop("write-shard-00001") == "Completed"
    assert set(second.values()) == {"Cached"}, second
    assert_bit_exact(ex.actor.state_dict(), output_state(target))
    assert validate_artifact(target)["integrity"] == "passed"


def _merge_args(ex: Any, target: Path) -> list[str]:
    return ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
            "--target_dir", str(target), "--output_format", "transformer", "--max_shard_size", str(SHARD), "--workers", "1"]


def test_merge_killed_mid_write_resumes_byte_identical(tmp_path: Path, prefect_events_server: Any, prefect_events_api: Any,
                                                       pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    reference = Path(merge_model(ex.config(tmp_path / "reference", max_shard_size=SHARD)).output_dir)
    target = tmp_path / "killed"
    env = prefect_events_server.client_env()  # it records task runs; commands with its environment start cold
    proc = forked_cli.popen([str(TESTS / "slow_cli.py"), "0.1", *_merge_args(ex, target)], env)
    deadline = time.monotonic() + 120
    records: list[Path] = []
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            records = list(tmp_path.glob(".killed.mergeflow-staging-*/work/shard-*.json"))
            if records and list(tmp_path.glob(".killed.mergeflow-staging-*/work/*.partial")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"finished before it could be killed: {proc.communicate()[1][-2000:]!r}"
        assert records, "no shard was finished within the time limit"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # One writer thread: every shard recorded before a later .partial appeared finished as a task.
    finished = len(records)
    assert not target.exists() and (tmp_path / ".killed.mergeflow.lock").exists()
    staged = list_staging(tmp_path)
    assert [s.target for s in staged] == [str(target)] and not staged[0].locked
    assert 1 <= staged[0].resumable_shards < len(shard_names(reference))

    rerun = forked_cli.mergeflow(_merge_args(ex, target), env, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["output_dir"] == str(target)
    assert tree_digest(target) == tree_digest(reference)  # staging and target names differ, bytes do not
    assert list_staging(tmp_path) == [] and not (tmp_path / ".killed.mergeflow.lock").exists()
    resumed = latest_flow_run("merge-ckpt-step1")
    states = shard_states(task_runs(resumed.id, lambda r: len(shard_states(r)) == len(shard_names(reference))))
    assert list(states.values()).count("Cached") >= finished, states
    # It says so, on stderr and in the run's log, with the count of the shards it did not write again.
    reused = list(states.values()).count("Cached")
    said = f"resumed the staging an earlier run kept: reused {reused} of {len(shard_names(reference))} shards"
    assert f"mergeflow: {said}\n" in rerun.stderr, rerun.stderr[-3000:]
    assert said[0].upper() + said[1:] in flow_run_logs(resumed.id, said[1:])


def test_dask_local_cluster_gives_a_byte_identical_artifact(tmp_path: Path, prefect_events_api: Any,
                                                            pristine_flux_w2: Export) -> None:
    import dask
    from distributed import LocalCluster

    ex = clone_export(pristine_flux_w2, tmp_path)
    threaded = Path(merge_model(ex.config(tmp_path / "threads", max_shard_size=SHARD)).output_dir)
    # Each Nanny writes its workers' environment into this process's os.environ before spawning them
    # (OMP_NUM_THREADS=1, PYTHONHASHSEED, __DASK_PARENT_PID, ...) and never restores it: left there, every
    # later command of this session would run with it, and none could be forked (tests/forked_cli.py).
    environ = dict(os.environ)
    try:
        # The scheduler (in this process) and the workers keep their scratch space here: by default a
        # dask-scratch-space was left in /tmp by every suite run.
        with dask.config.set({"temporary-directory": str(tmp_path / "dask-scratch")}), \
                LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
            result = merge_model(ex.config(tmp_path / "dask", max_shard_size=SHARD), task_runner="dask",
                                 dask_address=cluster.scheduler_address)
            with cluster.get_client() as client:
                # Only a task that ran in a worker process makes it import the shard writer.
                ran_there = client.run(lambda: __import__("sys").modules.get("mergeflow.export.write.shard_writer") is not None)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert len(ran_there) == 2 and any(ran_there.values())
    out = Path(result.output_dir)
    assert tree_digest(out) == tree_digest(threaded)
    assert validate_artifact(out)["integrity"] == "passed"
    run = latest_flow_run("merge-ckpt-step1")
    states = shard_states(task_runs(run.id, lambda r: len(shard_states(r)) == len(shard_names(out))))
    assert len(states) == len(shard_names(out)) and set(states.values()) == {"Completed"}


def _staged_shards(parent: Path, name: str) -> dict[str, tuple[int, int]]:
    """Staged shard file -> (inode, mtime_ns): a resume renames them into the target, a rewrite makes new ones."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in parent.glob(f".{name}.mergeflow-staging-*/artifact/**/*.safetensors")}


def test_a_rerun_from_another_cwd_with_other_spellings_resumes(tmp_path: Path, prefect_server: Any, prefect_api: Any,
                                                                pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path / "site")
    target = tmp_path / "site" / "out"
    env = prefect_server.client_env()
    killed = syscall_faults.mergeflow(["--kill-at-write", "1:merge_manifest"], _merge_args(ex, target), env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    staged = _staged_shards(target.parent, "out")
    assert len(staged) >= 2
    # The same export spelled otherwise: relative to another cwd, with '..', through a symlinked parent.
    (tmp_path / "alias").symlink_to(tmp_path / "site", target_is_directory=True)
    cwd = tmp_path / "elsewhere" / "deep"
    cwd.mkdir(parents=True)
    args = ["merge", "--backend", "fsdp", "--local_dir", os.path.relpath(ex.actor_dir, cwd),
            "--base_model", "../../alias/../alias/" + str(ex.base_dir.relative_to(tmp_path / "site")),
            "--target_dir", "../../alias/out", "--output_format", "transformer", "--max_shard_size", str(SHARD),
            "--workers", "1"]
    rerun = forked_cli.run(["-m", "mergeflow", *args], env, cwd=cwd, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    published = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in target.glob("*.safetensors")}
    assert published == staged, "the rerun rewrote shards instead of resuming the staged ones"
    assert list_staging(target.parent) == [] and not (target.parent / ".out.mergeflow.lock").exists()
    print(f"reliability: a rerun with other path spellings reused {len(staged)} of {len(published)} shards")


def test_an_orphaned_staging_dir_is_named(tmp_path: Path, prefect_server: Any, prefect_api: Any,
                                          pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    target = tmp_path / "out"
    orphan = tmp_path / ".out.mergeflow-staging-00000000deadbeef"  # an older key's staging of the same target
    (orphan / "artifact").mkdir(parents=True)
    (orphan / "artifact" / "config.json").write_text("{}\n")
    env = prefect_server.client_env()
    listed = forked_cli.mergeflow(["staging", "list", str(tmp_path)], env)
    assert listed.returncode == 0, listed.stderr
    assert [s["orphaned"] for s in json.loads(listed.stdout)["staging"]] == [""]  # the only one: a rerun may resume it
    first = forked_cli.mergeflow(_merge_args(ex, target), env, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert str(orphan) in first.stderr, "the export did not name the staging dir it does not resume"
    again = forked_cli.mergeflow(_merge_args(ex, target), env)
    assert again.returncode == 2 and "already exists" in again.stderr and str(orphan) in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    listed = forked_cli.mergeflow(["staging", "list", str(tmp_path)], env)
    (info,) = json.loads(listed.stdout)["staging"]
    assert info["path"] == str(orphan) and info["orphaned"] == f"its target {target} exists"
