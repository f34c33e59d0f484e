"""`mergeflow backfill TRAIN_DIR`: export every complete `global_step_N` that has no artifact yet.

Steps are taken oldest first. A step whose target exists is skipped (published earlier); a step
the watcher would not announce yet (`mergeflow.ops.watch`: the same file-set checks, and the
same "unchanged for stable_seconds" rule) is reported incomplete and left alone; every other
step is exported to `TARGET_ROOT/<run_name>/global_step_<N>`, the target the served deployment
gives a watcher's event (`mergeflow.ops.step_targets.default_target`), so backfill, watch + serve and
reruns all agree on where a step lives. A kept staging directory of that target (an export
killed half-way) is resumed by the export itself: the merge reuses every verified shard.

One line per step; the first failed export stops the backfill (rerun it to resume).
No Prefect here: the flow (flows/backfill_flow.py) and the command line (flows/ops_cli.py) run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, TypedDict

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_WORKERS,
    Dtype,
    ModelMergerConfig,
    OutputFormat,
    Quantize,
    SmokeDevice,
)
from mergeflow.errors import UsageError
from mergeflow.io.staging import staging_dirs_of
from mergeflow.ops.step_targets import default_target
from mergeflow.ops.watch import find_checkpoints, inspect_checkpoint

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
    quantize: Quantize = DEFAULT_QUANTIZE
    extract_lora: int | None = None  # --extract-lora: each step published as a LoRA of (trained - base)
    extract_energy: float | None = None
    sign_key: str | None = None  # --sign-key: each step signed before it is published (None: MERGEFLOW_SIGN_KEY)
    smoke: bool = False  # the runtime check before each step's publication
    smoke_device: SmokeDevice = "cpu"
    base_model_id: str | None = None  # the model cards' base_model


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
                               quantize=settings.quantize,
                               allow_unchanged=settings.allow_unchanged, max_shard_size=settings.max_shard_size,
                               workers=settings.workers, extract_lora=settings.extract_lora,
                               extract_energy=settings.extract_energy, sign_key=settings.sign_key, smoke=settings.smoke,
                               smoke_device=settings.smoke_device, base_model_id=settings.base_model_id)
    merge(config)  # a failure propagates: the steps after it wait for a rerun, which resumes this one
    return StepResult(step, "done", str(target), "resumed" if resumed else "")


class StepRecord(TypedDict):
    """One StepResult in the summary's JSON."""

    step: int
    status: StepStatus
    target: str
    detail: str


class BackfillSummary(TypedDict):
    """`mergeflow backfill`'s last JSON line, and the backfill flow's result: every step, oldest first."""

    steps: list[StepRecord]


def summary(results: list[StepResult]) -> BackfillSummary:
    return {"steps": [StepRecord(**asdict(r)) for r in results]}
