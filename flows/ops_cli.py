"""The operations verbs of the command line: watch, backfill, staging list|clean (serve: mergeflow.deployments.cli)."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_TASK_RUNNER,
    DEFAULT_WORKERS,
    DTYPES,
    MAX_WORKERS,
    OUTPUT_FORMATS,
    QUANTIZATIONS,
    SIGN_KEY_ENV,
    SMOKE_DEVICES,
    TASK_RUNNERS,
)
from mergeflow.errors import ConcurrentExportError
from mergeflow.flows.fan_out import MERGE_DEPLOYMENT
from mergeflow.ops.backfill import BackfillSettings


def positive_bytes(text: str) -> int:
    """A --max-shard-size: a whole number of bytes above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer number of bytes") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def worker_count(text: str) -> int:
    """A backfill's --workers, refused before any step is dispatched (each step's export would refuse it alone)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_WORKERS}")
    return value


def add_task_runner_flags(parser: argparse.ArgumentParser) -> None:
    """--task-runner thread|dask and --dask-address (merge and serve)."""
    parser.add_argument("--task-runner", "--task_runner", dest="task_runner", default=DEFAULT_TASK_RUNNER, choices=TASK_RUNNERS,
                        help="run rank and shard tasks in threads or on a Dask cluster")
    parser.add_argument("--dask-address", "--dask_address", dest="dask_address", default=None,
                        help="scheduler address of a running Dask cluster (default: a temporary local cluster)")


def add_ops_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register watch and staging on the main parser's subcommands."""
    watch = sub.add_parser("watch", help="emit a checkpoint event for every completed checkpoint of a training run")
    watch.add_argument("train_dir", metavar="TRAIN_OUTPUT_DIR", help="verl's output directory (holds global_step_N/)")
    watch.add_argument("--base_model", "--base-model", dest="base_model", help="base model named in each event")
    watch.add_argument("--target-root", "--target_root", dest="target_root",
                       help="name targets TARGET_ROOT/<run_name>/global_step_<step> in each event (default: serve's)")
    watch.add_argument("--run-name", "--run_name", dest="run_name", help="run name in each event (default: the directory name)")
    watch.add_argument("--stable-seconds", dest="stable_seconds", type=float, default=5.0,
                       help="a checkpoint must stay unchanged this long before it is announced")
    watch.add_argument("--poll-seconds", dest="poll_seconds", type=float, default=1.0,
                       help="how often the directory is re-scanned besides file notifications")
    watch.add_argument("--state-file", dest="state_file", help="where emitted checkpoints are remembered")
    watch.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")

    staging = sub.add_parser("staging", help="list or remove the work kept by failed or interrupted exports")
    staging.add_argument("action", choices=["list", "clean"], help="list the kept staging directories, or remove them")
    staging.add_argument("dir", nargs="?", default=".", help="directory to search (targets' parent, or above; default .)")
    staging.add_argument("--older-than", dest="older_than", type=float, default=0.0,
                         help="clean only staging idle for more than this many seconds")
    staging.add_argument("--debug", action="store_true", help="show tracebacks")


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
    parser.add_argument("--quantize", default=DEFAULT_QUANTIZE, choices=QUANTIZATIONS,
                        help="weight encoding: fp8 (single_file: ComfyUI's scaled float8); none keeps --dtype")
    parser.add_argument("--allow-unchanged", "--allow_unchanged", dest="allow_unchanged", action="store_true",
                        help="publish a step even when every tensor equals the base's")
    parser.add_argument("--extract-lora", "--extract_lora", dest="extract_lora", type=int, metavar="RANK",
                        help="publish a LoRA of (trained - base) at this rank instead of the model")
    parser.add_argument("--extract-energy", "--extract_energy", dest="extract_energy", type=float, metavar="F",
                        help="with --extract-lora: per layer the smallest rank keeping ||dW_r||/||dW|| >= F, capped at RANK")
    parser.add_argument("--sign-key", "--sign_key", dest="sign_key", metavar="PEM",
                        help=f"sign each step before publishing (OpenSSF model signing) with this elliptic-curve private "
                             f"key (default: ${SIGN_KEY_ENV})")
    add_smoke_flags(parser)
    parser.add_argument("--stable-seconds", dest="stable_seconds", type=float, default=5.0,
                        help="a checkpoint must stay unchanged this long to count as complete (as for watch)")
    parser.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", type=positive_bytes,
                        default=DEFAULT_MAX_SHARD_SIZE, help="bytes per output .safetensors file (2147483648 = 2 GiB)")
    parser.add_argument("--workers", type=worker_count, default=DEFAULT_WORKERS, help="parallel rank loaders and shard writers per step")
    add_task_runner_flags(parser)
    parser.add_argument("--deployment", nargs="?", const=MERGE_DEPLOYMENT, metavar="FLOW/DEPLOYMENT",
                        help=f"fan out: each step as one run of this deployment (default {MERGE_DEPLOYMENT}) on its work "
                             "pool's workers, all dispatched at once, the pool's and the deployment's concurrency limits "
                             "pacing them; the server is PREFECT_API_URL's. Without it each step runs here, in turn")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")


def add_smoke_flags(parser: argparse.ArgumentParser) -> None:
    """--smoke, --smoke-device and --base-model-id: the runtime check and the model card's base (merge, serve, backfill)."""
    parser.add_argument("--smoke", action="store_true",
                        help="before publishing, load the artifact with Diffusers and run one denoising step; "
                             "a failure publishes nothing")
    parser.add_argument("--smoke-device", "--smoke_device", dest="smoke_device", default="cpu", choices=SMOKE_DEVICES,
                        help="where --smoke runs (cuda: refused where there is none)")
    parser.add_argument("--base-model-id", "--base_model_id", dest="base_model_id", metavar="ORG/NAME",
                        help="the base's Hub id, for the model card's base_model (when --base_model is a local folder)")

def backfill_settings(args: argparse.Namespace) -> BackfillSettings:
    return BackfillSettings(train_dir=args.train_dir, base_model=args.base_model, target_root=args.target_root,
                            run_name=args.run_name, output_format=args.output_format, dtype=args.dtype, quantize=args.quantize,
                            allow_unchanged=args.allow_unchanged, stable_seconds=args.stable_seconds,
                            extract_lora=args.extract_lora, extract_energy=args.extract_energy, sign_key=args.sign_key,
                            smoke=args.smoke, smoke_device=args.smoke_device, base_model_id=args.base_model_id,
                            max_shard_size=args.max_shard_size, workers=args.workers)


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM end the watcher cleanly, so it can report what it emitted."""
    stop = threading.Event()
    handler = lambda *_: stop.set()  # noqa: E731
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class EmittedCheckpoint(TypedDict):
    step: int
    local_dir: str


class WatchResult(TypedDict):
    """`mergeflow watch`'s JSON line when it stops: the checkpoints it announced."""

    emitted: list[EmittedCheckpoint]


class StagingList(TypedDict):
    """`mergeflow staging list`: each kept staging directory (StagingInfo.to_dict)."""

    staging: list[dict[str, object]]


def cmd_watch(args: argparse.Namespace) -> WatchResult:
    from mergeflow.flows.events import use_prefect_api
    from mergeflow.flows.watch import watch
    from mergeflow.ops.watch import training_dir

    training_dir(args.train_dir)  # a wrong path is refused before any server starts
    use_prefect_api("watch", own_server=False)
    template = None
    if args.target_root:
        root = Path(args.target_root).expanduser().resolve()
        template = str(root / "{run_name}" / "global_step_{step}")
    base = str(Path(args.base_model).expanduser().resolve()) if args.base_model else None
    with _stop_on_signals() as stop:
        emitted = watch(
            args.train_dir, base_model=base, target_dir_template=template, run_name=args.run_name,
            stable_seconds=args.stable_seconds, poll_seconds=args.poll_seconds, state_file=args.state_file, stop_event=stop,
        )
    return {"emitted": [{"step": c.step, "local_dir": str(c.actor_dir)} for c in emitted]}


def cmd_staging(args: argparse.Namespace) -> StagingList | dict[str, list[str]]:
    from mergeflow.io.staging import clean_staging, list_staging

    root = Path(args.dir)
    if args.action == "list":
        return {"staging": [info.to_dict() for info in list_staging(root)]}
    result = clean_staging(root, older_than=args.older_than)
    if result["refused"]:
        raise ConcurrentExportError(
            f"removed {len(result['removed'])} staging dir(s); kept {len(result['refused'])} that a running export "
            f"holds: {', '.join(result['refused'])}"
        )
    return result


OPS_COMMANDS: dict[str, Callable[[argparse.Namespace], Mapping[str, object]]] = {
    "watch": cmd_watch,
    "staging": cmd_staging,
}
