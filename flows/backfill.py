"""`mergeflow backfill TRAIN_DIR`: export every complete `global_step_N` that has no artifact yet.

Steps are taken oldest first. A step whose target exists is skipped (published earlier); a step
the watcher would not announce yet (`mergeflow.flows.watch`: the same file-set checks, and the
same "unchanged for stable_seconds" rule) is reported incomplete and left alone; every other
step is exported to `TARGET_ROOT/<run_name>/global_step_<N>`, the target the served deployment
gives a watcher's event (`flows/checkpoint.py: default_target`), so backfill, watch + serve and
reruns all agree on where a step lives. A kept staging directory of that target (an export
killed half-way) is resumed by the export itself: the merge reuses every verified shard.

One line per step; the first failed export stops the backfill (rerun it to resume).
This module imports no Prefect: the parser is built on every `mergeflow --help`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_WORKERS,
    DTYPES,
    OUTPUT_FORMATS,
    Dtype,
    ModelMergerConfig,
    OutputFormat,
)
from mergeflow.errors import UsageError
from mergeflow.flows.watch import find_checkpoints, inspect_checkpoint
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.io.staging import staging_dirs_of

StepStatus = Literal["done", "skipped", "incomplete", "failed"]
Merge = Callable[[ModelMergerConfig], object]  # runs one export (merge_model, or merge_flow as a subflow)


@dataclass(frozen=True)
class BackfillSettings:
    """What every step's export shares."""

    train_dir: str
    base_model: str
    target_root: str
    run_name: str | None = None  # default: the train dir's name, as the watcher names it
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT
    dtype: Dtype = DEFAULT_DTYPE
    allow_unchanged: bool = False
    stable_seconds: float = 5.0  # the watcher's default
    # The served deployment passes serve's own, so a backfilled step is sharded like a triggered one.
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    workers: int = DEFAULT_WORKERS


@dataclass(frozen=True)
class StepResult:
    step: int
    status: StepStatus
    target: str
    detail: str = ""  # why incomplete or skipped, what failed, or "resumed"

    def line(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"global_step_{self.step}: {self.status}{detail} -> {self.target}"


def step_target(settings: BackfillSettings, step: int, actor_dir: Path) -> Path:
    # flows/checkpoint.py imports Prefect: only once a backfill runs.
    from mergeflow.flows.checkpoint import default_target

    train_dir = Path(settings.train_dir).expanduser().absolute()
    return default_target(str(Path(settings.target_root).expanduser().absolute()), settings.run_name or train_dir.name,
                          step, actor_dir)


def complete_reason(actor_dir: Path, stable_seconds: float) -> str:
    """'' when the watcher would announce this checkpoint now, else why not."""
    first = inspect_checkpoint(actor_dir)
    if not first.ready:
        return first.reason
    if stable_seconds > 0:
        time.sleep(stable_seconds)
    second = inspect_checkpoint(actor_dir)
    if not second.ready or second.fingerprint != first.fingerprint:
        return f"files changed within {stable_seconds:g} s (still being written?)"
    return ""


def backfill(settings: BackfillSettings, merge: Merge, report: Callable[[StepResult], None] = lambda r: None) -> list[StepResult]:
    """Export the unpublished complete steps of settings.train_dir, oldest first; `report` sees each line."""
    train_dir = Path(settings.train_dir).expanduser().absolute()
    if not train_dir.is_dir():
        raise UsageError(f"{settings.train_dir} is not a directory; pass verl's output directory (it holds global_step_N/)")
    results: list[StepResult] = []
    for candidate in find_checkpoints(train_dir):
        target = step_target(settings, candidate.step, candidate.actor_dir)
        try:
            result = _one_step(settings, candidate.step, candidate.actor_dir, target, merge)
        except Exception as exc:  # the line first, then the error itself ends the command (one line, its exit code)
            report(StepResult(candidate.step, "failed", str(target), str(exc)))
            raise
        results.append(result)
        report(result)
    return results


def _one_step(settings: BackfillSettings, step: int, actor_dir: Path, target: Path, merge: Merge) -> StepResult:
    if target.exists():
        return StepResult(step, "skipped", str(target), "already published")
    reason = complete_reason(actor_dir, settings.stable_seconds)
    if reason:
        return StepResult(step, "incomplete", str(target), reason)
    resumed = bool(staging_dirs_of(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    config = ModelMergerConfig(operation="merge", local_dir=str(actor_dir), base_model=settings.base_model,
                               target_dir=str(target), output_format=settings.output_format, dtype=settings.dtype,
                               allow_unchanged=settings.allow_unchanged, max_shard_size=settings.max_shard_size,
                               workers=settings.workers)
    merge(config)  # a failure propagates: the steps after it wait for a rerun, which resumes this one
    return StepResult(step, "done", str(target), "resumed" if resumed else "")


def add_backfill_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `backfill` on the main parser's subcommands."""
    parser = sub.add_parser(
        "backfill", help="export every complete global_step_N of a training run that has no artifact yet",
        description="Export, oldest first, every complete TRAIN_DIR/global_step_N/actor whose target "
                    "TARGET_ROOT/<run_name>/global_step_N does not exist yet (the layout serve gives watched "
                    "checkpoints). Published steps are skipped, incomplete ones reported, a kept staging resumed; "
                    "one line per step, then the JSON summary.")
    parser.add_argument("train_dir", metavar="TRAIN_DIR", help="verl's output directory (holds global_step_N/)")
    parser.add_argument("--base_model", "--base-model", dest="base_model", required=True, help="local base model directory")
    parser.add_argument("--target-root", "--target_root", dest="target_root", required=True,
                        help="step N is published to TARGET_ROOT/<run_name>/global_step_N")
    parser.add_argument("--run-name", "--run_name", dest="run_name", help="run name in the targets (default: TRAIN_DIR's name)")
    parser.add_argument("--output_format", "--output-format", dest="output_format", default=DEFAULT_OUTPUT_FORMAT,
                        choices=OUTPUT_FORMATS, help="a whole pipeline with the trained transformer, or the transformer alone")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES, help="dtype of the written weights (preserve: as trained)")
    parser.add_argument("--allow-unchanged", "--allow_unchanged", dest="allow_unchanged", action="store_true",
                        help="publish a step even when every tensor equals the base's")
    parser.add_argument("--stable-seconds", dest="stable_seconds", type=float, default=5.0,
                        help="a checkpoint must stay unchanged this long to count as complete (as for watch)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")


def settings_from(args: argparse.Namespace) -> BackfillSettings:
    return BackfillSettings(train_dir=args.train_dir, base_model=args.base_model, target_root=args.target_root,
                            run_name=args.run_name, output_format=args.output_format, dtype=args.dtype,
                            allow_unchanged=args.allow_unchanged, stable_seconds=args.stable_seconds)


def summary(results: list[StepResult]) -> JsonObject:
    return {"steps": [asdict(r) for r in results]}
