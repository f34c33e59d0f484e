"""`serve`, `watch` and `backfill` at start-up, as real processes: which Prefect server they use, and what they refuse.

Without PREFECT_API_URL they share mergeflow's local background server (as `merge` does) and say so;
serve refuses settings every triggered run would fail on before any server starts; a server that
refuses the credentials ends watch and serve with one line instead of endless retries.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import forked_cli
import httpx
import pytest
from builders import Export, clone_export
from prefect_server import seeded_prefect_home
from test_local_server import newcomer_env

from mergeflow.export.check.artifact_check import check_artifact
from mergeflow.ops import local_server

REPO = Path(__file__).resolve().parent.parent
USES_LOCAL = re.compile(r"^mergeflow: (serve|watch|backfill) uses mergeflow's local background Prefect server at "
                        r"(http://127\.0\.0\.1:\d+/api) ", re.M)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`python -m mergeflow ARGS` in its own session; stderr piped (read line by line), stdout to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "mergeflow", *args], env=env, cwd=REPO, text=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, start_new_session=True)


def _read_until(proc: subprocess.Popen[str], pattern: re.Pattern[str], timeout: float) -> tuple[re.Match[str], str]:
    """Read the process's stderr until a line matches; the match and everything read so far."""
    assert proc.stderr is not None
    seen = ""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not selector.select(timeout=1.0):
                continue
            line = proc.stderr.readline()
            if not line:
                break  # the process ended
            seen += line
            match = pattern.search(line)
            if match:
                return match, seen
    raise AssertionError(f"no line matching {pattern.pattern!r} (exit {proc.poll()}); stderr so far:\n{seen}")


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
    """Stop the process group (SIGINT, as Ctrl-C; SIGKILL if it lingers); the rest of its stderr."""
    for each, wait_s in ((sig, 30.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, each)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    stream: IO[str] | None = proc.stderr
    return stream.read() if stream is not None else ""


def _served(api_url: str) -> bool:
    """The merge deployment and its trigger are registered on the server at api_url."""
    try:
        deployment = httpx.get(f"{api_url}/deployments/name/mergeflow-merge-checkpoint/on-checkpoint", timeout=5)
        automations = httpx.post(f"{api_url}/automations/filter", json={}, timeout=5)
    except httpx.HTTPError:
        return False
    return deployment.status_code == 200 and automations.status_code == 200 and bool(automations.json())


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_serve_watch_and_backfill_without_an_api_url_share_the_local_server(tmp_path: Path, pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)  # ckpt/global_step_1/actor: a finished training run "ckpt"
    home = seeded_prefect_home(tmp_path / "prefect-home")
    env = newcomer_env(home)  # no PREFECT_API_URL, no profile: the local background server is the only choice
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"
    exports = tmp_path / "exports"
    exports.mkdir()
    serve = watch = None
    try:
        serve = _start(["serve", "--base_model", str(ex.base_dir), "--target-root", str(exports), "--checkpoint-root",
                        str(tmp_path), "--output_format", "transformer"], env, tmp_path / "serve.out")
        match, said = _read_until(serve, USES_LOCAL, 240)
        api_url = match.group(2)
        state = local_server.read_state(home)
        assert state is not None and state.api_url == api_url, said
        assert "mergeflow: started a local Prefect server at" in said  # the first command started it, and said so
        _wait(lambda: _served(api_url), 120, "serve's deployments on the local server")

        # The watcher finds the same server by itself and its event becomes serve's merge.
        watch = _start(["watch", str(ex.root / "ckpt"), "--stable-seconds", "0.5"], env, tmp_path / "watch.out")
        match, said = _read_until(watch, USES_LOCAL, 120)
        assert match.group(1) == "watch" and match.group(2) == api_url, said
        assert "started a local Prefect server" not in said
        target = exports / "ckpt" / "global_step_1"
        _wait(lambda: target.is_dir() or serve.poll() is not None, 300,
              f"the merge the watcher's event started ({target})")
        assert check_artifact(str(target))["integrity"] == "passed"  # in-process, no Prefect (the API's would start one)
        _stop(watch)
        assert json.loads((tmp_path / "watch.out").read_text().splitlines()[-1])["emitted"][0]["step"] == 1

        # backfill too: it finds the step published and says which server it used.
        done = subprocess.run([sys.executable, "-m", "mergeflow", "backfill", str(ex.root / "ckpt"), "--base_model",
                               str(ex.base_dir), "--target-root", str(exports), "--stable-seconds", "0"],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        match = USES_LOCAL.search(done.stderr)
        assert match is not None and match.group(1) == "backfill" and match.group(2) == api_url, done.stderr
        assert done.stdout.splitlines()[0] == f"global_step_1: skipped (already published) -> {target}"
        assert local_server.read_state(home) == state  # one server for all three
    finally:
        for proc in (watch, serve):
            if proc is not None:
                _stop(proc)
        local_server.stop_local_server(home)


@pytest.mark.parametrize("case", ["pipeline over a transformer base", "missing base", "missing target root",
                                  "missing checkpoint root"])
def test_serve_refuses_bad_settings_in_one_line_before_any_server(case: str, tmp_path: Path, pristine_flux_w2: Export) -> None:
    home = tmp_path / "prefect-home"
    exports, ckpts = tmp_path / "exports", tmp_path / "ckpts"
    exports.mkdir()
    ckpts.mkdir()
    flags = {"--base_model": str(pristine_flux_w2.base_dir), "--target-root": str(exports), "--checkpoint-root": str(ckpts),
             "--output_format": "transformer"}
    expected = {
        "pipeline over a transformer base": ("--output_format", "pipeline", "--output_format pipeline needs a base pipeline"),
        "missing base": ("--base_model", str(tmp_path / "no-base"), "is not a local directory"),
        "missing target root": ("--target-root", str(tmp_path / "no-exports"), "does not exist"),
        "missing checkpoint root": ("--checkpoint-root", str(tmp_path / "no-ckpts"), "is not a directory"),
    }
    flag, value, message = expected[case]
    flags[flag] = value
    args = ["serve", *[part for pair in flags.items() for part in pair]]
    done = subprocess.run([sys.executable, "-m", "mergeflow", *args], env=newcomer_env(home), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("mergeflow: error: ") and message in lines[0], lines
    assert done.stdout == ""  # nothing served
    assert not (home / local_server.STATE_FILE).exists()  # no server started, let alone deployments registered
    assert list(exports.iterdir()) == []


@pytest.mark.parametrize("auth", [None, "mergeflow:wrong"])
def test_watch_and_serve_refused_by_the_server_exit_2_in_one_line(auth: str | None, tmp_path: Path, prefect_server: Any,
                                                                   pristine_flux_w2: Export) -> None:
    """The session's server requires basic auth; a missing or wrong PREFECT_API_AUTH_STRING is final."""
    assert prefect_server.auth_string
    env = prefect_server.client_env()
    env.pop("PREFECT_API_AUTH_STRING")
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    train = tmp_path / "train"
    train.mkdir()
    exports = tmp_path / "exports"
    exports.mkdir()
    reason = "requires authentication" if auth is None else "refused PREFECT_API_AUTH_STRING"
    commands = {
        "watch": ["watch", str(train)],
        "serve": ["serve", "--base_model", str(pristine_flux_w2.base_dir), "--target-root", str(exports),
                  "--checkpoint-root", str(tmp_path), "--output_format", "transformer"],
    }
    for name, args in commands.items():
        # Before, watch retried every 30 s for ever: the timeout would end this test with a failure.
        done = forked_cli.mergeflow(args, env, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (name, done.stderr)
        assert lines[0].startswith("mergeflow: error: ") and reason in lines[0], (name, lines)
        assert "PREFECT_API_AUTH_STRING" in lines[0] and done.stdout == "", (name, done.stdout)
