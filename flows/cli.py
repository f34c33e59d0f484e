"""The command line: a drop-in for `python -m verl_omni.model_merger merge|test`, plus our verbs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from mergeflow.config import (
    ADAPTER_FORMATS,
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_WORKERS,
    DTYPES,
    OUTPUT_FORMATS,
    QKV_LAYOUTS,
    QUANTIZATIONS,
    SIGN_KEY_ENV,
    SMOKE_DEVICES,
    SMOKE_DTYPES,
    ModelMergerConfig,
    PublishedMerge,
    UploadSummary,
)
from mergeflow.errors import MergeflowError, one_line
from mergeflow.flows.interrupts import api_answers
from mergeflow.flows.ops_cli import (
    OPS_COMMANDS,
    add_backfill_command,
    add_ops_commands,
    add_smoke_flags,
    add_task_runner_flags,
    backfill_settings,
    positive_bytes,
)
from mergeflow.io.os_errors import typed_os_error
from mergeflow.ops.backfill import BackfillSettings, BackfillSummary, StepResult
from mergeflow.ops.signals import (
    end_soon,
    exit_status_of,
    first_signal,
    interrupted_line,
    interrupts_stop_the_export,
)

if TYPE_CHECKING:  # imported where each command runs (the progress module imports Prefect): here for the annotations only
    from mergeflow.export.check.artifact_check import IntegrityResult
    from mergeflow.flows.demo import DemoResult
    from mergeflow.flows.progress import FlowRunLinks
    from mergeflow.ops.local_server import ServerStatus, ServerStopped
    from mergeflow.sources.base import CheckpointDescription


class _Parser(argparse.ArgumentParser):
    """argparse with one line for a bad flag (the valid values included) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


class _Help(argparse.HelpFormatter):
    """Every option's help says when it is required and what its default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required and action.option_strings:
            text = f"(required) {text}"
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _versions() -> str:
    """mergeflow's version and the libraries that decide its output (read from metadata: no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"mergeflow {of('mergeflow')} (torch {of('torch')}, diffusers {of('diffusers')}, prefect {of('prefect')}, safetensors {of('safetensors')})"


class _Version(argparse.Action):
    """`--version`: one unwrapped line (argparse's own version action wraps it at the terminal width)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(_versions())
        parser.exit(0)


def _flag(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> None:
    parser.add_argument(*names, **kwargs)


def _debug(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--debug", action="store_true", help="show tracebacks and Prefect's console logs")


def _common(parser: argparse.ArgumentParser, *, local_dir_required: bool = False) -> None:
    _flag(parser, "--backend", required=True, choices=["fsdp"], help="checkpoint backend (only fsdp)")
    _flag(parser, "--local_dir", "--local-dir", dest="local_dir", required=local_dir_required,
          help="the checkpoint's actor directory (global_step_N/actor)")
    _flag(parser, "--hf_model_config_path", "--hf-model-config-path", dest="hf_model_config_path",
          help="directory with the trained config.json (default: LOCAL_DIR/huggingface)")
    _flag(parser, "--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
          help="allow copying .py files of a remote-code base")
    _debug(parser)


# A command: its arguments in, out the JSON object it prints as its last line (each command's own TypedDict).
Command = Callable[[argparse.Namespace], Mapping[str, object]]


@dataclass(frozen=True)
class Verbs:
    """Verbs a layer above adds to this command line (deployments/cli.py: `serve`): their parsers and handlers."""

    add: Callable[[argparse._SubParsersAction], None]  # type: ignore[type-arg]
    commands: dict[str, Command]


NO_VERBS = Verbs(add=lambda sub: None, commands={})


def build_parser(more: Verbs = NO_VERBS) -> argparse.ArgumentParser:
    parser = _Parser(prog="mergeflow", description="Export FSDP diffusion checkpoints as verified Diffusers artifacts.",
                     formatter_class=_Help)
    parser.add_argument("--version", action=_Version, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_Help)

    merge = command("merge", "export a checkpoint")
    _common(merge, local_dir_required=True)
    _flag(merge, "--target_dir", "--target-dir", dest="target_dir", required=True, help="output directory (must not exist)")
    _flag(merge, "--base_model", "--base-model", dest="base_model", required=True,
          help="local base pipeline or transformer directory")
    _flag(merge, "--output_format", "--output-format", dest="output_format", default=DEFAULT_OUTPUT_FORMAT, choices=OUTPUT_FORMATS,
          help="a whole pipeline with the trained transformer, or the transformer alone")
    _flag(merge, "--dtype", default=DEFAULT_DTYPE, choices=DTYPES, help="dtype of the written weights (preserve: as trained)")
    _flag(merge, "--max_shard_size", "--max-shard-size", dest="max_shard_size", type=positive_bytes, default=DEFAULT_MAX_SHARD_SIZE,
          help="bytes per output .safetensors file (2147483648 = 2 GiB)")
    _flag(merge, "--hf_upload_path", "--hf-upload-path", dest="hf_upload_path", help="ORG/REPO to upload to after publishing")
    _flag(merge, "--private", action="store_true", help="create the Hub repo private")
    _flag(merge, "--trust-checkpoint", "--trust_checkpoint", dest="trust_checkpoint", action="store_true",
          help="permit full (unsafe) unpickling of rank files the safe loader refuses")
    _flag(merge, "--adapter-name", "--adapter_name", dest="adapter_name", default="default",
          help="which PEFT adapter of a LoRA checkpoint to export or fuse")
    _flag(merge, "--fuse-lora", "--fuse_lora", dest="fuse_lora", action="store_true",
          help="fuse a LoRA checkpoint into the base weights instead of exporting the adapter")
    _flag(merge, "--adapter-format", "--adapter_format", dest="adapter_format", default="peft", choices=ADAPTER_FORMATS,
          help="key names of an exported adapter")
    _flag(merge, "--adapter-config", "--adapter_config", dest="adapter_config", help="PEFT adapter_config.json of the trained adapter")
    _flag(merge, "--component", default="transformer", help="pipeline component the checkpoint replaces")
    _flag(merge, "--qkv-layout", "--qkv_layout", dest="qkv_layout", default="interleaved", choices=QKV_LAYOUTS,
          help="fused QKV layout of MiniMax H3's native package")
    _flag(merge, "--quantize", default=DEFAULT_QUANTIZE, choices=QUANTIZATIONS,
          help="weight encoding: fp8 (single_file: ComfyUI's scaled float8), bf16 or q8_0 (gguf); none keeps --dtype")
    _flag(merge, "--extract-lora", "--extract_lora", dest="extract_lora", type=int, metavar="RANK",
          help="publish a LoRA of (trained - base) at this rank (truncated SVD per linear) instead of the model")
    _flag(merge, "--extract-energy", "--extract_energy", dest="extract_energy", type=float, metavar="F",
          help="with --extract-lora: per layer the smallest rank keeping ||dW_r||/||dW|| >= F, capped at RANK")
    _flag(merge, "--workers", type=int, default=DEFAULT_WORKERS, help="parallel shard writers")
    _flag(merge, "--allow-unchanged", "--allow_unchanged", dest="allow_unchanged", action="store_true",
          help="publish even when every exported tensor equals the base's bit for bit (refused otherwise)")
    _flag(merge, "--sign-key", "--sign_key", dest="sign_key", metavar="PEM",
          help=f"sign the artifact before publishing (OpenSSF model signing) with this elliptic-curve private key "
               f"(default: ${SIGN_KEY_ENV})")
    add_smoke_flags(merge)
    _flag(merge, "--smoke-dtype", "--smoke_dtype", dest="smoke_dtype", default="float32", choices=SMOKE_DTYPES,
          help="dtype the --smoke check loads and runs the model in")
    add_task_runner_flags(merge)

    test = command("test", "validate a published artifact without its source")
    _common(test)
    _flag(test, "--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True,
          help="the artifact (or a failed export's staging directory)")
    _flag(test, "--verify-key", "--verify_key", dest="verify_key", metavar="PUB",
          help="also verify the artifact's OpenSSF model signature (model.sig) with this elliptic-curve public key")

    smoke = command("smoke", "runtime check: load a published artifact with Diffusers and run one denoising step")
    _flag(smoke, "--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True, help="the published artifact")
    _flag(smoke, "--device", default="cpu", choices=SMOKE_DEVICES, help="where to run it (cuda: refused where there is none)")
    _flag(smoke, "--dtype", default="float32", choices=SMOKE_DTYPES, help="dtype the model is loaded and run in")
    _flag(smoke, "--base_model", "--base-model", dest="base_model",
          help="local base pipeline or transformer a LoRA adapter is loaded onto")
    _flag(smoke, "--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
          help="allow a pipeline's own code (e.g. Boogu) to load")
    _debug(smoke)

    inspect = command("inspect", "describe a checkpoint without exporting it")
    _flag(inspect, "--local_dir", "--local-dir", dest="local_dir", required=True, help="the checkpoint's actor directory")
    _flag(inspect, "--trust-checkpoint", "--trust_checkpoint", dest="trust_checkpoint", action="store_true",
          help="permit full (unsafe) unpickling of rank files the safe loader refuses")
    _debug(inspect)

    upload = command("upload", "upload (or re-upload) a published artifact to the Hub and verify it")
    _flag(upload, "--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True, help="the published artifact")
    _flag(upload, "--hf_upload_path", "--hf-upload-path", dest="hf_upload_path", required=True, help="ORG/REPO on the Hub")
    _flag(upload, "--private", action="store_true", help="create the Hub repo private")
    _debug(upload)

    verify = command("verify-upload", "check that a Hub repo holds exactly a published artifact")
    _flag(verify, "--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True, help="the published artifact")
    _flag(verify, "--hf_upload_path", "--hf-upload-path", dest="hf_upload_path", required=True, help="ORG/REPO on the Hub")
    _flag(verify, "--revision", default=None, help="branch, tag or commit to check (default: the repo's main)")
    _debug(verify)

    demo = command("demo", "build a tiny checkpoint, export and validate it")
    _flag(demo, "--workdir", help="where to build and keep it (default: $XDG_CACHE_HOME/mergeflow/demo, or MERGEFLOW_CACHE_DIR/demo)")
    _debug(demo)
    more.add(sub)
    add_ops_commands(sub)
    add_backfill_command(sub)

    server = command("server", "the background local Prefect server that commands use without PREFECT_API_URL")
    _flag(server, "action", choices=["status", "start", "stop"], help="what to do with it")
    _debug(server)
    for each in sub.choices.values():  # watch, staging, backfill (flows/ops_cli.py) and a layer's verbs too
        each.formatter_class = _Help
    return parser


def _config_from(args: argparse.Namespace, operation: str) -> ModelMergerConfig:
    fields = {f for f in ModelMergerConfig.__dataclass_fields__}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return ModelMergerConfig(operation=operation, **values)


def pre_import_environment(debug: bool) -> dict[str, str]:
    """The defaults every command sets before Prefect or huggingface_hub is imported (both read them then).

    A variable the user set wins: these are applied with `setdefault`.
    """
    env: dict[str, str] = {}
    # Prefect's console handler prints task tracebacks; the user gets one line unless --debug.
    # The API handler still sends every log to the UI.
    if not debug:
        env["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "CRITICAL"
    # Without PREFECT_API_URL Prefect starts a temporary server; on a busy machine its 20 s
    # default start-up limit is too tight.
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    # huggingface_hub's tqdm bars would interleave with our own progress line.
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env


@contextmanager
def _running_flows(announce: str | None = None) -> Iterator[FlowRunLinks]:
    """Around every command that runs a flow: a Prefect API to run against, and each run's UI link.

    `announce` (backfill): the command says on stderr which server it uses, as serve and watch do.
    """
    from mergeflow.flows.events import use_prefect_api
    # First: it may set PREFECT_API_URL, which Prefect reads when imported. The user's server down,
    # or refusing our credentials: one line now, not a traceback mid-export.
    use_prefect_api(announce)
    from mergeflow.flows.progress import flow_run_links

    with flow_run_links() as links:
        yield links


def cmd_merge(args: argparse.Namespace) -> PublishedMerge:
    from mergeflow.export.plan.preflight import preflight_merge
    from mergeflow.io.session import export_session

    config = _config_from(args, "merge")
    with export_session():  # the export's state, handed to the flow run in this process
        # Planning's first stage: refusals that need no tensor data answer before any server or Prefect
        # import, and the checkpoint's files are hashed from now on, on the core the imports leave idle.
        preflight_merge(config)
        with _running_flows():
            from mergeflow.flows.api import merge_model
            from mergeflow.flows.progress import stderr_progress

            with stderr_progress():
                result = merge_model(config, task_runner=args.task_runner, dask_address=args.dask_address)
    out: PublishedMerge = {"output_dir": result.output_dir, "manifest_path": result.manifest_path}
    if result.upload is not None:
        out["upload"] = result.upload
    return out


def cmd_backfill(args: argparse.Namespace) -> BackfillSummary:
    from mergeflow.ops.backfill import backfill, summary

    def report(step: StepResult) -> None:
        print(step.line(), flush=True)  # one line per step as it finishes; the JSON summary stays the last line

    settings = backfill_settings(args)
    with _running_flows(announce="backfill"):
        if args.deployment:
            return _fanned_out_backfill(args, settings, report)
        from mergeflow.flows.api import merge_model

        return summary(backfill(settings, lambda config: merge_model(
            config, task_runner=args.task_runner, dask_address=args.dask_address), report))


def _fanned_out_backfill(args: argparse.Namespace, settings: BackfillSettings,
                         report: Callable[[StepResult], None]) -> BackfillSummary:
    """`backfill --deployment`: the backfill flow dispatches every step as a run of the deployment (flows/fan_out.py)
    and returns once all have ended; its run page lists them. The lines come when the last one has ended."""
    from dataclasses import asdict

    from mergeflow.flows.backfill_flow import backfill_flow

    result = backfill_flow(**asdict(settings), task_runner=args.task_runner, dask_address=args.dask_address,
                           deployment=args.deployment)
    for step in result["steps"]:
        report(StepResult(**step))
    return result


def cmd_test(args: argparse.Namespace) -> IntegrityResult:
    # In-process, without Prefect or torch: starting Prefect (let alone a temporary server) would
    # cost many times the checks. The validate flow (UI reruns, the API) runs this same function.
    from mergeflow.export.check.artifact_check import check_artifact

    return check_artifact(args.test_hf_dir, args.verify_key)


def cmd_smoke(args: argparse.Namespace) -> dict[str, Any]:
    from mergeflow.ops.smoke import check_device

    check_device(args.device)  # one line before any server starts
    with _running_flows():
        from mergeflow.flows.smoke import smoke_flow

        return smoke_flow(test_hf_dir=args.test_hf_dir, device=args.device, dtype=args.dtype, base_model=args.base_model,
                          trust_remote_code=args.trust_remote_code)


def cmd_inspect(args: argparse.Namespace) -> CheckpointDescription:
    from pathlib import Path

    from mergeflow.export.describe import describe_checkpoint

    return describe_checkpoint(Path(args.local_dir), trust_checkpoint=args.trust_checkpoint)


def cmd_upload(args: argparse.Namespace) -> UploadSummary:
    with _running_flows():
        from mergeflow.flows.upload import upload_flow

        return upload_flow(test_hf_dir=args.test_hf_dir, hf_upload_path=args.hf_upload_path, private=args.private)


def cmd_verify_upload(args: argparse.Namespace) -> UploadSummary:
    with _running_flows():
        from mergeflow.flows.upload import verify_upload_flow

        return verify_upload_flow(test_hf_dir=args.test_hf_dir, hf_upload_path=args.hf_upload_path, revision=args.revision)


def cmd_demo(args: argparse.Namespace) -> DemoResult:
    with _running_flows() as links:
        from mergeflow.flows.demo import run_demo

        return run_demo(args.workdir, links=links.urls)


def cmd_server(args: argparse.Namespace) -> ServerStatus | ServerStopped:
    from mergeflow.ops import local_server

    if args.action == "start":  # explicit: started even where commands would use another API
        from mergeflow.io.os_errors import check_prefect_home

        check_prefect_home(local_server.prefect_home())
        _, started = local_server.start_local_server()
        return {**local_server.server_status(), "started": started}
    if args.action == "stop":
        return local_server.stop_local_server()
    return local_server.server_status()


COMMANDS: dict[str, Command] = {
    "merge": cmd_merge,
    "test": cmd_test,
    "smoke": cmd_smoke,
    "inspect": cmd_inspect,
    "demo": cmd_demo,
    "upload": cmd_upload,
    "verify-upload": cmd_verify_upload,
    "server": cmd_server,
    **OPS_COMMANDS,
    "backfill": cmd_backfill,
}

# Published locally, but the requested Hub upload failed: distinct from a failed export.
EXIT_UPLOAD_FAILED = 3


def _report_failure(exc: BaseException, target_dir: str | None, debug: bool) -> int:
    """One line on stderr for whatever ended the command; returns the exit status."""
    if debug:
        traceback.print_exc()
    signum = first_signal(exc)
    if signum is not None:  # Ctrl-C or SIGTERM, whatever error the stopping workers raised meanwhile
        status = exit_status_of(signum)
        print(interrupted_line(signum, target_dir), file=sys.stderr, flush=True)
        end_soon(status, api_answers)
        return status
    if isinstance(exc, OSError) and not isinstance(exc, MergeflowError):
        exc = typed_os_error(exc) or exc  # raised outside a flow (inspect, test, a lock on a full disk)
    if isinstance(exc, MergeflowError):
        note = f" (work kept for resume in {exc.staging_dir}; rerun the same command to resume)" if exc.staging_dir else ""
        print(f"mergeflow: error: {exc}{note}", file=sys.stderr)
        return exc.exit_code
    # An unexpected failure still gets one line, and a way to see more.
    print(f"mergeflow: internal error: {type(exc).__name__}: {one_line(str(exc))} (rerun with --debug for a traceback)",
          file=sys.stderr)
    return 1


def main(argv: list[str] | None = None, more: Verbs = NO_VERBS) -> int:
    # From the first moment: a Ctrl-C during start-up is one line and 130 like any other.
    with interrupts_stop_the_export():
        return _run(argv, more)


def _run(argv: list[str] | None, more: Verbs) -> int:
    args = build_parser(more).parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    for name, value in pre_import_environment(debug).items():
        os.environ.setdefault(name, value)
    try:
        result = {**COMMANDS, **more.commands}[args.command](args)
    except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 - every failure ends as one line and a status
        return _report_failure(exc, getattr(args, "target_dir", None), debug)
    sys.stdout.flush()
    print(json.dumps(result))
    upload = result.get("upload")
    if isinstance(upload, dict) and upload.get("status") == "failed":
        print(f"mergeflow: error: published locally, but the upload failed: {upload.get('error')}", file=sys.stderr)
        return EXIT_UPLOAD_FAILED
    return 0
