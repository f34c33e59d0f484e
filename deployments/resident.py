"""`mergeflow resident start|status|stop`, and the resident process itself (`python -m mergeflow.deployments.resident`).

The mechanism (who is served, how a child takes a command's place) is mergeflow.ops.resident; this
layer adds what only the top of the command line knows: which modules every command imports (the
preload), the environment a command imports them under, and the command a served child runs
(mergeflow.deployments.cli.served_command).
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
from collections.abc import Mapping
from typing import TypedDict

from mergeflow.flows.cli import pre_import_environment
from mergeflow.ops.resident import (
    ResidentError,
    ResidentStatus,
    ask,
    private_socket_dir,
    resident_key,
    residents,
    socket_dir,
    socket_path,
)
from mergeflow.ops.resident_client import hand_over

# What every command imports before it does anything: torch, Prefect's engine, the flows.
PRELOAD = ("torch", "safetensors.torch", "torch.distributed.tensor", "prefect", "prefect.flows", "prefect.flow_engine",
           "prefect.task_engine", "prefect.utilities.visualization", "fastapi.encoders",
           "mergeflow.deployments.cli", "mergeflow.flows.merge", "mergeflow.flows.validate", "mergeflow.flows.progress")
DEFAULT_IDLE_MINUTES = 60.0
START_TIMEOUT_S = 300.0  # the imports take 2-10 s on a 2-core machine; much longer on a loaded one


def import_environment(env: Mapping[str, str], debug: bool = False) -> dict[str, str]:
    """The environment a command with `env` imports Prefect under: the CLI's defaults where `env` has none."""
    return {**pre_import_environment(debug), **env}


def hand_over_to_resident(argv: list[str]) -> None:
    """Run this command in the resident of its environment, ending the process there; returns where none serves it."""
    if len(argv) > 1 and argv[1] == "resident":
        return  # managing residents is never itself handed to one
    env = dict(os.environ)
    hand_over(argv, env, import_environment(env, debug="--debug" in argv[1:]))


def add_resident_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `resident` on the main parser's subcommands."""
    text = ("a resident process that has imported torch and Prefect: later commands of this same environment "
            "fork from it instead of importing them (2-5 s each)")
    resident = sub.add_parser("resident", help=text, description=text)
    resident.add_argument("action", choices=["status", "start", "stop"], help="what to do with it")
    resident.add_argument("--idle-minutes", "--idle_minutes", dest="idle_minutes", type=float, default=DEFAULT_IDLE_MINUTES,
                          help="start: the resident ends after this long without a command")
    resident.add_argument("--all", action="store_true", help="stop: every resident of this user, not only this environment's")
    resident.add_argument("--debug", action="store_true", help="show tracebacks")


class ResidentList(TypedDict):
    """`mergeflow resident status`: this user's residents."""

    residents: list[ResidentStatus]


class ResidentStarted(TypedDict):
    """`mergeflow resident start`: the resident serving this environment."""

    pid: int
    socket: str
    started: bool
    log: str


class ResidentsStopped(TypedDict):
    """`mergeflow resident stop`: the residents told to stop (each ends once its running commands have)."""

    stopped: list[int]


def cmd_resident(args: argparse.Namespace) -> ResidentList | ResidentStarted | ResidentsStopped:
    key = resident_key(import_environment(os.environ))
    if args.action == "start":
        if args.idle_minutes <= 0:
            raise ResidentError(f"--idle-minutes must be positive, got {args.idle_minutes}")
        return start_resident(key, args.idle_minutes)
    if args.action == "stop":
        directory = private_socket_dir(create=False)
        stopped = []
        for each in residents(key) if directory is not None else []:
            if args.all or each["serves_this_environment"]:
                answer = ask(directory / each["socket"], "stop")
                if answer is not None:
                    stopped.append(int(answer["pid"]))
        return {"stopped": stopped}
    return {"residents": residents(key)}


def start_resident(key: str, idle_minutes: float) -> ResidentStarted:
    """Start the resident of this environment (or find it running) and wait until it serves."""
    directory = private_socket_dir(create=True)
    if directory is None:
        raise ResidentError(f"{socket_dir()} must be a directory of this user's alone (mode 0700)")
    path = socket_path(key, directory)
    log = path.with_suffix(".log")
    answer = ask(path, "status")
    if answer is not None:
        return {"pid": int(answer["pid"]), "socket": path.name, "started": False, "log": str(log)}
    # The same interpreter, with the same flags: both are part of what a command must share with it.
    command = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
               "-m", "mergeflow.deployments.resident", "--idle-seconds", str(idle_minutes * 60)]
    with open(log, "ab") as log_file:
        # Its working directory is its own: `python -m` puts it first on the import path, and what the
        # resident imports must come from where the installed packages are.
        process = subprocess.Popen(command, cwd=directory, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=log_file, start_new_session=True)
    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        line = process.stdout.readline() if sel.select(START_TIMEOUT_S) else b""
    process.stdout.close()
    if not line.startswith(b'{"ready": true'):
        if process.poll() is None:
            process.kill()
        process.wait()
        last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] if log.exists() else []
        raise ResidentError(f"the resident did not start ({last[0] if last else 'no output'}); see {log}")
    return {"pid": process.pid, "socket": path.name, "started": True, "log": str(log)}


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mergeflow.deployments.resident")
    parser.add_argument("--idle-seconds", type=float, default=DEFAULT_IDLE_MINUTES * 60)
    args = parser.parse_args()
    from mergeflow.deployments.cli import served_command
    from mergeflow.ops.resident_server import run_resident

    try:
        run_resident(import_environment, PRELOAD, served_command, args.idle_seconds)
    except ResidentError as exc:
        print(f"mergeflow resident: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    _main()
