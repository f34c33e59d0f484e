"""The fixed cost of one `mergeflow merge`: where a tiny export's wall time goes, on three servers.

A tiny export (a ~5 MB Flux-class checkpoint, W=2) is run as the user runs it, `python -m mergeflow merge`
in a fresh process, against each of three Prefect servers started here on 127.0.0.1:

- `local`: mergeflow's own background server (what `mergeflow merge` starts when PREFECT_API_URL is unset);
- `plain`: `prefect server start` with Prefect's default settings on its own SQLite file;
- `postgresql`: `prefect server start` on a PostgreSQL started here (initdb + pg_ctl, as tests/cluster.py).

Each run's wall time (process start to exit, measured here) is split with the flow run's own start and end
times as the server recorded them: `before` (interpreter start, imports, pre-flight, creating the flow run),
`flow` (the flow run, start to end) and `after` (from the flow run's end to the process's exit: Prefect's
log and event drains, the interpreter's shutdown); `outside` = before + after. Runs alternate between the
servers (one round = one run on each) so load on this shared machine favours none: medians.

    python bench/fixed_cost.py                 # 5 rounds, all three servers
    python bench/fixed_cost.py --servers local plain --rounds 9
    python bench/fixed_cost.py --preset real-depth --rounds 3   # the same split at FLUX.1's depth (5.3 GB)
    python bench/fixed_cost.py --resident      # each server also with `mergeflow resident start` done first

With --resident each server gets a second row, `<server>+resident`: the same command in the same
environment, handed to a resident process (mergeflow.ops.resident) that imported torch and Prefect
before the rounds began; the bench checks from the resident's own count that it served every one.

At real depth `before` also holds the pre-flight (the checks that need no tensor data, and starting to hash
the rank files on the core that the imports leave idle) and `flow` the export itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/cluster.py starts PostgreSQL and servers on it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"

RUN_ID = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")


def _plain_env(home: Path) -> dict[str, str]:
    # Bytecode caching as a user's Python has it: PYTHONDONTWRITEBYTECODE (set on this project's
    # machines) would compile mergeflow's 135 modules from source in every command, 0.1 s.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


def _wait_healthy(api_url: str, process: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server at {api_url} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server at {api_url} was not healthy within {timeout:.0f} s")


@contextlib.contextmanager
def plain_server(root: Path, database_url: str | None = None) -> Iterator[str]:
    """`prefect server start` with Prefect's defaults (only analytics off), on SQLite or `database_url`."""
    from prefect_server import free_port

    home = root / "home"
    home.mkdir(parents=True)
    env = _plain_env(home)
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    port = free_port()
    with open(root / "server.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                    "--port", str(port), "--analytics-off"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_healthy(api_url, process)
        yield api_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        process.wait(timeout=30)


@contextlib.contextmanager
def local_server(root: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """mergeflow's own background server under a private PREFECT_HOME."""
    from mergeflow.ops.local_server import start_local_server, stop_local_server

    home = root / "home"
    home.mkdir(parents=True)
    saved = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home)
    try:
        state, _ = start_local_server(home)
        yield state.api_url, {"PREFECT_HOME": str(home)}
    finally:
        stop_local_server(home)
        if saved is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = saved


@contextlib.contextmanager
def servers(root: Path, names: list[str]) -> Iterator[dict[str, dict[str, str]]]:
    """Each named server running: its client environment (PREFECT_API_URL and a PREFECT_HOME of its own)."""
    with contextlib.ExitStack() as stack:
        envs: dict[str, dict[str, str]] = {}
        for name in names:
            client_home = root / name / "client-home"
            client_home.mkdir(parents=True)
            if name == "local":
                api_url, extra = stack.enter_context(local_server(root / name))
                envs[name] = {"PREFECT_API_URL": api_url, **extra}
                continue
            database_url = None
            if name == "postgresql":
                from cluster import Cluster

                cluster = stack.enter_context(Cluster(root / name / "cluster"))
                database_url = cluster.start_postgres()
            api_url = stack.enter_context(plain_server(root / name / "server", database_url))
            envs[name] = {"PREFECT_API_URL": api_url, "PREFECT_HOME": str(client_home)}
        yield envs


def _timestamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _full_env(env: dict[str, str]) -> dict[str, str]:
    full = _plain_env(Path(env["PREFECT_HOME"]))
    full.update(env)
    return full


def _resident(env: dict[str, str], command: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "mergeflow", "resident", command], env=_full_env(env),
                            capture_output=True, text=True, check=False, cwd=env["TMPDIR"])
    if result.returncode != 0:
        raise RuntimeError(f"mergeflow resident {command} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def served_count(env: dict[str, str]) -> int:
    mine = [r for r in _resident(env, "status")["residents"] if r["serves_this_environment"]]
    return int(mine[0]["served"]) if mine else 0


def one_merge(actor: Path, base: Path, target: Path, env: dict[str, str]) -> dict[str, float]:
    """One whole `mergeflow merge`, split by the flow run's recorded start and end."""
    import httpx

    full = _full_env(env)
    command = [sys.executable, "-m", "mergeflow", "merge", "--backend", "fsdp", "--local_dir", str(actor),
               "--base_model", str(base), "--target_dir", str(target), "--output_format", "transformer"]
    before_usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    result = subprocess.run(command, env=full, capture_output=True, text=True, check=False)
    ended = time.time()
    after_usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(target, ignore_errors=True)  # 5.3 GB each at real depth: 24 runs would not fit on the disk
    if result.returncode != 0:
        raise RuntimeError(f"merge failed ({result.returncode}): {result.stderr[-2000:]}")
    match = RUN_ID.search(result.stderr)
    if match is None:
        raise RuntimeError(f"no flow-run link in the merge's output: {result.stderr[-2000:]}")
    run = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{match.group(1)}", timeout=10).json()
    flow_start, flow_end = _timestamp(run["start_time"]), _timestamp(run["end_time"])
    cpu = (after_usage.ru_utime - before_usage.ru_utime) + (after_usage.ru_stime - before_usage.ru_stime)
    return {"wall": ended - started, "before": flow_start - started, "flow": flow_end - flow_start,
            "after": ended - flow_end, "outside": (flow_start - started) + (ended - flow_end), "cpu": cpu}


def _checkpoint(root: Path, preset: str) -> tuple[Path, Path]:
    if preset == "real-depth":
        sys.path.insert(0, str(REPO / "bench"))
        from checkpoints import PRESETS, build_checkpoint

        return build_checkpoint(root, PRESETS["real-depth"])
    from mergeflow.demo.checkpoints import build_sized_checkpoint

    demo = build_sized_checkpoint(root, 5 * 10**6, world_size=2)
    return demo.actor_dir, demo.base_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=["local", "plain", "postgresql"],
                        default=["local", "plain", "postgresql"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preset", choices=["tiny", "real-depth"], default="tiny",
                        help="tiny: ~5 MB, W=2; real-depth: bench/checkpoints.py's FLUX.1-depth preset (5.3 GB)")
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--resident", action="store_true", help="also each server with a resident process")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mergeflow-fixed-cost-", dir=args.root))
    try:
        actor, base = _checkpoint(root / "ckpt", args.preset)
        runs: dict[str, list[dict[str, float]]] = {}
        with servers(root, args.servers) as server_envs, contextlib.ExitStack() as residents:
            envs = dict(server_envs)
            if args.resident:
                for name, env in server_envs.items():
                    # Its own TMPDIR, so the socket directory is the bench's; the rows without stay cold.
                    tmp = root / name / "t"
                    tmp.mkdir()
                    envs[f"{name}+resident"] = served_env = {**env, "TMPDIR": str(tmp)}
                    _resident(served_env, "start")
                    residents.callback(_resident, served_env, "stop")  # a failed round stops it too
            runs = {name: [] for name in envs}
            for name, env in envs.items():  # a first run each: the server's first flow run creates its rows
                one_merge(actor, base, root / f"warm-{name}", env)
            for round_ in range(args.rounds):
                for name, env in envs.items():
                    runs[name].append(one_merge(actor, base, root / f"out-{name}-{round_}", env))
                    print(json.dumps({"server": name, **{k: round(v, 3) for k, v in runs[name][-1].items()}}),
                          file=sys.stderr, flush=True)
            served = {name: served_count(env) for name, env in envs.items() if name.endswith("+resident")}
        report: dict[str, Any] = {"preset": args.preset, "cpus": os.cpu_count(), "rounds": args.rounds,
                                  "served_by_the_resident": served, "median_s": {}}
        for name, measured in runs.items():
            report["median_s"][name] = {key: round(statistics.median(run[key] for run in measured), 2)
                                        for key in ("wall", "before", "flow", "after", "outside", "cpu")}
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
