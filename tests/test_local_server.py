"""Without PREFECT_API_URL the CLI starts one background Prefect server and later commands reuse it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from builders import Export, clone_export
from prefect_server import seeded_prefect_home

from mergeflow.ops import local_server

REPO = Path(__file__).resolve().parents[1]
STARTED = "mergeflow: started a local Prefect server at "
LINK = re.compile(r"^mergeflow: flow run (\S+): (http://127\.0\.0\.1:(\d+)/runs/flow-run/([0-9a-f-]{36}))$", re.M)


def newcomer_env(home: Path) -> dict[str, str]:
    """A user who never configured Prefect: no PREFECT_API_URL, no profile, no opt-out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.pop("MERGEFLOW_LOCAL_SERVER", None)
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
    return env


def mergeflow(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mergeflow", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_second_merge_reuses_the_background_server(tmp_path: Path, pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)  # the real W=2 checkpoint, copied: no torch build here
    home = tmp_path / "prefect-home"
    env = newcomer_env(home)
    merge = ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
             "--output_format", "transformer", "--target_dir"]
    try:
        first = mergeflow([*merge, str(tmp_path / "out1")], env)
        assert first.returncode == 0, first.stderr
        assert first.stderr.count(STARTED) == 1, first.stderr
        state = json.loads((home / local_server.STATE_FILE).read_text())
        server_env = Path(f"/proc/{state['pid']}/environ").read_bytes().split(b"\0")
        assert all(f"{k}={v}".encode() in server_env for k, v in local_server.RECORDER_BATCHING.items())
        second = mergeflow([*merge, str(tmp_path / "out2")], env)
        assert second.returncode == 0, second.stderr
        assert STARTED not in second.stderr, "the second command started another server"
        assert json.loads((home / local_server.STATE_FILE).read_text()) == state

        links = [LINK.search(proc.stderr) for proc in (first, second)]
        assert all(links), first.stderr + second.stderr
        assert [m.group(1) for m in links if m] == ["merge-ckpt-step1", "merge-ckpt-step1"]  # <run>-step<N> of the source
        assert {int(m.group(3)) for m in links if m} == {state["port"]}
        for match in links:
            assert match is not None
            run = httpx.get(f"{state['api_url']}/flow_runs/{match.group(4)}", timeout=10).json()
            assert run["name"] == match.group(1) and run["state_type"] == "COMPLETED"

        served_by_a_resident(env, [*merge, str(tmp_path / "out3")], state)

        status = mergeflow(["server", "status"], env)
        reported = json.loads(status.stdout.strip().splitlines()[-1])
        assert reported["running"] is True and reported["ui_url"] == f"http://127.0.0.1:{state['port']}", status.stderr
        # The UI asks this address for its data: its own port, not Prefect's default 4200.
        ui_settings = httpx.get(f"{reported['ui_url']}/ui-settings", timeout=10).json()
        assert ui_settings["api_url"] == state["api_url"]
        stop = mergeflow(["server", "stop"], env)
        assert stop.returncode == 0, stop.stderr
        assert json.loads(stop.stdout.strip().splitlines()[-1]) == {"stopped": True, "pid": state["pid"]}
        assert not local_server.is_running(state["pid"])
        assert not port_open(state["port"])
        assert not (home / local_server.STATE_FILE).exists()
        again = mergeflow(["server", "stop"], env)  # idempotent
        assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["stopped"] is False
    finally:
        local_server.stop_local_server(home)  # whatever failed above, no server outlives the test


def served_by_a_resident(env: dict[str, str], merge: list[str], state: dict[str, Any]) -> None:
    """The local server's users (no PREFECT_API_URL) with a resident: the resident imported Prefect before
    any command chose this server, so each forked command must make Prefect read its settings again."""
    tmp = tempfile.mkdtemp(prefix="mfr-", dir="/tmp")  # a socket's path must stay under 107 bytes
    renv = {**env, "TMPDIR": tmp}
    try:
        assert mergeflow(["resident", "start"], renv).returncode == 0
        third = mergeflow(merge, renv)
        assert third.returncode == 0, third.stderr
        link = LINK.search(third.stderr)
        assert link is not None and int(link.group(3)) == state["port"], third.stderr
        run = httpx.get(f"{state['api_url']}/flow_runs/{link.group(4)}", timeout=10).json()
        assert run["state_type"] == "COMPLETED"
        # watch says which server it uses, and checks it answers, through Prefect's own client.
        train = Path(tmp) / "train"
        train.mkdir()
        watch = subprocess.Popen([sys.executable, "-m", "mergeflow", "watch", str(train)], env=renv, cwd=tmp,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watch.stderr is not None
        line = watch.stderr.readline()
        assert f"watch uses mergeflow's local background Prefect server at {state['api_url']}" in line, line
        watch.terminate()
        watch.communicate(timeout=60)
        status = json.loads(mergeflow(["resident", "status"], renv).stdout)["residents"]
        assert [r["served"] for r in status if r["serves_this_environment"]] == [2]
    finally:
        mergeflow(["resident", "stop", "--all"], renv)
        shutil.rmtree(tmp, ignore_errors=True)


def test_opt_out_and_a_configured_api_start_no_server(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv("MERGEFLOW_LOCAL_SERVER", "off")
    assert local_server.ensure_local_server() is None
    monkeypatch.delenv("MERGEFLOW_LOCAL_SERVER")
    (tmp_path / "profiles.toml").write_text('active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    assert local_server.configured_api_url() == "http://127.0.0.1:9/api"
    assert local_server.ensure_local_server() is None
    assert not (tmp_path / local_server.STATE_FILE).exists()


def test_the_command_server_prints_no_link_and_a_users_server_its_own_ui(tmp_path: Path, pristine_flux_w2: Export,
                                                                       prefect_server: object) -> None:
    """MERGEFLOW_LOCAL_SERVER=0 runs --no-ui: no link, even with a PREFECT_UI_URL; a user's own server: their UI."""
    ex = clone_export(pristine_flux_w2, tmp_path)
    merge = ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
             "--output_format", "transformer", "--target_dir"]
    env = newcomer_env(tmp_path / "prefect-home")
    env.update(MERGEFLOW_LOCAL_SERVER="0", PREFECT_UI_URL="http://127.0.0.1:4200")
    alone = mergeflow([*merge, str(tmp_path / "out1")], env)
    assert alone.returncode == 0, alone.stderr
    assert "mergeflow: flow run" not in alone.stderr and "http://" not in alone.stderr, alone.stderr

    own = prefect_server.client_env(newcomer_env(tmp_path / "prefect-home"))  # type: ignore[attr-defined]
    own["PREFECT_UI_URL"] = "http://ui.example.invalid:8080"
    theirs = mergeflow([*merge, str(tmp_path / "out2")], own)
    assert theirs.returncode == 0, theirs.stderr
    assert re.search(r"^mergeflow: flow run merge-ckpt-step1: http://ui\.example\.invalid:8080/runs/flow-run/[0-9a-f-]{36}$",
                     theirs.stderr, re.M), theirs.stderr


def test_a_server_whose_ui_asks_another_port_is_replaced(tmp_path: Path) -> None:
    """A background server started before the UI's API address was set (its UI asked :4200) is not reused."""
    home = seeded_prefect_home(tmp_path / "prefect-home")
    port = local_server._free_port()
    env = {**local_server._server_env(home, "http://127.0.0.1:4200/api")}
    old = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                            "--analytics-off"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT, start_new_session=True, cwd=home)
    try:
        local_server._wait_healthy(old, f"http://127.0.0.1:{port}/api", home / "none.log")
        stale = local_server.ServerState(pid=old.pid, port=port, api_url=f"http://127.0.0.1:{port}/api",
                                         ui_url=f"http://127.0.0.1:{port}", started_at=0.0, log_path="")
        local_server._write_state(home, stale)
        state, started = local_server.start_local_server(home)
        assert started and state.pid != old.pid and not local_server.is_running(old.pid)
        assert httpx.get(f"{state.ui_url}/ui-settings", timeout=10).json()["api_url"] == state.api_url
    finally:
        local_server._stop_group(old.pid)
        local_server.stop_local_server(home)
