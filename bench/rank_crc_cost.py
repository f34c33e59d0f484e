"""What checking every rank-file record's CRC-32 costs on top of the sha256 pass, against the floor.

The manifest's sha256 pass over the rank files now also checks each zip record's stored CRC-32
(mergeflow.formats.zip_records). This measures, with a warm page cache, the median of several
runs of: plain sha256_file, sha256_and_check_records (the shipped, serial pass), the same pass
with the CRC on a second thread (the alternative it was chosen over), and the floor (read +
sha256 + write in one pass, fsync: bench/measure.py). Wall seconds and CPU seconds (all
threads) both count: the pass runs in the background beside the export's other work.

    python bench/rank_crc_cost.py                 # FLUX.1's depth (1,160 tensors, W=8) at 4 heads: ~1.4 GB
    python bench/rank_crc_cost.py --runs 7 --keep
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import Preset, build_checkpoint
from measure import floor_seconds

# _RecordChecker: the shipped pass's own record follower, driven from a second thread for comparison.
from mergeflow.formats.zip_records import (
    _RecordChecker,
    sha256_and_check_records,
    stored_records,
)
from mergeflow.io.fs import HASH_BLOCK, sha256_file

# FLUX.1's depth and tensor count (as the real-depth preset) at a quarter of its bytes.
PRESET = Preset("real-depth-4-heads", world_size=8, dtype="float32",
                overrides={"num_attention_heads": 4, "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56),
                           "num_layers": 19, "num_single_layers": 38})


def crc_on_second_thread(path: Path, block: int = HASH_BLOCK) -> str:
    """The alternative measured: sha256 on this thread, the CRCs of the same block on another.

    Two buffers: block i is read while block i-1's CRCs run; each block's CRCs finish before its
    buffer is read into again, and the checker sees blocks in order.
    """
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1) as pool:
        records = stored_records(handle)
        checker = _RecordChecker(path.name, records or [])
        handle.seek(0)
        buffers = [bytearray(block), bytearray(block)]
        views = [memoryview(b) for b in buffers]
        pending: Future[None] | None = None
        pos = i = 0
        while n := handle.readinto(buffers[i % 2]):
            chunk = views[i % 2][:n]
            if pending is not None:
                pending.result()
            pending = pool.submit(checker.feed, pos, chunk)
            digest.update(chunk)
            pos, i = pos + n, i + 1
        if pending is not None:
            pending.result()
    checker.finish()
    return digest.hexdigest()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-rank-crc-", dir=args.root))
    try:
        actor, _ = build_checkpoint(work / "ckpt", PRESET)
        files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
        total = sum(p.stat().st_size for p in files)
        expected = [sha256_file(p) for p in files]  # also warms the page cache

        def over_files(hasher: Callable[[Path], str]) -> Callable[[], object]:
            def run() -> None:
                assert [hasher(p) for p in files] == expected
            return run

        passes: dict[str, Callable[[], object]] = {
            "sha256_file": over_files(sha256_file),
            "sha256_and_check_records": over_files(sha256_and_check_records),
            "crc on a second thread": over_files(crc_on_second_thread),
            "floor (read+sha256+write)": lambda: floor_seconds(files, work / "floor.bin"),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in passes}
        for _ in range(args.runs):  # interleaved, so drift on a shared machine hits every pass alike
            for name, run in passes.items():
                samples[name].append(timed(run))

        wall = {name: statistics.median(s[0] for s in runs) for name, runs in samples.items()}
        cpu = {name: statistics.median(s[1] for s in runs) for name, runs in samples.items()}
        floor, plain = wall["floor (read+sha256+write)"], wall["sha256_file"]
        print(f"{len(files)} rank files, {total / 1e9:.2f} GB, warm page cache, median of {args.runs} runs")
        print(f"{'pass':<28}{'wall s':>8}{'cpu s':>8}{'/ floor':>9}{'/ sha256':>10}{'GB/s':>7}")
        for name in passes:
            print(f"{name:<28}{wall[name]:>8.3f}{cpu[name]:>8.3f}{wall[name] / floor:>9.2f}"
                  f"{wall[name] / plain:>10.2f}{total / wall[name] / 1e9:>7.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
