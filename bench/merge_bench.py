"""Export benchmark: wall time and memory of a real merge, as a ratio to this machine's floor.

The floor is the cheapest thing any exporter must do with the same bytes: read them, write
them, sha256 them, in one pass. The export runs the real Prefect merge flow in a child
process (imports and Prefect start-up are measured separately), sampled for peak RSS and
private (anonymous) memory. Every timed run is a full export (no Prefect cache hits) and
has its own floor measured just before it. Machines here are shared and noisy: medians
and ratios only.

    python bench/merge_bench.py                    # ~1 GB, W=4, 3 repeats
    python bench/merge_bench.py --sizes-gb 1 4     # private memory must stay flat
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

BLOCK = 16 * 1024 * 1024


def floor_seconds(files: list[Path], out: Path) -> float:
    """Read + write + sha256 of the same bytes in one pass."""
    start = time.perf_counter()
    digest = hashlib.sha256()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(out, "wb", buffering=0) as dst:
        for path in files:
            with open(path, "rb", buffering=0) as src:
                while n := src.readinto(buf):
                    digest.update(view[:n])
                    dst.write(view[:n])
        os.fsync(dst.fileno())
    elapsed = time.perf_counter() - start
    out.unlink()
    return elapsed


def settle(seconds: float = 0.5) -> None:
    """Let the last measurement's writeback and deletes land, and the Prefect server digest the
    last run's events (it shares these cores), so neither shows up in the next measurement."""
    os.sync()
    time.sleep(seconds)
    os.sync()


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, anonymous = private heap) of a process, in kB.

    /proc/PID/status keeps these as counters: reading it is O(1). smaps_rollup walks every
    page table of the process, which with a gigabyte of mapped rank files costs real CPU on
    a two-core machine and slowed the export it was measuring.
    """
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
    except FileNotFoundError:
        pass
    return rss, anon


def _child(conn, actor: str, base: str, targets: list[str], workers: int) -> None:  # type: ignore[no-untyped-def]
    # Every timed run is a full export: no task result comes from Prefect's cache of an earlier run.
    os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    start = time.perf_counter()
    from mergeflow import ModelMergerConfig, merge_model

    conn.send(("imported", time.perf_counter() - start))
    for i, target in enumerate(targets):
        conn.recv()  # the parent has recorded the baseline
        t0 = time.perf_counter()
        merge_model(ModelMergerConfig(local_dir=actor, base_model=base, target_dir=target,
                                      output_format="transformer", workers=workers))
        conn.send(("done", time.perf_counter() - t0, flow_run_seconds(f"merge-{Path(target).name}")))


def flow_run_seconds(name: str) -> float:
    """Running -> Completed of the latest flow run with this name, as Prefect recorded it.

    The rest of the call is Prefect's own set-up and teardown: creating the flow run, and
    at the end joining its heartbeat thread, which sleeps in whole seconds (Prefect's
    default heartbeat is on, and mergeflow leaves it on for crash detection). That adds 0-1 s
    to every run, whatever its size.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
    return (runs[0].end_time - runs[0].start_time).total_seconds()


def run_exports(actor: Path, base: Path, work: Path, repeats: int, workers: int,
                floor: Callable[[], float]) -> dict[str, object]:
    """Timed exports in one child process; the floor is re-measured right before each, so both
    see the same machine state (these machines are shared: load drifts within a minute)."""
    targets = [str(work / f"out-{i}") for i in range(repeats + 1)]  # run 0 warms Prefect and caches
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, str(actor), str(base), targets, workers))
    proc.start()
    _, import_s = parent.recv()
    times, flow_times, floors, peaks_rss, peaks_anon, baselines = [], [], [], [], [], []
    for i, target in enumerate(targets):
        if i > 0:
            settle()
            floors.append(floor())
        settle()
        rss0, anon0 = memory_kb(proc.pid)
        peak = [rss0, anon0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                rss, anon = memory_kb(proc.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        parent.send("go")
        _, seconds, in_flow = parent.recv()
        stop.set()
        sampler.join()
        shutil.rmtree(target)
        if i == 0:
            first = seconds
            continue
        times.append(seconds)
        flow_times.append(in_flow)
        peaks_rss.append(peak[0])
        peaks_anon.append(peak[1])
        baselines.append(anon0)
    proc.join()
    return {"import_s": import_s, "first_run_s": first, "times": times, "flow_times": flow_times, "floors": floors, "peak_rss_kb": max(peaks_rss),
            "peak_anon_kb": max(peaks_anon), "anon_growth_kb": max(p - b for p, b in zip(peaks_anon, baselines)),
            "anon_baselines_kb": baselines}


def _build(conn, root: str, size_bytes: int, world: int) -> None:  # type: ignore[no-untyped-def]
    from mergeflow.synthetic.checkpoints import build_sized_checkpoint

    demo = build_sized_checkpoint(Path(root), size_bytes, world_size=world)
    conn.send((str(demo.actor_dir), str(demo.base_dir)))


def build_checkpoint(root: Path, size_bytes: int, world: int) -> tuple[Path, Path]:
    """Build in a child process: the model's heap goes with it instead of staying in this
    process, where it would crowd the page cache that the floor and the exports write into."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_build, args=(child, str(root), size_bytes, world))
    proc.start()
    actor, base = parent.recv()
    proc.join()
    return Path(actor), Path(base)


def bench_size(size_gb: float, world: int, repeats: int, workers: int, root: Path) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{size_gb}g-", dir=root))
    t0 = time.perf_counter()
    actor_dir, base_dir = build_checkpoint(work / "ckpt", int(size_gb * 1e9), world)
    build_s = time.perf_counter() - t0
    rank_files = sorted(actor_dir.glob("model_world_size_*.pt"))
    nbytes = sum(p.stat().st_size for p in rank_files)
    result = run_exports(actor_dir, base_dir, work, repeats, workers,
                         lambda: floor_seconds(rank_files, work / "floor.bin"))
    shutil.rmtree(work)
    export = statistics.median(result["times"])  # type: ignore[arg-type]
    in_flow = statistics.median(result["flow_times"])  # type: ignore[arg-type]
    floor = statistics.median(result["floors"])  # type: ignore[arg-type]
    return {"size_gb": size_gb, "bytes": nbytes, "build_s": build_s, "floor_s": floor, "export_s": export,
            "ratio": export / floor, "flow_s": in_flow, "flow_ratio": in_flow / floor, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--root", default=tempfile.gettempdir())
    args = parser.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        print("note: PREFECT_API_URL is unset; each child starts a temporary Prefect server "
              "(counted in first_run_s, not in export_s)", file=sys.stderr)
    rows = [bench_size(s, args.world_size, args.repeats, args.workers, Path(args.root)) for s in args.sizes_gb]
    print(f"{'size':>6} {'bytes':>13} {'floor_s':>8} {'export_s':>9} {'ratio':>6} {'flow_s':>7} {'flow_ratio':>10} "
          f"{'import_s':>8} {'first_s':>8} {'peakRSS_MB':>10} {'peakPriv_MB':>11} {'privGrowth_MB':>13}")
    for r in rows:
        print(f"{r['size_gb']:>5}G {r['bytes']:>13} {r['floor_s']:>8.2f} {r['export_s']:>9.2f} {r['ratio']:>6.2f} "
              f"{r['flow_s']:>7.2f} {r['flow_ratio']:>10.2f} {r['import_s']:>8.2f} {r['first_run_s']:>8.2f} "
              f"{r['peak_rss_kb'] / 1024:>10.0f} {r['peak_anon_kb'] / 1024:>11.0f} {r['anon_growth_kb'] / 1024:>13.0f}")
    for r in rows:
        print(f"at {r['size_gb']}G: export (s) {', '.join(f'{t:.2f}' for t in r['times'])}; "
              f"in flow (s) {', '.join(f'{t:.2f}' for t in r['flow_times'])}; "
              f"floor (s) {', '.join(f'{t:.2f}' for t in r['floors'])}; "
              f"private memory before each run (MB) {', '.join(f'{b / 1024:.0f}' for b in r['anon_baselines_kb'])}")
    print("export_s: the merge_model call; flow_s: the flow run from Running to Completed as Prefect records it "
          "(without flow-run creation and the heartbeat-thread join at exit, 0-1 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
