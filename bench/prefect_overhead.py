"""Prefect's cost: the merge flow against a running server vs. the same steps as plain function calls.

Both sides run the same functions in the same process on the same checkpoint (same thread
count for rank loads and shard writes); the flow side adds task runs, state changes, result
persistence, cache-key lookups, artifacts and logs sent to the server. Caching is refreshed on
every flow run so no step is skipped. Runs alternate (direct, flow, direct, ...) so the page
cache favours neither. The machine is shared and noisy: medians only.

    python bench/prefect_overhead.py                       # 64 MB, W=4, 5 runs each
    PREFECT_API_URL=http://127.0.0.1:4200/api python bench/prefect_overhead.py --size-mb 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def merge_direct(config: Any) -> dict[str, str]:
    """The merge flow's steps for a plain (non-LoRA) export, called directly: no Prefect at all."""
    from mergeflow.export.check.staged_check import validate_staged
    from mergeflow.export.plan.build import build_plan
    from mergeflow.export.publish import finalize_staging, publish_staged, seal_staged
    from mergeflow.export.reconstruct.layout import rank_layouts
    from mergeflow.export.reconstruct.rebuild import plan_tensor_writes
    from mergeflow.export.write.shard_writer import pack_shards, write_shard_file
    from mergeflow.io.fs import TargetLock
    from mergeflow.io.staging import check_target
    from mergeflow.sources.verl_ranks import RankStates, hash_rank_file, index_rank_file

    plan = build_plan(config)
    trust = plan.options.trust_checkpoint
    with TargetLock(Path(plan.output.lock)), ThreadPoolExecutor(max_workers=config.workers) as pool:
        check_target(Path(plan.output.target))
        indexes = list(pool.map(lambda r: index_rank_file(Path(plan.checkpoint.actor_dir), plan.checkpoint.rank_files[r], r, trust_checkpoint=trust),
                                range(plan.checkpoint.world_size)))
        output = pack_shards(plan_tensor_writes(plan, rank_layouts(indexes)), plan.options.max_shard_size, plan.output.weights_name, plan.fingerprint)
        artifact_dir, work_dir = Path(plan.output.tensor_dir), Path(plan.output.work_dir)
        artifact_dir.mkdir(parents=True, exist_ok=True)
        work_dir.mkdir(parents=True, exist_ok=True)

        def write(shard: Any) -> Any:  # like the task: its own view of the rank files per shard
            return write_shard_file(shard, RankStates(Path(plan.checkpoint.actor_dir), plan.checkpoint.rank_files, trust_checkpoint=trust),
                                    artifact_dir, work_dir)

        writes = [pool.submit(write, shard) for shard in output.shards]
        hashes = {name: pool.submit(hash_rank_file, Path(plan.checkpoint.actor_dir), name) for name in plan.checkpoint.rank_files}
        records = [w.result() for w in writes]
        manifest = finalize_staging(plan, output, {name: h.result() for name, h in hashes.items()}, records)
        verified = {plan.output.relative(r.file_name): r.verified() for r in records}
        report = validate_staged(plan, manifest, verified)
        return publish_staged(plan, report, seal_staged(plan, report))


@contextlib.contextmanager
def prefect_api(workdir: Path) -> Iterator[str]:
    """PREFECT_API_URL if set; otherwise a throw-away `prefect server start` (the tests' helper)."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_TASKS_REFRESH_CACHE,
        temporary_settings,
    )

    if os.environ.get("PREFECT_API_URL"):
        with temporary_settings(updates={PREFECT_TASKS_REFRESH_CACHE: True}):
            yield os.environ["PREFECT_API_URL"]
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from prefect.logging.handlers import APILogWorker
    from prefect_server import start_prefect_server

    with start_prefect_server(workdir) as server:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_TASKS_REFRESH_CACHE: True}):
            try:
                yield server.api_url
            finally:
                APILogWorker.drain_all(timeout=5)  # send the runs' logs before the server goes away


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--max-shard-mb", type=float, default=16.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import torch

    from mergeflow.config import ModelMergerConfig
    from mergeflow.demo.checkpoints import build_sized_checkpoint
    from mergeflow.flows.api import merge_model

    workdir = Path(tempfile.mkdtemp(prefix="mergeflow-overhead-"))
    try:
        demo = build_sized_checkpoint(workdir / "ckpt", int(args.size_mb * 1e6), world_size=args.world_size, dtype=torch.bfloat16)
        out = workdir / "out"
        out.mkdir()

        def config(name: str) -> ModelMergerConfig:
            return ModelMergerConfig(operation="merge", local_dir=str(demo.actor_dir), base_model=str(demo.base_dir),
                                     target_dir=str(out / name), output_format="transformer",
                                     max_shard_size=int(args.max_shard_mb * 1e6), workers=args.workers)

        with prefect_api(workdir) as api_url:
            merge_direct(config("warm-direct"))
            merge_model(config("warm-flow"))  # first flow run pays for registration and imports
            direct: list[float] = []
            flow: list[float] = []
            for i in range(args.runs):
                start = time.perf_counter()
                merge_direct(config(f"direct-{i}"))
                direct.append(time.perf_counter() - start)
                start = time.perf_counter()
                merge_model(config(f"flow-{i}"))
                flow.append(time.perf_counter() - start)
        shards = len(list((out / "flow-0").glob("*.safetensors")))
        size = sum(p.stat().st_size for p in (out / "flow-0").glob("*.safetensors"))
        # Task runs of one flow: inspect, W rank loads, plan, K shards, W rank hashes, metadata, validate, publish.
        tasks = 1 + args.world_size + 1 + shards + args.world_size + 3
        d, f = statistics.median(direct), statistics.median(flow)
        result = {
            "api_url": api_url, "bytes": size, "world_size": args.world_size, "shards": shards, "task_runs": tasks,
            "runs": args.runs, "direct_median_s": round(d, 3), "flow_median_s": round(f, 3),
            "ratio": round(f / d, 2), "overhead_s": round(f - d, 3), "overhead_per_task_ms": round(1000 * (f - d) / tasks, 1),
            "direct_s": [round(x, 3) for x in direct], "flow_s": [round(x, 3) for x in flow],
        }
        print(f"direct (plain functions): median {d:.3f} s   flow (Prefect server): median {f:.3f} s", file=sys.stderr)
        print(f"ratio {f / d:.2f}x, overhead {f - d:.3f} s = {1000 * (f - d) / tasks:.1f} ms per task run "
              f"({tasks} task runs, {shards} shards, {size / 1e6:.1f} MB)", file=sys.stderr)
        print(json.dumps(result))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
