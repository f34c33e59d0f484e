"""A/B of two mergeflow installs on the same checkpoint: whole-command wall time, interleaved.

    python bench/ab_compare.py SITE_A SITE_B [--preset real-depth] [--repeats 3]

SITE_A and SITE_B are `pip install --no-deps --target DIR` installs of two commits (an editable
install would fill in whatever a site lacks from the checkout). Runs alternate A, B, B, A, A, B... from an
empty working directory against one Prefect server, so machine noise hits both alike; medians and
the B/A ratio are printed, with the machine's floors measured in the same rounds (read + sha256 + write
of the same rank bytes, bench/measure.py: in the page cache, and durable with an fsync) and each side's
ratio to the durable one. For "is the refactor
slower?", not for absolute speed (merge_bench.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoints import PRESETS, build_checkpoint
from measure import floor_seconds
from server import prefect_api


def _run(site: str, actor: Path, base: Path, target: Path, dtype: str, env: dict[str, str]) -> float:
    child_env = {**os.environ, **env, "PYTHONPATH": site, "MERGEFLOW_LOCAL_SERVER": "0", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "mergeflow", "merge", "--backend", "fsdp", "--local_dir", str(actor),
            "--base_model", str(base), "--target_dir", str(target), "--output_format", "transformer", "--dtype", dtype]
    started = time.monotonic()
    proc = subprocess.run(argv, env=child_env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{site}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    shutil.rmtree(target)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("site_a")
    parser.add_argument("site_b")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="real-depth")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="preserve")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ab-"))
    try:
        actor, base = build_checkpoint(root, PRESETS[args.preset])
        rank_files = sorted(actor.glob("*.pt"))
        times: dict[str, list[float]] = {args.site_a: [], args.site_b: []}
        floors: list[float] = []
        cache_floors: list[float] = []
        with prefect_api() as env:
            _run(args.site_a, actor, base, root / "warm", args.dtype, env)  # schema caches, page cache
            for i in range(args.repeats):
                cache_floors.append(floor_seconds(rank_files, root / "floor.bin", durable=False))
                floors.append(floor_seconds(rank_files, root / "floor.bin"))
                print(f"  floor: page cache {cache_floors[-1]:.2f} s, durable {floors[-1]:.2f} s", flush=True)
                # A then B, then B then A: neither side always runs right after the other's writeback.
                for site in (args.site_a, args.site_b) if i % 2 == 0 else (args.site_b, args.site_a):
                    times[site].append(_run(site, actor, base, root / f"out-{i}", args.dtype, env))
                    print(f"  {Path(site).name}: {times[site][-1]:.2f} s", flush=True)
        a, b = (statistics.median(times[s]) for s in (args.site_a, args.site_b))
        floor, cache_floor = statistics.median(floors), statistics.median(cache_floors)
        print(f"{args.preset} --dtype {args.dtype}: A {a:.2f} s, B {b:.2f} s, floor {floor:.2f} s durable, "
              f"{cache_floor:.2f} s page cache (medians of {args.repeats}); B/A {b / a:.3f}; "
              f"A/floor {a / floor:.2f}, B/floor {b / floor:.2f} (durable)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
