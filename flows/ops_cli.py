"""The operations verbs of the command line: serve, watch, backfill, staging list|clean."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_TASK_RUNNER,
    DEFAULT_WORKERS,
    DTYPES,
    OUTPUT_FORMATS,
    TASK_RUNNERS,
)
from mergeflow.errors import ConcurrentExportError
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.ops.backfill import BackfillSettings


def add_task_runner_flags(parser: argparse.ArgumentParser) -> None:
    """--task-runner thread|dask and --dask-address (merge and serve)."""
    parser.add_argument("--task-runner", "--task_runner", dest="task_runner", default=DEFAULT_TASK_RUNNER, choices=TASK_RUNNERS,
                        help="run rank and shard tasks in threads or on a Dask cluster")
    parser.add_argument("--dask-address", "--dask_address", dest="dask_address", default=None,
                        help="scheduler address of a running Dask cluster (default: a temporary local cluster)")


def add_ops_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register serve, watch and staging on the main parser's subcommands."""
    serve = sub.add_parser("serve", help="serve the merge (event-triggered), validate and backfill deployments; "
                                    "prints one line per run started and finished")
    serve.add_argument("--base_model", "--base-model", dest="base_model", required=True, help="local base model directory")
    serve.add_argument("--target-root", "--target_root", dest="target_root", required=True,
                       help="exports go to TARGET_ROOT/<run_name>/global_step_<step>; an event's target_dir must lie below it")
    serve.add_argument("--checkpoint-root", "--checkpoint_root", dest="checkpoint_roots", action="append", required=True,
                       metavar="DIR", help="an event's local_dir must lie below DIR (symlinks followed); repeat for several roots")
    serve.add_argument("--allow-base-model", "--allow_base_model", dest="allowed_base_models", action="append", default=[],
                       metavar="DIR", help="a base model an event may name besides --base_model; repeat for several")
    serve.add_argument("--output_format", "--output-format", dest="output_format", default=DEFAULT_OUTPUT_FORMAT, choices=OUTPUT_FORMATS,
                       help="what each triggered export writes: a whole pipeline, or the transformer alone")
    serve.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES, help="dtype of the written weights (preserve: as trained)")
    serve.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", type=int, default=DEFAULT_MAX_SHARD_SIZE,
                       help="bytes per output .safetensors file (2147483648 = 2 GiB)")
    serve.add_argument("--hf_upload_path", "--hf-upload-path", dest="hf_upload_path",
                       help="ORG/REPO to upload each export to; may use {run_name} and {step}")
    serve.add_argument("--private", action="store_true", help="create each Hub repo private")
    serve.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel shard writers per merge")
    serve.add_argument("--limit", type=int, default=1, help="merges running at the same time")
    add_task_runner_flags(serve)
    serve.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")

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
    parser.add_argument("--allow-unchanged", "--allow_unchanged", dest="allow_unchanged", action="store_true",
                        help="publish a step even when every tensor equals the base's")
    parser.add_argument("--stable-seconds", dest="stable_seconds", type=float, default=5.0,
                        help="a checkpoint must stay unchanged this long to count as complete (as for watch)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")


def backfill_settings(args: argparse.Namespace) -> BackfillSettings:
    return BackfillSettings(train_dir=args.train_dir, base_model=args.base_model, target_root=args.target_root,
                            run_name=args.run_name, output_format=args.output_format, dtype=args.dtype,
                            allow_unchanged=args.allow_unchanged, stable_seconds=args.stable_seconds)


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


def cmd_serve(args: argparse.Namespace) -> JsonObject:
    from mergeflow.flows.events import use_prefect_api
    from mergeflow.flows.serve_settings import ServeSettings

    settings = ServeSettings(
        base_model=args.base_model, target_root=args.target_root, output_format=args.output_format, dtype=args.dtype,
        max_shard_size=args.max_shard_size, hf_upload_path=args.hf_upload_path, private=args.private,
        workers=args.workers, task_runner=args.task_runner, dask_address=args.dask_address,
        checkpoint_roots=tuple(args.checkpoint_roots), allowed_base_models=tuple(args.allowed_base_models),
    ).checked()  # merge's pre-flight on serve's settings: what every triggered run would fail on, before any server
    use_prefect_api("serve")  # before Prefect is imported (the next import): it reads PREFECT_API_URL then
    from mergeflow.flows.serve import serve_deployments, served_names

    try:
        serve_deployments(settings, limit=args.limit)
    except KeyboardInterrupt:
        pass  # the runner has stopped; Ctrl-C is how a served process ends
    return {"served": served_names(), "stopped": True}


def cmd_watch(args: argparse.Namespace) -> JsonObject:
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


def cmd_staging(args: argparse.Namespace) -> JsonObject:
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


OPS_COMMANDS: dict[str, Callable[[argparse.Namespace], JsonObject]] = {
    "serve": cmd_serve,
    "watch": cmd_watch,
    "staging": cmd_staging,
}
