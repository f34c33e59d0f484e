"""The full-size export: FLUX.1-dev (11.9 B parameters, bf16, W=8, 23.8 GB of rank files).

24 GB in plus 24 GB out is more than this machine's page cache: the regime real users are
in, which the small benches (whose inputs stay cached) never reach. Steps:

1. generate the checkpoint with bench/flux_full_scale.py in --root, or reuse a complete one;
2. the floor: read + sha256 + write the same rank files in one pass, fsync at the end;
3. the export: the whole `mergeflow merge ... --output_format transformer` command as a
   subprocess (process start to exit) against a throw-away Prefect server, its /proc status
   (VmRSS, RssAnon = private memory) sampled every 50 ms;
4. `mergeflow test` on the output (timed), then the output is deleted (unless --keep).

Page caches are dropped (as root) before the floor and before the export, so both start
cold; where that is refused, 48 GB of traffic through ~24 GiB of RAM evicts them anyway.

    python bench/full_scale_bench.py                          # /tmp/flux-full, ~50 GB of disk
    python bench/full_scale_bench.py --skip-generate --keep -- --workers 2
Arguments after `--` go to `mergeflow merge` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import flux_full_scale as gen  # noqa: E402
from measure import floor_seconds, status_kb  # noqa: E402
from server import prefect_api  # noqa: E402
from system_state import traffic  # noqa: E402

SAMPLE_S = 0.05
MARGIN = 2 * 10**9  # staging, manifest, Prefect's results and the filesystem's own needs


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False where that is not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def cached_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out.extend(int(c) for c in fh.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


@dataclass
class Peaks:
    rss_kb: int = 0
    anon_kb: int = 0
    tree_anon_kb: int = 0  # the child plus any processes it started
    samples: int = 0
    descendants: set[int] = field(default_factory=set)


def run_measured(command: list[str], env: dict[str, str], log: Path) -> tuple[float, int, Peaks]:
    """Run a command from process start to exit, sampling its memory; (seconds, rc, peaks)."""
    peaks = Peaks()
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                rss, anon = status_kb(proc.pid)
                tree = anon
                for child in _children(proc.pid):
                    peaks.descendants.add(child)
                    tree += status_kb(child)[1]
                peaks.rss_kb, peaks.anon_kb = max(peaks.rss_kb, rss), max(peaks.anon_kb, anon)
                peaks.tree_anon_kb = max(peaks.tree_anon_kb, tree)
                peaks.samples += 1
                done.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        elapsed = time.perf_counter() - start
        done.set()
        sampler.join()
    return elapsed, rc, peaks


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def model_config(tiny: bool) -> dict[str, object]:
    if not tiny:
        return gen.FLUX_DEV_CONFIG
    from mergeflow.demo.tiny_transformers import TINY_TRANSFORMER_CONFIGS

    return TINY_TRANSFORMER_CONFIGS[gen.CLASS_NAME]


def ensure_checkpoint(root: Path, world_size: int, seed: int, skip_generate: bool,
                      tiny: bool) -> tuple[gen.Generated, float | None]:
    """The complete checkpoint under root: reused if there, else generated in a child process."""
    config = model_config(tiny)
    done = gen.load_complete(root, world_size=world_size, seed=seed, config=config)
    if done is not None:
        return done, None
    if skip_generate:
        raise SystemExit(f"--skip-generate: no complete checkpoint under {root} (no {gen.MANIFEST} or files changed)")
    # 23.8 GB of rank files, then as much again for the export; a half-written earlier run
    # is removed first.
    need = 0 if tiny else 2 * int(23.9e9) + MARGIN
    free = shutil.disk_usage(root if root.exists() else root.parent).free
    if free < need:
        raise SystemExit(f"{free / 1e9:.1f} GB free; generating and exporting needs ~{need / 1e9:.0f} GB")
    root.mkdir(parents=True, exist_ok=True)
    gen.remove(root)
    start = time.perf_counter()
    # In its own process: its page cache footprint and heap leave with it.
    subprocess.run([sys.executable, str(HERE / "flux_full_scale.py"), str(root), "-w", str(world_size),
                    "--seed", str(seed), *(["--tiny"] if tiny else [])], check=True, cwd=REPO)
    seconds = time.perf_counter() - start
    done = gen.load_complete(root, world_size=world_size, seed=seed, config=config)
    if done is None:
        raise SystemExit(f"generation under {root} did not complete")
    return done, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/flux-full"))
    parser.add_argument("-w", "--world-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-generate", action="store_true", help="fail unless a complete checkpoint is in --root")
    parser.add_argument("--keep", action="store_true", help="keep the export output (ROOT/export)")
    parser.add_argument("--tiny", action="store_true", help="the tiny test config: a smoke test of this script")
    parser.add_argument("merge_args", nargs="*", help="extra `mergeflow merge` arguments (after --)")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    root: Path = args.root.resolve()

    checkpoint, generate_s = ensure_checkpoint(root, args.world_size, args.seed, args.skip_generate, args.tiny)
    files = list(checkpoint.rank_files)
    target = root / "export"
    if target.exists():
        shutil.rmtree(target)  # a kept or crashed earlier run's output
    free = shutil.disk_usage(root).free
    if free < checkpoint.tensor_bytes + MARGIN:
        raise SystemExit(f"{free / 1e9:.1f} GB free under {root}; the export needs ~{(checkpoint.tensor_bytes + MARGIN) / 1e9:.0f} GB")

    dropped = drop_caches()
    before = traffic(root)
    floor_s = floor_seconds(files, root / "floor.bin")
    floor_traffic = traffic(root) - before
    os.sync()

    with prefect_api() as api_env:
        env = dict(os.environ, **api_env, HF_HUB_OFFLINE="1")
        merge = [sys.executable, "-m", "mergeflow", "merge", "--backend", "fsdp",
                 "--local_dir", str(checkpoint.actor_dir), "--base_model", str(checkpoint.base_dir),
                 "--target_dir", str(target), "--output_format", "transformer", *args.merge_args]
        dropped = drop_caches() and dropped
        cached_before = cached_bytes()
        before = traffic(root)
        export_s, rc, peaks = run_measured(merge, env, root / "export.log")
        export_traffic = traffic(root) - before
        if rc != 0:
            print((root / "export.log").read_text(errors="replace")[-4000:], file=sys.stderr)
            shutil.rmtree(target, ignore_errors=True)
            raise SystemExit(f"mergeflow merge exited with {rc}; log: {root / 'export.log'}")
        out_bytes = tree_bytes(target)
        test_s, test_rc, test_peaks = run_measured(
            [sys.executable, "-m", "mergeflow", "test", "--backend", "fsdp", "--test_hf_dir", str(target)],
            env, root / "test.log")
    if not args.keep:
        shutil.rmtree(target)

    rank_bytes = sum(p.stat().st_size for p in files)
    rows = [
        ("tensors (GB)", f"{checkpoint.tensor_bytes / 1e9:.2f}"),
        ("rank files (GB, W={})".format(checkpoint.world_size), f"{rank_bytes / 1e9:.2f}"),
        ("output (GB)", f"{out_bytes / 1e9:.2f}"),
        ("generate_s", "reused" if generate_s is None else f"{generate_s:.1f}"),
        ("caches dropped", "yes" if dropped else "no (not permitted)"),
        ("page cache at export start (GB)", f"{cached_before / 1e9:.1f}"),
        ("floor_s (read+sha256+write+fsync)", f"{floor_s:.1f}"),
        ("export_s (process start to exit)", f"{export_s:.1f}"),
        ("ratio export/floor", f"{export_s / floor_s:.2f}"),
        ("peak private MiB (RssAnon)", f"{peaks.anon_kb / 1024:.0f}"),
        ("peak private MiB incl. children", f"{peaks.tree_anon_kb / 1024:.0f}"),
        ("peak RSS MiB (incl. mapped files)", f"{peaks.rss_kb / 1024:.0f}"),
        ("write MB/s (output / export_s)", f"{out_bytes / export_s / 1e6:.0f}"),
        ("read MB/s (rank files / export_s)", f"{rank_bytes / export_s / 1e6:.0f}"),
        ("floor MB/s (rank files / floor_s)", f"{rank_bytes / floor_s / 1e6:.0f}"),
        # Where a ratio moves between runs: the disk's bytes (a page read twice is read twice) and whether
        # the cores or the kernel's I/O path were the limit (whole machine, during each stretch).
        ("floor: machine during it", floor_traffic.summary()),
        ("export: machine during it", export_traffic.summary()),
        ("test_s (mergeflow test)", f"{test_s:.1f}" + ("" if test_rc == 0 else f" FAILED rc={test_rc}")),
        ("test peak private MiB", f"{test_peaks.anon_kb / 1024:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(json.dumps({"tensor_bytes": checkpoint.tensor_bytes, "rank_bytes": rank_bytes, "output_bytes": out_bytes,
                      "generate_s": generate_s, "caches_dropped": dropped, "floor_s": floor_s, "export_s": export_s,
                      "ratio": export_s / floor_s, "peak_private_mib": peaks.anon_kb / 1024,
                      "peak_private_tree_mib": peaks.tree_anon_kb / 1024, "peak_rss_mib": peaks.rss_kb / 1024,
                      "test_s": test_s, "test_rc": test_rc, "samples": peaks.samples,
                      "floor_traffic": asdict(floor_traffic), "export_traffic": asdict(export_traffic)}))
    return 0 if test_rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
