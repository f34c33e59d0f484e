"""Export benchmark: what a user waits for, as a ratio to this machine's floor in the same run.

Every timed export is a whole `mergeflow merge` process, from process start to exit (imports,
Prefect start-up and the exit included), against a Prefect server (the caller's
PREFECT_API_URL, or one this script starts and stops). Each run is a full export (Prefect's
cache is refreshed, so every rank file is parsed and hashed), has the floor measured right
before it on the same bytes (read + write + sha256 in one pass, with fsync), and is sampled
for peak private memory. The flow's task runs, as the server recorded them, say where the
time went. Then `mergeflow test` of the result is timed. Machines here are shared and noisy:
medians and ratios only; no result is compared with a fixed time.

    python bench/merge_bench.py                          # real depth: FLUX.1's 1,160 tensors, W=8, 5.3 GB
    python bench/merge_bench.py --preset 1gb             # ~1 GB in 62 tensors, W=4
    python bench/merge_bench.py --preset half-depth      # FLUX.1's widths at half its depth (peak memory vs depth)
    python bench/merge_bench.py --dtypes preserve        # only the preserving export
    python bench/merge_bench.py --layout dcp             # the same model as a torch DCP (one writer)
    python bench/merge_bench.py --dtypes preserve --output-format transformer single_file
                                                         # both outputs interleaved; prints single_file / transformer
    python bench/merge_bench.py --dtypes bfloat16 --output-format single_file single_file+quantize=fp8 gguf+quantize=q8_0
                                                         # FORMAT+FLAG=VALUE: an output with more merge flags
    python bench/merge_bench.py --dtypes preserve --output-format transformer extract-lora:32
                                                         # --extract-lora 32 against the plain transformer export,
                                                         # with the retained energy of each run
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import PRESETS, Preset, build_checkpoints  # noqa: E402
from measure import floor_seconds, settle, status_kb  # noqa: E402
from server import prefect_api  # noqa: E402
from system_state import resident_fraction, unwritten_mb  # noqa: E402
from timeline import Span, flow_timeline, summarise  # noqa: E402


@dataclass
class Run:
    floor_s: float
    floor_wb_s: float
    floor_cache_s: float
    cli_s: float
    flow_s: float
    peak_private_kb: int
    spans: list[Span] = field(default_factory=list)
    # Where a run's time can vary from (issue 29.2): the input's share in the page cache and the data
    # still to be written back when it starts, the most unwritten data during it, and the time before
    # the flow run starts (imports, the server creating the run) and after it ends (exit, drains).
    cached_in: float = 0.0
    unwritten_start_mb: float = 0.0
    unwritten_peak_mb: float = 0.0
    before_s: float = 0.0
    after_s: float = 0.0
    cpu_s: float = 0.0  # user + system seconds of the command: what a CPU-bound run spends its cores on

    @property
    def ratio(self) -> float:
        return self.cli_s / self.floor_s


@dataclass
class Timed:
    """One command: wall seconds from spawn to exit, the epoch times of both, its peak private kB, and
    the most data the kernel held unwritten (Dirty + Writeback) while it ran."""

    wall_s: float
    spawned: float
    exited: float
    peak_private_kb: int
    unwritten_peak_mb: float
    cpu_s: float = 0.0


def timed_command(argv: list[str], env: dict[str, str]) -> Timed:
    """Run one command, which must succeed, sampling its memory and the machine's unwritten data."""
    peak = [0]
    unwritten = [unwritten_mb()]
    spawned = time.time()
    # The server this script may start is a child too, but it is only counted once waited for (at the end).
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], status_kb(proc.pid)[1])
            unwritten[0] = max(unwritten[0], unwritten_mb())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _out, err = proc.communicate()
    elapsed = time.perf_counter() - start
    exited = time.time()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({proc.returncode}): {err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    return Timed(elapsed, spawned, exited, peak[0], unwritten[0], cpu_s)


def mergeflow_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "mergeflow", *args]


def output_flags(spec: str) -> list[str]:
    """`FORMAT[+FLAG=VALUE...]` -> merge flags: `single_file+quantize=fp8` is
    `--output_format single_file --quantize fp8` (a variant of an output is timed as its own column)."""
    output_format, *extras = spec.split("+")
    output_format, _, quantize = output_format.partition(":")  # FORMAT:QUANTIZE, short for FORMAT+quantize=QUANTIZE
    flags = ["--output_format", output_format] + (["--quantize", quantize] if quantize else [])
    for extra in extras:
        flag, _, value = extra.partition("=")
        flags += [f"--{flag}", value] if value else [f"--{flag}"]
    return flags


def source_files(actor: Path) -> list[Path]:
    """The checkpoint's data files, which the floor reads: verl's rank files, or a DCP's .distcp files."""
    return sorted(actor.glob("model_world_size_*.pt")) or sorted(actor.glob("*.distcp"))


EXTRACT = "extract-lora:"  # an --output-format entry: `merge --output_format transformer --extract-lora RANK`


def output_args(output_format: str) -> list[str]:
    """The merge flags of one timed variant: an output format, or an extraction at a rank."""
    if output_format.startswith(EXTRACT):
        return ["--output_format", "transformer", "--extract-lora", output_format.removeprefix(EXTRACT)]
    return output_flags(output_format)


def extraction_line(target: Path) -> str | None:
    """The retained energy an extraction recorded (None for a model export)."""
    import json

    path = target / "lora_adapter" / "lora_extraction.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())["summary"]
    return (f"{summary['layers']} layers, energy-weighted retained {summary['energy_weighted_retained']:.6f}, worst "
            f"{summary['min_retained']:.6f}, adapter {summary['adapter_file_bytes'] / 1e6:.1f} MB "
            f"({summary['size_ratio']:.4%} of the model)")


def bench_dtype(sources: dict[str, Path], base: Path, work: Path, dtype: str, repeats: int, env: dict[str, str],
                formats: list[str], floor_per: str = "run") -> dict[str, tuple[list[Run], list[float]]]:
    """Each output format of each source layout once per round, alternating which goes first, each with its
    floor right before it (`floor_per="round"`: the floors once at the start of each round, for every column
    of the round that reads the same source). Columns are keyed by `column(layout, format, sources)`."""
    columns = [(layout, f) for layout in sources for f in formats]
    results: dict[str, tuple[list[Run], list[float]]] = {column(lo, f, sources): ([], []) for lo, f in columns}

    def floors(layout: str) -> tuple[float, float, float]:
        files = source_files(sources[layout])
        settle()
        durable = floor_seconds(files, work / "floor.bin")
        settle()
        early = floor_seconds(files, work / "floor.bin", early_writeback=True)
        settle()
        cached = floor_seconds(files, work / "floor.bin", durable=False)
        settle()
        return durable, early, cached

    for i in range(repeats + 1):  # round 0 warms the page cache and the server; it is not counted
        round_floors = {layout: floors(layout) for layout in sources} if floor_per == "round" else None
        for layout, output_format in (columns if i % 2 == 0 else columns[::-1]):
            actor, rank_files = sources[layout], source_files(sources[layout])
            name = column(layout, output_format, sources)
            runs, test_times = results[name]
            target = work / f"out-{dtype}-{name.replace('+', '-').replace('=', '').replace(':', '-')}-{i}"
            floor, floor_wb, floor_cache = round_floors[layout] if round_floors else floors(layout)
            cached_in, unwritten_start = resident_fraction(rank_files), unwritten_mb()
            merge = timed_command(mergeflow_argv("merge", "--backend", "fsdp", "--local_dir", str(actor),
                                                 "--base_model", str(base), "--target_dir", str(target),
                                                 *output_args(output_format), "--dtype", dtype), env)
            kept = extraction_line(target)
            if kept is not None and i > 0:
                print(f"  {output_format} round {i}: {kept}", flush=True)
            # The run name the flow gives itself (training run and step of the source).
            from mergeflow.flows.run_names import export_label

            run, spans = flow_timeline(f"merge-{export_label(target, actor)}")
            flow_s = (run.end_time - run.start_time).total_seconds()
            if i > 0:
                runs.append(Run(floor, floor_wb, floor_cache, merge.wall_s, flow_s, merge.peak_private_kb, spans,
                                cached_in, unwritten_start, merge.unwritten_peak_mb,
                                run.start_time.timestamp() - merge.spawned, merge.exited - run.end_time.timestamp(),
                                merge.cpu_s))
                test_times.append(timed_command(mergeflow_argv("test", "--backend", "fsdp", "--test_hf_dir", str(target)), env).wall_s)
            shutil.rmtree(target)
    return results


def column(layout: str, output_format: str, sources: dict[str, Path]) -> str:
    """A timed column's name: the output format, prefixed with its source layout when several are timed."""
    return f"{layout}:{output_format}" if len(sources) > 1 else output_format


def ratio_pairs(layouts: tuple[str, ...], formats: list[str], sources: dict[str, Path]) -> list[tuple[str, str]]:
    """(column, reference) pairs: each format against its layout's first format, and each layout's
    format against the first layout's same format (the same model, read from another layout)."""
    pairs = [(column(lo, f, sources), column(lo, formats[0], sources)) for lo in layouts for f in formats[1:]]
    return pairs + [(column(lo, f, sources), column(layouts[0], f, sources)) for lo in layouts[1:] for f in formats]


def order_balanced(ratios: list[float]) -> list[float]:
    """The geometric mean of each pair of consecutive rounds (the columns alternate which runs first).

    The first export after the floors (or after a minute idle) runs slower on this VM, whatever the output:
    5-7 s more system time at real depth, where perf shows the copy into the page cache 2.4x slower. That
    fits the guest handing freed pages back to the host (its virtio-balloon offers free page reporting),
    the next writer into them paying the host's faults. A round's ratio is then biased towards whichever
    column ran first; a pair of rounds holds each order once, so the bias cancels in their geometric mean.
    """
    return [(a * b) ** 0.5 for a, b in zip(ratios[0::2], ratios[1::2], strict=False)]


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.ratio)[len(runs) // 2]


def report(preset: Preset, nbytes: int, tensors: int, dtype: str, runs: list[Run], test_times: list[float],
           layout: str = "verl", output_format: str = "transformer") -> None:
    mid = median_run(runs)
    shape = f"W={preset.world_size}, {nbytes / 1e9:.2f} GB of rank files" if layout == "verl" else \
        f"a one-writer DCP, {nbytes / 1e9:.2f} GB of .distcp"
    print(f"\n{preset.name} ({tensors} tensors, {shape}), --dtype {dtype}, --output_format {output_format}")
    print(f"  floor_s {statistics.median(r.floor_s for r in runs):.2f}  cli_s {statistics.median(r.cli_s for r in runs):.2f}  "
          f"ratio {statistics.median(r.ratio for r in runs):.2f}  (runs: "
          + ", ".join(f"{r.cli_s:.1f}/{r.floor_s:.1f}" for r in runs) + ")")
    print(f"  floor with early writeback (sync_file_range every 64 MB) {statistics.median(r.floor_wb_s for r in runs):.2f} s: "
          f"ratio {statistics.median(r.cli_s / r.floor_wb_s for r in runs):.2f}")
    print(f"  page-cache floor (no fsync) {statistics.median(r.floor_cache_s for r in runs):.2f} s: "
          f"ratio {statistics.median(r.cli_s / r.floor_cache_s for r in runs):.2f}")
    print(f"  in flow {statistics.median(r.flow_s for r in runs):.2f} s, outside the flow (imports, start-up, exit) "
          f"{statistics.median(r.cli_s - r.flow_s for r in runs):.2f} s; peak private "
          f"{max(r.peak_private_kb for r in runs) / 1024:.0f} MiB; write throughput "
          f"{nbytes / statistics.median(r.cli_s for r in runs) / 1e6:.0f} MB/s (rank bytes / cli_s)")
    print(f"  mergeflow test of the artifact: {statistics.median(test_times):.2f} s (median of {len(test_times)})")
    print("  each run: cli_s / durable floor; before + flow + after (s); CPU seconds (user + system) and the cores "
          "they kept busy; input in the page cache at its start; unwritten MB at its start and at most during it")
    for r in runs:
        print(f"    {r.cli_s:6.2f} / {r.floor_s:6.2f}  {r.before_s:5.2f} + {r.flow_s:6.2f} + {r.after_s:5.2f}  "
              f"cpu {r.cpu_s:6.1f} s ({r.cpu_s / r.cli_s:4.2f} cores)  "
              f"cached {r.cached_in:6.1%}  unwritten {r.unwritten_start_mb:7.0f} -> {r.unwritten_peak_mb:7.0f} MB")
    print(f"  task runs of the median run (ratio {mid.ratio:.2f}), seconds from the flow run's start:")
    print(f"    {'step':<22} {'runs':>4} {'from':>7} {'to':>7} {'task_s':>7}")
    for step, count, first, last, summed in summarise(mid.spans):
        print(f"    {step:<22} {count:>4} {first:>7.2f} {last:>7.2f} {summed:>7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="real-depth")
    parser.add_argument("--dtypes", nargs="+", default=["preserve", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", nargs="+", choices=["verl", "dcp"], default=["verl"], dest="layouts",
                        help="verl's W rank files, or the same model as a torch DCP written by one process; both "
                             "(`--layout verl dcp`): the same model saved both ways, interleaved, with dcp / verl")
    parser.add_argument("--output-format", nargs="+", default=["transformer"], dest="output_formats",
                        help="outputs to time, interleaved in each round (the first is the reference of the ratios); "
                             "FORMAT+FLAG=VALUE adds merge flags, e.g. single_file+quantize=fp8")
    parser.add_argument("--floor-per", choices=["run", "round"], default="run", dest="floor_per",
                        help="measure the floors before every run, or once per round (many formats: a shorter bench)")
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the built checkpoint (and print where)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    layouts = tuple(dict.fromkeys(args.layouts))
    work = Path(tempfile.mkdtemp(prefix=f"bench-{preset.name}-", dir=args.root))
    try:
        sources, base = build_checkpoints(work / "ckpt", preset, layouts)
        with prefect_api() as api_env:
            os.environ.update(api_env)  # this process reads the task runs from the same server
            env = dict(os.environ, PREFECT_TASKS_REFRESH_CACHE="true", HF_HUB_OFFLINE="1")
            # Bytecode caching as a user's Python has it (PYTHONDONTWRITEBYTECODE, set on this project's
            # machines, compiles mergeflow's modules from source in every command: 0.1 s).
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            tensors = _tensor_count(base)
            for dtype in args.dtypes:
                results = bench_dtype(sources, base, work, dtype, args.repeats, env, args.output_formats, args.floor_per)
                for layout in layouts:
                    nbytes = sum(p.stat().st_size for p in source_files(sources[layout]))
                    for output_format in args.output_formats:
                        runs, test_times = results[column(layout, output_format, sources)]
                        report(preset, nbytes, tensors, dtype, runs, test_times, layout, output_format)
                for name, ref in ratio_pairs(layouts, args.output_formats, sources):
                    ratios = [b.cli_s / a.cli_s for a, b in zip(results[ref][0], results[name][0], strict=True)]
                    print(f"\n{name} / {ref}, whole command, same rounds: median {statistics.median(ratios):.3f} "
                          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
                    balanced = order_balanced(ratios)
                    if balanced:
                        print(f"  order-balanced (each pair of rounds: one with each column first): median "
                              f"{statistics.median(balanced):.3f} (pairs: {', '.join(f'{r:.3f}' for r in balanced)})")
        print("\ncli_s: the whole `mergeflow merge` process; floor: read + write + sha256 (fsync) of the rank files in one "
              "pass, measured right before each run; ratio: median of per-run cli_s / floor")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _tensor_count(base: Path) -> int:
    from mergeflow.formats.safetensors_format import read_header

    return sum(len(read_header(p)[0]) for p in base.glob("*.safetensors"))


if __name__ == "__main__":
    raise SystemExit(main())
