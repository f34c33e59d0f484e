"""Fan-out throughput on a work pool, and Prefect's fixed cost per checkpoint run (PostgreSQL vs SQLite).

1. Throughput: a backfill of 4 checkpoints of --size-mb each (W=4 FSDP ranks, bf16), fanned out as one
   flow run per checkpoint (flows/fan_out.py) over a pool of 1 process worker, then of 2, on a
   PostgreSQL-backed server on this machine (tests/cluster.py). Wall time from the backfill's start to
   the last publish (the last step run's end). Both workers share this machine's cores and disk: the
   ratio says how much the fan-out overlaps, not what two machines would do.
2. Prefect's fixed cost per checkpoint run: --overhead-runs exports of a ~5 MB checkpoint, one at a
   time on one worker, on the PostgreSQL server and on a SQLite one: the wall time per run, the first
   run's wait from its scheduled time to its start (the worker's poll, Prefect's default 10 s, then the
   flow-run process start) and the median run time (the engine, task runs and state changes around a
   merge of a few hundred milliseconds). The fixed cost is that median less the same export's steps
   called as plain functions in a fresh process that has imported what a worker's flow-run process
   imports (the merge deployment's flow), median of 3: the first call of the export's own code pays
   its lazy imports there too, so the difference is what the flow and task runs add.

    python bench/cluster_bench.py                    # 4 x 1 GB (the issue's size): run it on a quiet machine
    python bench/cluster_bench.py --size-mb 20       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
os.environ.setdefault("MERGEFLOW_LOCAL_SERVER", "0")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

MERGE = "mergeflow-merge-checkpoint/on-checkpoint"
STEPS = 4


def _steps(actor: Path, train: Path, steps: int) -> None:
    """train/global_step_{1..steps}/actor: copies of one checkpoint (separate files: no page cache shared)."""
    for step in range(1, steps + 1):
        shutil.copytree(actor, train / f"global_step_{step}" / "actor")


def _warm(root: Path) -> None:
    """Read every file once, so the first configuration measured does not pay the cold reads alone."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def _deploy(cluster: Any, base: Path, checkpoints: Path, targets: Path) -> None:
    env = {**cluster.client_env(), "MERGEFLOW_BASE_MODEL": str(base), "MERGEFLOW_TARGET_ROOT": str(targets),
           "MERGEFLOW_CHECKPOINT_ROOT": str(checkpoints)}
    cluster.prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(REPO / "deployments" / "prefect.yaml"), env=env)


def _pool(cluster: Any) -> None:
    cluster.prefect("work-pool", "create", "mergeflow", "--type", "process")


def _fan_out(cluster: Any, train: Path, base: Path, targets: Path, run_name: str, workers: int) -> dict[str, Any]:
    """One fanned-out backfill of `train`; its wall time to the last publish and each run's wait and run time."""
    import asyncio

    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
    )

    from mergeflow.flows.backfill_flow import backfill_flow

    started = time.time()
    with cluster.activated():
        summary = backfill_flow(train_dir=str(train), base_model=str(base), target_root=str(targets), run_name=run_name,
                                output_format="transformer", stable_seconds=0, workers=workers, task_runner="thread",
                                deployment=MERGE)
    returned = time.time()
    assert all(s["status"] == "done" for s in summary["steps"]), summary

    async def read() -> list[Any]:
        async with cluster.client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False)))
            return [r for r in runs if "checkpoint" in r.parameters  # the step runs, not their merge subflows
                    and str(targets / run_name) in str(r.parameters["checkpoint"]["target_dir"])]

    runs = asyncio.run(read())
    last_publish = max(r.end_time.timestamp() for r in runs)
    return {
        "runs": len(runs),
        "wall_to_last_publish_s": round(last_publish - started, 2),
        "backfill_returned_s": round(returned - started, 2),
        "wait_s": [round((r.start_time - r.expected_start_time).total_seconds(), 2) for r in runs],
        "run_s": [round(r.total_run_time.total_seconds(), 2) for r in runs],
    }


def throughput(root: Path, size_mb: int) -> dict[str, Any]:
    from checkpoints import Preset, build_checkpoint
    from cluster import Cluster

    actor, base = build_checkpoint(root / "built", Preset("sized", world_size=4, dtype="bfloat16",
                                                           size_bytes=size_mb * 10**6))
    checkpoints = root / "checkpoints"
    _steps(actor, checkpoints / "run", STEPS)
    shutil.rmtree(actor.parent)
    _warm(checkpoints)
    results: dict[str, Any] = {}
    with Cluster(root / "cluster-pg") as cluster:
        cluster.start_postgres()
        cluster.start_server()
        _pool(cluster)
        (root / "targets").mkdir()
        _deploy(cluster, base, checkpoints, root / "targets")
        cluster.start_worker("machine-1", limit=1)
        for workers in (1, 2):
            if workers == 2:
                cluster.start_worker("machine-2", limit=1)
            results[f"{workers}_worker"] = _fan_out(cluster, checkpoints / "run", base, root / "targets",
                                                    f"workers-{workers}", workers=2)
        cluster.drain()
    one, two = results["1_worker"]["wall_to_last_publish_s"], results["2_worker"]["wall_to_last_publish_s"]
    results["ratio_2_over_1"] = round(two / one, 3)
    return results


def overhead(root: Path, runs: int) -> dict[str, Any]:
    from cluster import Cluster
    from prefect_server import start_prefect_server

    from mergeflow.demo.checkpoints import build_sized_checkpoint

    demo = build_sized_checkpoint(root / "tiny-built", 5 * 10**6, world_size=2)  # about the smallest it scales to
    checkpoints = root / "tiny-checkpoints"
    _steps(demo.actor_dir, checkpoints / "tiny", runs)
    results: dict[str, Any] = {}
    for backend in ("postgresql", "sqlite"):
        targets = root / f"tiny-targets-{backend}"
        targets.mkdir()
        with Cluster(root / f"cluster-{backend}") as cluster:
            if backend == "postgresql":
                cluster.start_postgres()
                cluster.start_server()
                measured = _overhead_on(cluster, demo.base_dir, checkpoints, targets)
            else:
                with start_prefect_server(root / "sqlite-server") as server:
                    cluster.api_url = server.api_url
                    measured = _overhead_on(cluster, demo.base_dir, checkpoints, targets)
        results[backend] = measured
    direct = statistics.median(_direct_cold(demo.base_dir, checkpoints / "tiny" / "global_step_1" / "actor",
                                            root / f"tiny-direct-{i}") for i in range(3))
    results["direct_s"] = direct
    for backend in ("postgresql", "sqlite"):
        results[backend]["fixed_cost_s"] = round(results[backend]["median_run_s"] - direct, 3)
    return results


def _overhead_on(cluster: Any, base: Path, checkpoints: Path, targets: Path) -> dict[str, Any]:
    _pool(cluster)
    _deploy(cluster, base, checkpoints, targets)
    cluster.start_worker("machine-1", limit=1)  # one at a time: each run's cost alone
    measured = _fan_out(cluster, checkpoints / "tiny", base, targets, "tiny", workers=1)
    cluster.drain()
    # The runs are dispatched together and run one after another, so only the first one's wait is a
    # dispatch latency (the worker's poll, every PREFECT_WORKER_QUERY_SECONDS, then the flow-run process start).
    return {"runs": measured["runs"],
            "per_run_wall_s": round(measured["wall_to_last_publish_s"] / measured["runs"], 2),
            "first_wait_s": min(measured["wait_s"]),
            "median_run_s": statistics.median(measured["run_s"])}


def _direct_cold(base: Path, actor: Path, target: Path) -> float:
    """Seconds of one export's steps as plain function calls (bench/prefect_overhead.py's merge_direct), timed
    inside a fresh process after it has loaded the merge deployment's flow, as a worker's flow-run process does."""
    done = subprocess.run([sys.executable, __file__, "--direct", str(actor), str(base), str(target)], check=True,
                          capture_output=True, text=True, timeout=300)
    return float(done.stdout.strip().splitlines()[-1])


def _direct_once(actor: str, base: str, target: str) -> None:
    from prefect.flows import load_flow_from_entrypoint
    from prefect_overhead import merge_direct

    from mergeflow.config import ModelMergerConfig

    load_flow_from_entrypoint("mergeflow.flows.checkpoint.merge_checkpoint_flow")  # the deployment's entrypoint
    started = time.perf_counter()
    merge_direct(ModelMergerConfig(local_dir=actor, base_model=base, target_dir=target, output_format="transformer",
                                   workers=1))
    print(round(time.perf_counter() - started, 3))


def main() -> None:
    if sys.argv[1:2] == ["--direct"]:  # one timed direct export, in a process of its own (_direct_cold)
        _direct_once(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1000, help="size of each of the 4 checkpoints (default 1 GB)")
    parser.add_argument("--overhead-runs", type=int, default=6, help="tiny exports per backend for the fixed cost")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mergeflow-cluster-bench-"))
    report: dict[str, Any] = {"size_mb": args.size_mb, "checkpoints": STEPS, "cpus": os.cpu_count()}
    try:
        if not args.skip_throughput:
            report["throughput"] = throughput(root, args.size_mb)
            print(json.dumps({"throughput": report["throughput"]}), file=sys.stderr, flush=True)  # kept if a later part fails
        if not args.skip_overhead:
            report["prefect_fixed_cost"] = overhead(root, args.overhead_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
