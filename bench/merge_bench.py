"""Export benchmark: wall time and memory of a real merge, as a ratio to this machine's floor.

The floor is the cheapest thing any exporter must do with the same bytes: read them, write
them, sha256 them, in one pass. The export runs the real Prefect merge flow in a child
process (imports and Prefect start-up are measured separately), sampled for peak RSS and
private (anonymous) memory. Machines here are shared and noisy: medians and ratios only.

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


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, anonymous = private heap) of a process, in kB."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Anonymous:"):
                    anon = int(line.split()[1])
    except FileNotFoundError:
        pass
    return rss, anon


def _child(conn, actor: str, base: str, targets: list[str], workers: int) -> None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    from mergeflow import ModelMergerConfig, merge_model

    conn.send(("imported", time.perf_counter() - start))
    for i, target in enumerate(targets):
        conn.recv()  # the parent has recorded the baseline
        t0 = time.perf_counter()
        merge_model(ModelMergerConfig(local_dir=actor, base_model=base, target_dir=target,
                                      output_format="transformer", workers=workers))
        conn.send(("done", time.perf_counter() - t0))


def run_exports(actor: Path, base: Path, work: Path, repeats: int, workers: int) -> dict[str, object]:
    targets = [str(work / f"out-{i}") for i in range(repeats + 1)]  # run 0 warms Prefect and caches
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, str(actor), str(base), targets, workers))
    proc.start()
    _, import_s = parent.recv()
    times, peaks_rss, peaks_anon, baselines = [], [], [], []
    for i, target in enumerate(targets):
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
        _, seconds = parent.recv()
        stop.set()
        sampler.join()
        shutil.rmtree(target)
        if i == 0:
            first = seconds
            continue
        times.append(seconds)
        peaks_rss.append(peak[0])
        peaks_anon.append(peak[1])
        baselines.append(anon0)
    proc.join()
    return {"import_s": import_s, "first_run_s": first, "times": times, "peak_rss_kb": max(peaks_rss),
            "peak_anon_kb": max(peaks_anon), "anon_growth_kb": max(p - b for p, b in zip(peaks_anon, baselines))}


def bench_size(size_gb: float, world: int, repeats: int, workers: int, root: Path) -> dict[str, object]:
    from mergeflow.synthetic.checkpoints import build_sized_checkpoint

    work = Path(tempfile.mkdtemp(prefix=f"bench-{size_gb}g-", dir=root))
    t0 = time.perf_counter()
    demo = build_sized_checkpoint(work / "ckpt", int(size_gb * 1e9), world_size=world)
    build_s = time.perf_counter() - t0
    rank_files = sorted(demo.actor_dir.glob("model_world_size_*.pt"))
    nbytes = sum(p.stat().st_size for p in rank_files)
    floors = [floor_seconds(rank_files, work / "floor.bin") for _ in range(repeats)]
    result = run_exports(demo.actor_dir, demo.base_dir, work, repeats, workers)
    shutil.rmtree(work)
    export = statistics.median(result["times"])  # type: ignore[arg-type]
    floor = statistics.median(floors)
    return {"size_gb": size_gb, "bytes": nbytes, "build_s": build_s, "floor_s": floor, "export_s": export,
            "ratio": export / floor, **result}


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
    print(f"{'size':>6} {'bytes':>13} {'floor_s':>8} {'export_s':>9} {'ratio':>6} {'import_s':>8} "
          f"{'first_s':>8} {'peakRSS_MB':>10} {'peakPriv_MB':>11} {'privGrowth_MB':>13}")
    for r in rows:
        print(f"{r['size_gb']:>5}G {r['bytes']:>13} {r['floor_s']:>8.2f} {r['export_s']:>9.2f} {r['ratio']:>6.2f} "
              f"{r['import_s']:>8.2f} {r['first_run_s']:>8.2f} {r['peak_rss_kb'] / 1024:>10.0f} "
              f"{r['peak_anon_kb'] / 1024:>11.0f} {r['anon_growth_kb'] / 1024:>13.0f}")
    for r in rows:
        print(f"export times (s) at {r['size_gb']}G: {', '.join(f'{t:.2f}' for t in r['times'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
