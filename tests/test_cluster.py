"""Past one machine, for real: PostgreSQL, a Prefect server on it, a work pool of two workers, a Dask cluster.

One cluster for the module (tests/cluster.py starts every part on 127.0.0.1 and kills it by PID,
however the module ends). The two Prefect workers are two "machines": each has its own
PREFECT_HOME and shares only the filesystem and the server with the other; the Dask workers
likewise. Tiny real Flux checkpoints (W=2 FSDP ranks), exported as the transformer in 64 KiB
shards so that one export writes several shards and can be killed between them.
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import yaml
from builders import tree_digest
from cluster import REPO, TESTS, Cluster, Timer, postgres_bindir
from prefect_server import PrefectServer

pytestmark = pytest.mark.skipif(postgres_bindir() is None,
                                reason="no PostgreSQL binaries (Debian's postgresql package: initdb, pg_ctl)")

CLASS = "FluxTransformer2DModel"
SHARD = 64 * 1024  # ~5 shards per export of the tiny Flux transformer (272 KB)
STEPS = (1, 2, 3, 4)
MERGE = "mergeflow-merge-checkpoint/on-checkpoint"
SLOW = "slow-"  # exports whose target path holds this write each tensor 0.05 s slower (tests/slow_site)
# One run at a time per worker ("machine"): the fan-out's runs must spread over both. The pool's and the
# deployment's limits leave room for those two and for a run whose worker died (it holds its slots until
# it is Crashed): 3 runs at most, at any moment, of all the test starts.
WORKER_LIMIT = 1
DEPLOYMENT_LIMIT = 3
POOL_LIMIT = 3
HEARTBEAT_S = 30  # Prefect's minimum
ZOMBIE_WITHIN_S = 35  # a killed run is Crashed this long after its last heartbeat (deployments/zombie-runs.yaml)


@dataclass
class Site:
    cluster: Cluster
    base: Path
    checkpoints: Path  # the deployment's checkpoint root
    targets: Path  # its target root
    expected: dict[int, dict[str, str]]  # step -> tree digest of an in-process merge_model of that step
    timer: Timer
    results: Path  # PREFECT_LOCAL_STORAGE_PATH of every worker and Dask worker
    renamed: dict[str, dict[str, str]]  # run name -> tree digest of its one step, exported in-process


def _training_run(root: Path) -> Path:
    from mergeflow.demo.checkpoints import (
        build_transformer,
        perturb_,
        save_base_transformer,
        save_fsdp_checkpoint,
    )

    base = build_transformer(CLASS, seed=0)
    save_base_transformer(base, root / "base")
    for step in STEPS:
        actor = copy.deepcopy(base)
        perturb_(actor, seed=step)
        save_fsdp_checkpoint(actor, root / "checkpoints" / "run-a" / f"global_step_{step}" / "actor", 2)
    return root / "base"


def _expected(base: Path, train: Path, out: Path, steps: tuple[int, ...] = STEPS) -> dict[int, dict[str, str]]:
    from mergeflow import merge_model
    from mergeflow.config import ModelMergerConfig

    out.mkdir()
    digests = {}
    for step in steps:
        target = out / f"global_step_{step}"
        merge_model(ModelMergerConfig(local_dir=str(train / f"global_step_{step}" / "actor"), base_model=str(base),
                                      target_dir=str(target), output_format="transformer", max_shard_size=SHARD))
        digests[step] = tree_digest(target)
    return digests


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, prefect_server: PrefectServer) -> Iterator[Site]:
    timer = Timer()
    root = tmp_path_factory.mktemp("cluster")
    with Cluster(root / "cluster") as cluster:
        slow_site = str(TESTS / "slow_site")
        cluster.env_extra = {
            "PYTHONPATH": os.pathsep.join(p for p in (slow_site, os.environ.get("PYTHONPATH", "")) if p),
            "MERGEFLOW_TEST_SLOW_TENSOR_S": "0.05", "MERGEFLOW_TEST_SLOW_WITHIN": SLOW,
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
            # Shared result storage: every worker and Dask worker persists results to the same place.
            "PREFECT_LOCAL_STORAGE_PATH": str(root / "prefect-results"),
            # Workers look for scheduled runs every second (Prefect's default: 10 s), as a test can't wait.
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "HF_HUB_OFFLINE": "1", "MERGEFLOW_LOCAL_SERVER": "0",
            "MERGEFLOW_CACHE_DIR": str(root / "mergeflow-cache"),
        }
        cluster.start_postgres()
        server = cluster.spawn_server()  # the server and Dask start while the checkpoints are built
        cluster.spawn_dask(workers=2)
        base = _training_run(root)
        with prefect_server.activated():
            expected = _expected(base, root / "checkpoints" / "run-a", root / "expected")
            # The killed exports' steps under their own run names (the model card names the run).
            renamed = {}
            for name, step in ((f"{SLOW}a", 3), (f"{SLOW}b", 2)):
                copy = root / "renamed" / name
                shutil.copytree(root / "checkpoints" / "run-a" / f"global_step_{step}", copy / f"global_step_{step}")
                renamed[name] = _expected(base, copy, root / f"expected-{name}", (step,))[step]
        cluster.wait_server(server)
        targets = root / "targets"
        targets.mkdir()
        _create_pool_and_automation(cluster)
        workers = [cluster.spawn_worker(name, limit=WORKER_LIMIT) for name in ("machine-a", "machine-b")]
        env = {**cluster.client_env(), "MERGEFLOW_BASE_MODEL": str(base), "MERGEFLOW_TARGET_ROOT": str(targets),
               "MERGEFLOW_CHECKPOINT_ROOT": str(root / "checkpoints")}
        cluster.prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(REPO / "deployments" / "prefect.yaml"),
                        env=env)
        _limit_deployment(cluster, MERGE, DEPLOYMENT_LIMIT)
        for worker in workers:
            cluster.wait_worker(worker)
        cluster.wait_dask(2)
        try:
            yield Site(cluster, base, root / "checkpoints", targets, expected, timer, root / "prefect-results", renamed)
        finally:
            cluster.drain()
            print(f"cluster tests done after {timer()} s")


def _create_pool_and_automation(cluster: Cluster) -> None:
    """The process pool with its concurrency limit, and deployments/zombie-runs.yaml's automation (a shorter
    `within`, for the test), as `prefect work-pool create` and `prefect automation create` would make them."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.events.schemas.automations import AutomationCore

    automation = yaml.safe_load((REPO / "deployments" / "zombie-runs.yaml").read_text())["automations"][0]
    automation["trigger"]["within"] = ZOMBIE_WITHIN_S

    async def create() -> None:
        async with cluster.client() as client:
            await client.create_work_pool(WorkPoolCreate(name="mergeflow", type="process", concurrency_limit=POOL_LIMIT))
            await client.create_automation(AutomationCore.model_validate(automation))

    asyncio.run(create())


def _limit_deployment(cluster: Cluster, name: str, limit: int) -> None:
    from prefect.client.schemas.actions import DeploymentUpdate

    async def update() -> None:
        async with cluster.client() as client:
            deployment = await client.read_deployment_by_name(name)
            await client.update_deployment(deployment.id, DeploymentUpdate(concurrency_limit=limit))

    asyncio.run(update())


def _limit_pool(cluster: Cluster, limit: int) -> None:
    from prefect.client.schemas.actions import WorkPoolUpdate

    async def update() -> None:
        async with cluster.client() as client:
            await client.update_work_pool("mergeflow", WorkPoolUpdate(concurrency_limit=limit))

    asyncio.run(update())


def _state_names(cluster: Cluster, run_id: UUID) -> list[str]:
    """Every state a flow run has been in, oldest first."""
    async def read() -> list[str]:
        async with cluster.client() as client:
            return [state.name for state in await client.read_flow_run_states(run_id)]

    return asyncio.run(read())


def _backfill_command(site: Site, train: Path) -> subprocess.Popen[str]:
    """`mergeflow backfill --deployment` as a user types it on a machine of its own, started, not waited for. The
    base is named relative to its working directory: the runs on the workers must get it absolute."""
    return subprocess.Popen(
        [sys.executable, "-m", "mergeflow", "backfill", str(train), "--base_model",
         os.path.relpath(site.base, site.cluster.root), "--target-root",
         str(site.targets), "--output_format", "transformer", "--stable-seconds", "0", "--max-shard-size", str(SHARD),
         "--deployment"],
        env=site.cluster.client_env(site.cluster.root / "cli-home"), cwd=site.cluster.root, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _in_thread(cluster: Cluster, fn: Callable[[], Any]) -> Future[Any]:
    """`fn` in a thread of its own, against the cluster's server (a backfill waits there for its step runs)."""
    def run() -> Any:
        with cluster.activated():
            return fn()

    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def _backfill(site: Site, train: Path, task_runner: str = "dask") -> Any:
    from mergeflow.flows.backfill_flow import backfill_flow

    return backfill_flow(train_dir=str(train), base_model=str(site.base), target_root=str(site.targets),
                         output_format="transformer", stable_seconds=0, max_shard_size=SHARD, workers=2,
                         task_runner=task_runner, dask_address=site.cluster.dask_address if task_runner == "dask" else None,
                         deployment=MERGE)


def _runs(cluster: Cluster) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def read() -> list[Any]:
        async with cluster.client() as client:
            return await client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-checkpoint"])))

    return asyncio.run(read())


def _run_target(run: Any) -> str:
    return str(run.parameters["checkpoint"]["target_dir"])


def _worker_of_runs(cluster: Cluster) -> dict[UUID, str]:
    """flow run id -> the worker that submitted it, from the workers' `prefect.worker.submitted-flow-run` events
    (what the run's page in the UI shows as its worker)."""
    async def read() -> dict[UUID, str]:
        async with cluster.client() as client:
            response = await client._client.post("/events/filter", json={
                "filter": {"event": {"name": ["prefect.worker.submitted-flow-run"]}, "order": "ASC"}, "limit": 50})
            response.raise_for_status()
            found = {}
            for event in response.json()["events"]:
                worker = event["resource"].get("prefect.worker.name") or event["resource"]["prefect.resource.name"]
                for related in event["related"]:
                    if related["prefect.resource.role"] == "flow-run":
                        found[UUID(related["prefect.resource.id"].rsplit(".", 1)[1])] = worker
            return found

    return asyncio.run(read())


def _max_overlap(runs: list[Any]) -> int:
    """The most runs that were Running at one moment, from their records' start and end times."""
    edges = sorted([(r.start_time, 1) for r in runs] + [(r.end_time, -1) for r in runs], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, delta in edges:
        now += delta
        most = max(most, now)
    return most


def _held_back(pair: list[Any], slack_s: float = 0.0) -> None:
    """Two runs that ran one after the other although the second was dispatched while the first still ran:
    something held it back (a limit, as both workers were free), not the order they happened to come in.
    `slack_s`: how long before the first run's Completed timestamp the second may enter Running."""
    assert len(pair) == 2, [r.name for r in pair]
    first, second = sorted(pair, key=lambda r: r.start_time)
    facts = {r.name: (r.expected_start_time, r.start_time, r.end_time) for r in pair}
    assert second.expected_start_time < first.end_time, facts
    assert (first.end_time - second.start_time).total_seconds() <= slack_s, facts


def _wait(what: str, predicate: Callable[[], Any], timeout: float, cluster: Cluster) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{cluster.tails()}")


def _writer_of_shard(under: Path) -> int | None:
    """The pid of the process that holds a shard's temporary file below `under` open for writing, once a shard
    before it is done (the moment to kill: one shard to reuse, one half-written)."""
    finished = [p for p in under.glob(".*mergeflow-staging-*/**/*.safetensors") if p.is_file()]
    if not finished:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.endswith(".safetensors.partial") and target.startswith(str(under)):
                return int(pid)
    return None


def _no_staging_left(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".mergeflow-staging-" in p.name or p.name.endswith(".partial")]


def _clone_steps(site: Site, name: str, steps: tuple[int, ...]) -> Path:
    train = site.checkpoints / name
    for step in steps:
        shutil.copytree(site.checkpoints / "run-a" / f"global_step_{step}", train / f"global_step_{step}")
    return train


def test_cluster_fan_out_worker_deaths_and_limits(site: Site) -> None:
    cluster, targets = site.cluster, site.targets
    print(f"cluster up after {site.timer()} s")

    # -- A worker dies: machine-a, with its flow-run process, in the middle of writing a shard. First, so that
    # Prefect's wait for the missing heartbeats runs while the rest of the test does.
    train_a = _clone_steps(site, f"{SLOW}a", (3,))
    target_a = targets / f"{SLOW}a" / "global_step_3"
    first_a = _in_thread(cluster, lambda: _backfill(site, train_a, task_runner="thread"))
    writer = _wait("a shard being written by a flow-run process", lambda: _writer_of_shard(targets / f"{SLOW}a"),
                   90, cluster)
    victim = cluster.part_of_pid(writer)
    assert victim in ("machine-a", "machine-b"), victim
    # The flow run's process is Prefect's engine, started by the worker itself (deployments/prefect.yaml's
    # command), in the worker's process group; Prefect's workspace supervisor starts it in a session of its own.
    assert os.getpgid(writer) == cluster.part(victim).pgid, "the flow run went through Prefect's workspace supervisor"
    cluster.kill_with_descendants(victim)  # the worker and its flow-run process, as a machine dies
    killed_at = time.monotonic()
    # SIGKILL is delivered asynchronously: the writer's open file goes once the kernel has ended the process.
    _wait("the killed writer's file to close", lambda: _writer_of_shard(targets / f"{SLOW}a") is None, 30, cluster)
    assert not target_a.exists()
    restarted = cluster.spawn_worker(victim, limit=WORKER_LIMIT)  # the machine comes back

    # -- Fan-out: 4 checkpoints, one flow run each, over both workers; their shards on both Dask workers.
    cluster.wait_worker(restarted)
    started = time.monotonic()
    summary = _in_thread(cluster, lambda: _backfill(site, site.checkpoints / "run-a")).result(timeout=240)
    fan_out_s = round(time.monotonic() - started, 1)
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [(step, "done") for step in STEPS]
    for step in STEPS:
        assert tree_digest(targets / "run-a" / f"global_step_{step}") == site.expected[step], step
    fanned = [r for r in _runs(cluster) if "/run-a/" in _run_target(r)]
    assert len(fanned) == 4 and {r.state.name for r in fanned} == {"Completed"}
    assert sorted(_run_target(r) for r in fanned) == sorted(str(targets / "run-a" / f"global_step_{s}") for s in STEPS)
    assert {r.name for r in fanned} == {f"checkpoint-run-a-step{s}" for s in STEPS}
    assert all(r.parent_task_run_id is not None for r in fanned)  # subflows of the backfill run: listed under it
    by_worker = _wait("the workers' submitted-flow-run events",
                      lambda: (w := _worker_of_runs(cluster)) and all(r.id in w for r in fanned) and w, 30, cluster)
    assert {by_worker[r.id] for r in fanned} == {"machine-a", "machine-b"}, by_worker
    assert _max_overlap(fanned) == 2  # one per worker, both at once
    # The shard tasks ran on both Dask workers (each worker's own log of the tasks it finished).
    ran = cluster.dask_keys_run()
    assert {name for name, keys in ran.items() if any(key.startswith("write_shard-") for key in keys)} == \
        {"dask-worker-0", "dask-worker-1"}, ran
    # Their results went to the one shared result storage, not to each machine's own PREFECT_HOME.
    assert any(p.is_file() for p in site.results.rglob("*"))
    assert not any(p.is_file() for name in ("machine-a", "machine-b", "dask-worker-0", "dask-worker-1")
                   for p in (cluster.root / f"{name}-home" / "storage").rglob("*"))
    print(f"fan-out of 4 checkpoints: {fan_out_s} s")
    for run in sorted(fanned, key=lambda r: r.start_time):  # where the time went, when a slow machine needs a look
        print(f"  {run.name} on {by_worker[run.id]}: waited {(run.start_time - run.expected_start_time).total_seconds():.1f} s,"
              f" ran {run.total_run_time.total_seconds():.1f} s")

    # -- A Dask worker dies in the middle of writing a shard of another export.
    train_b = _clone_steps(site, f"{SLOW}b", (2,))
    target_b = targets / f"{SLOW}b" / "global_step_2"
    first_b = _in_thread(cluster, lambda: _backfill(site, train_b, task_runner="dask"))
    dask_writer = _wait("a shard being written by a Dask worker", lambda: _writer_of_shard(targets / f"{SLOW}b"),
                        90, cluster)
    dask_worker = cluster.part_of_pid(dask_writer)
    assert dask_worker.startswith("dask-worker-"), dask_worker
    cluster.kill_with_descendants(dask_worker)
    # Dask reruns the lost worker's tasks on the other one: the run completes, the shards are idempotent.
    summary_b = first_b.result(timeout=120)
    assert [(s["step"], s["status"]) for s in summary_b["steps"]] == [(2, "done")]
    assert tree_digest(target_b) == site.renamed[f"{SLOW}b"]

    # -- The run that died with its worker is Crashed by the heartbeat automation; its backfill ends failed.
    with pytest.raises(Exception, match="1 of 1 step runs did not complete .*Crashed"):
        first_a.result(timeout=ZOMBIE_WITHIN_S + 60)
    crash_wait_s = round(time.monotonic() - killed_at, 1)
    assert not target_a.exists() and len(list(target_a.parent.glob(".global_step_3.mergeflow-staging-*"))) == 1

    # Backfill again, as a user does (`mergeflow backfill --deployment`): the step runs on a live worker and
    # resumes the staging, to the same bytes. Beside it another run's step, with the pool's limit at 1: both
    # workers are free, so only the pool's limit keeps the two runs from running at once.
    inode_b = target_b.stat().st_ino
    _limit_pool(cluster, 1)
    resume = _backfill_command(site, train_a)
    _wait("the command's step run", lambda: any(_run_target(r) == str(target_a) and r.state.name != "Crashed"
                                                 for r in _runs(cluster)), 90, cluster)
    summary_c = _in_thread(cluster, lambda: _backfill(site, _clone_steps(site, "run-c", (1,)), task_runner="thread"))
    out, err = resume.communicate(timeout=180)
    assert resume.returncode == 0, err[-3000:]
    assert [line for line in out.splitlines() if line.startswith("global_step_")] == [
        f"global_step_3: done (resumed) -> {target_a}"], out
    assert tree_digest(target_a) == site.renamed[f"{SLOW}a"]
    assert [(s["step"], s["status"]) for s in summary_c.result(timeout=120)["steps"]] == [(1, "done")]
    paced = [r for r in _runs(cluster) if _run_target(r) in (str(target_a), str(targets / "run-c" / "global_step_1"))
             and r.state.name == "Completed"]
    # The pool's limit is applied when a worker polls (slots = limit - runs Pending or Running), not through
    # a lease as the deployment's is: on a loaded machine the second run once entered Running 0.45 s before
    # the first one's Completed timestamp. Without the limit the two overlap for most of a run (3.7 s).
    _held_back(paced, slack_s=1.0)
    # The deployment's limit at 1, the pool's back at 3: two steps of one backfill, again one at a time, the
    # second held in AwaitingConcurrencySlot (the deployment's own limit, not the pool's) until the first ends.
    _limit_pool(cluster, POOL_LIMIT)
    _limit_deployment(cluster, MERGE, 1)
    summary_d = _in_thread(cluster, lambda: _backfill(site, _clone_steps(site, "run-d", (1, 2)), task_runner="thread"))
    assert [(s["step"], s["status"]) for s in summary_d.result(timeout=180)["steps"]] == [(1, "done"), (2, "done")]
    held = [r for r in _runs(cluster) if "/run-d/" in _run_target(r)]
    _held_back(held)
    assert any("AwaitingConcurrencySlot" in _state_names(cluster, r.id) for r in held), \
        {r.name: _state_names(cluster, r.id) for r in held}
    _limit_deployment(cluster, MERGE, DEPLOYMENT_LIMIT)
    again = _in_thread(cluster, lambda: _backfill(site, train_b)).result(timeout=60)
    assert [(s["step"], s["status"]) for s in again["steps"]] == [(2, "skipped")]
    assert target_b.stat().st_ino == inode_b  # never published twice

    runs = _runs(cluster)
    per_target: dict[str, list[str]] = {}
    for run in runs:
        per_target.setdefault(_run_target(run), []).append(run.state.name)
    assert sorted(per_target[str(target_a)]) == ["Completed", "Crashed"]
    assert per_target[str(target_b)] == ["Completed"]
    assert all(states.count("Completed") == 1 for states in per_target.values()), per_target
    # Concurrency: never more runs at once than the deployment's and the pool's limits (the crashed run included),
    # each of which held runs back on its own above.
    assert all(r.start_time and r.end_time for r in runs)
    assert 2 <= _max_overlap(runs) <= min(DEPLOYMENT_LIMIT, POOL_LIMIT)
    limits = _limits(cluster)
    assert limits == (DEPLOYMENT_LIMIT, POOL_LIMIT)
    assert _no_staging_left(targets) == []
    print(f"worker deaths: crash seen {crash_wait_s} s after the kill; whole test {site.timer()} s since the cluster start")


def _limits(cluster: Cluster) -> tuple[int | None, int | None]:
    """The merge deployment's and the pool's concurrency limits, as the server holds them."""
    async def read() -> tuple[int | None, int | None]:
        async with cluster.client() as client:
            deployment = await client.read_deployment_by_name(MERGE)
            pool = await client.read_work_pool("mergeflow")
            limit = deployment.global_concurrency_limit.limit if deployment.global_concurrency_limit else None
            return limit, pool.concurrency_limit

    return asyncio.run(read())
