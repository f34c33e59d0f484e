"""The `mergeflow` command line: every verb of mergeflow.flows.cli, plus `serve`, which runs the deployments.

`serve` lives here because it starts this layer's deployments (mergeflow.deployments.serve), and
imports run one way only, down from deployments to flows: flows.cli cannot import it, so this
module hands the verb to flows.cli's parser and dispatcher instead. Neither this module nor the
parser imports Prefect: `mergeflow --help` stays instant.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import threading
from typing import NoReturn, TypedDict

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_WORKERS,
    DTYPES,
    OUTPUT_FORMATS,
    QUANTIZATIONS,
    SIGN_KEY_ENV,
)
from mergeflow.deployments.resident import add_resident_command, cmd_resident, hand_over_to_resident
from mergeflow.flows import cli
from mergeflow.flows.ops_cli import add_smoke_flags, add_task_runner_flags
from mergeflow.ops.serve_settings import ServeSettings


def add_serve_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `serve` on the main parser's subcommands."""
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
    serve.add_argument("--quantize", default=DEFAULT_QUANTIZE, choices=QUANTIZATIONS,
                       help="weight encoding: fp8 (single_file: ComfyUI's scaled float8); none keeps --dtype")
    serve.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", type=int, default=DEFAULT_MAX_SHARD_SIZE,
                       help="bytes per output .safetensors file (2147483648 = 2 GiB)")
    serve.add_argument("--hf_upload_path", "--hf-upload-path", dest="hf_upload_path",
                       help="ORG/REPO to upload each export to; may use {run_name} and {step}")
    serve.add_argument("--private", action="store_true", help="create each Hub repo private")
    serve.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel shard writers per merge")
    serve.add_argument("--extract-lora", "--extract_lora", dest="extract_lora", type=int, metavar="RANK",
                       help="publish a LoRA of (trained - base) at this rank instead of the model")
    serve.add_argument("--extract-energy", "--extract_energy", dest="extract_energy", type=float, metavar="F",
                       help="with --extract-lora: per layer the smallest rank keeping ||dW_r||/||dW|| >= F, capped at RANK")
    serve.add_argument("--sign-key", "--sign_key", dest="sign_key", metavar="PEM", default=os.environ.get(SIGN_KEY_ENV) or None,
                       help=f"sign every export before publishing (OpenSSF model signing) with this elliptic-curve "
                            f"private key (default: ${SIGN_KEY_ENV})")
    add_smoke_flags(serve)
    serve.add_argument("--limit", type=int, default=1, help="merges running at the same time")
    add_task_runner_flags(serve)
    serve.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's console logs")


class ServeResult(TypedDict):
    """`mergeflow serve`'s JSON line once it stops: the deployments it served."""

    served: list[str]
    stopped: bool


def cmd_serve(args: argparse.Namespace) -> ServeResult:
    from mergeflow.flows.events import use_prefect_api

    settings = ServeSettings(
        base_model=args.base_model, target_root=args.target_root, output_format=args.output_format, dtype=args.dtype,
        max_shard_size=args.max_shard_size, hf_upload_path=args.hf_upload_path, private=args.private,
        workers=args.workers, task_runner=args.task_runner, dask_address=args.dask_address,
        checkpoint_roots=tuple(args.checkpoint_roots), allowed_base_models=tuple(args.allowed_base_models),
        quantize=args.quantize,
        extract_lora=args.extract_lora, extract_energy=args.extract_energy, sign_key=args.sign_key,
        smoke=args.smoke, smoke_device=args.smoke_device, base_model_id=args.base_model_id,
    ).checked()  # merge's pre-flight on serve's settings: what every triggered run would fail on, before any server
    use_prefect_api("serve")  # before Prefect is imported (the next import): it reads PREFECT_API_URL then
    from mergeflow.deployments.serve import serve_deployments, served_names

    try:
        serve_deployments(settings, limit=args.limit)
    except KeyboardInterrupt:
        pass  # the runner has stopped; Ctrl-C is how a served process ends
    return {"served": served_names(), "stopped": True}


def _add_verbs(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    add_serve_command(sub)
    add_resident_command(sub)


VERBS = cli.Verbs(add=_add_verbs, commands={"serve": cmd_serve, "resident": cmd_resident})


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(VERBS)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (what tests call in-process)."""
    return cli.main(argv, VERBS)


def entry() -> NoReturn:
    """The console script `mergeflow` and `python -m mergeflow`: a whole process, which ends here.

    Where a resident process serves this environment (`mergeflow resident start`), the command runs
    there, forked from an interpreter that has already imported torch and Prefect, and this process
    ends as it ended; otherwise it runs here.
    """
    hand_over_to_resident(sys.argv)  # returns only where no resident serves this command
    run_command()


def served_command() -> NoReturn:
    """A command in a resident's forked child: entry() without the hand-off, ending as Python would for
    whatever escapes it (argparse's SystemExit for --help or a bad flag, an uncaught Ctrl-C)."""
    try:
        run_command()
    except SystemExit as exc:  # as Python ends on one: None is 0, an int is the status, anything else is printed
        if exc.code is None or isinstance(exc.code, int):
            end_process(exc.code or 0)
        print(exc.code, file=sys.stderr)
        end_process(1)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        end_process(130, by_signal=signal.SIGINT)  # Python's own end for an uncaught KeyboardInterrupt
    except BaseException:  # noqa: BLE001 (as an uncaught exception ends a cold command)
        import traceback

        traceback.print_exc()
        end_process(1)


def run_command() -> NoReturn:
    """Run the command of sys.argv in this process and end it."""
    # Importing torch and Prefect allocates a few million objects that live until the end; at
    # Python's default thresholds (700, 10, 10) that triggers five full collections of a growing
    # heap (0.5-0.9 s of a tiny merge's CPU) that find nothing. A larger first generation still
    # collects cyclic garbage, every 50,000 allocations instead of 700, so a long `serve` stays flat.
    gc.set_threshold(50_000, 10, 10)
    from mergeflow.io.heap import return_large_buffers

    return_large_buffers()  # freed tensors go back to the system: private memory stays flat (mergeflow/io/heap.py)
    code = main()  # an exception (argparse's SystemExit, Ctrl-C) takes Python's own exit path
    end_process(code)


def end_process(code: int, by_signal: int | None = None) -> NoReturn:
    """Exit with `code` after everything that Python's exit does and anyone can observe, without
    tearing the heap down object by object.

    Once torch and Prefect are imported, the interpreter's own shutdown spends about 0.7 s of CPU on a
    full garbage collection that finds nothing (what they built stays reachable from their modules)
    and then 0.1 s of wall clock freeing modules one by one, after the output is published and
    reported. What can be observed is done here, in the order Python's finalization does it: other
    non-daemon threads are joined, with the executors' workers (threading's own shutdown); atexit
    handlers run (Prefect's log and event drains, logging's flush and close, temporary directories'
    removal, multiprocessing's children); stdout and stderr are flushed. Then the process ends.
    """
    gc.freeze()  # a handler that allocates much must not start a full collection of everything
    shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first (3.11-3.13)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: Python's exit status for an unflushable stdout
            code = code or 120
    if by_signal is not None:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code)
