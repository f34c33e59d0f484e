"""What a user sees while a merge runs: phases, bytes of the total, rate, ETA; stderr lines; the UI's progress artifact."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import re
from pathlib import Path
from typing import Any

import forked_cli
import pytest
from builders import Export, clone_export, output_state
from rich.console import Console

from mergeflow.export.progress import (
    ETA_AFTER_S,
    HASHING,
    INSPECTING,
    LOADING,
    MERGE_PROGRESS,
    PUBLISHING,
    VALIDATING,
    WRITING,
    MergeProgress,
    RateWindow,
    Reuse,
    Snapshot,
    eta_seconds,
    human_bytes,
    human_duration,
)
from mergeflow.flows.progress import StderrProgress, figures, stderr_progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """An observer that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Snapshot, Snapshot | None]] = []
        self.reuses: list[Reuse] = []

    def phase_began(self, progress: MergeProgress, now: Snapshot, previous: Snapshot | None) -> None:
        self.events.append(("phase", now, previous))

    def advanced(self, progress: MergeProgress, now: Snapshot) -> None:
        self.events.append(("advanced", now, None))

    def reused(self, progress: MergeProgress, reuse: Reuse) -> None:
        self.reuses.append(reuse)

    def phases(self) -> list[str | None]:
        return [snap.phase for kind, snap, _ in self.events if kind == "phase"]


# --- the model -----------------------------------------------------------------------------------


def test_the_rate_is_of_the_last_seconds_and_falls_to_zero_in_a_stall() -> None:
    window = RateWindow(5.0)
    window.reset(0.0)
    assert window.rate(0.1) is None  # too short a span to tell
    for t in range(1, 11):  # 100 units/s for 10 s
        window.add(float(t), 100 * t)
    assert window.rate(10.0) == pytest.approx(100.0)
    for t in range(11, 16):  # then 300 units/s: after 5 s only the new speed counts
        window.add(float(t), 1000 + 300 * (t - 10))
    assert window.rate(15.0) == pytest.approx(300.0)  # not the 167/s average since the start
    assert 0 < window.rate(17.5) < 300.0  # a stall: the rate falls ...
    assert window.rate(25.0) == 0.0  # ... to nothing, instead of freezing at the last value


def test_eta_is_what_is_left_at_the_recent_rate() -> None:
    assert eta_seconds(500, 1500, 100.0) == pytest.approx(10.0)
    assert eta_seconds(1500, 1500, None) == 0.0
    assert eta_seconds(10, 1500, None) is None and eta_seconds(10, 1500, 0.0) is None  # nothing moves: unknown
    assert eta_seconds(10, None, 100.0) is None  # no total


def test_phases_carry_their_totals_and_the_bytes_of_each_shard() -> None:
    clock, seen = Clock(), Recorder()
    progress = MergeProgress(seen, clock=clock)
    progress.begin(INSPECTING)
    clock.advance(1.0)
    progress.begin(LOADING, total=2)
    progress.step()
    clock.advance(0.5)
    progress.step()
    assert progress.snapshot().done == 2 and progress.snapshot().fraction == 1.0
    progress.begin_writing([1000, 500], tensors=3)
    _, writing, loaded = seen.events[-1]
    assert loaded is not None and (loaded.phase, loaded.done, loaded.total, loaded.elapsed) == (LOADING, 2, 2, 0.5)
    assert (writing.phase, writing.done, writing.total, writing.shards, writing.tensors) == (WRITING, 0, 1500, 2, 3)

    for _ in range(5):  # 100 bytes a second into shard 0
        clock.advance(1.0)
        progress.wrote(0, 100)
    snap = progress.snapshot()
    assert (snap.done, snap.fraction) == (500, pytest.approx(1 / 3))
    assert snap.rate == pytest.approx(100.0) and snap.eta == pytest.approx(10.0)
    progress.wrote(1, 300, attempt=1)
    progress.wrote(1, 200, attempt=2)  # a retried write starts its shard over
    assert progress.bytes_done == 700
    progress.shard_done(0)  # verified: all of its bytes
    progress.shard_done(1)
    assert progress.bytes_done == progress.bytes_total == 1500 and progress.snapshot().eta == 0.0
    progress.wrote(0, 100)  # a late report of a finished shard changes nothing
    progress.begin(HASHING, total=2)
    progress.wrote(0, 100)  # nor one after the writing phase
    assert progress.bytes_done == 1500  # still known after the phase
    progress.begin(VALIDATING)
    progress.step(phase=HASHING)  # a rank's completion callback, late: not counted in another phase
    assert progress.snapshot().done == 0
    progress.begin(PUBLISHING)
    assert seen.phases() == [INSPECTING, LOADING, WRITING, HASHING, VALIDATING, PUBLISHING]
    assert progress.snapshot().total is None and progress.snapshot().rate is None  # no measure, no rate


def test_resumed_shards_count_as_done_but_not_as_speed() -> None:
    clock = Clock()
    progress = MergeProgress(clock=clock)
    progress.begin_writing([4000, 1000], tensors=2)
    progress.shard_done(0, resumed=True)  # an earlier run wrote it: 4 kB in no time
    for _ in range(4):
        clock.advance(1.0)
        progress.wrote(1, 250)
    snap = progress.snapshot()
    assert (snap.done, snap.resumed) == (5000, 4000)
    assert snap.rate == pytest.approx(250.0) and snap.average_rate == pytest.approx(250.0)


def test_the_eta_is_blank_until_the_write_has_moved_for_a_while() -> None:
    # The first tick once read `ETA 11:59:19`: one small tensor, 0.3 s after the writers began.
    clock = Clock()
    progress = MergeProgress(clock=clock)
    progress.begin_writing([10**9], tensors=100)
    assert progress.snapshot().eta is None and "ETA" not in figures(progress.snapshot())
    clock.advance(0.5)  # (binary fractions of a second: exact sums)
    progress.wrote(0, 100)  # the first report: no rate from the start-up, no ETA
    first = progress.snapshot()
    assert first.eta is None and first.rate is None and "ETA" not in figures(first), figures(first)
    steps = 0
    while progress.snapshot().eta is None:
        clock.advance(0.25)
        progress.wrote(0, 10**6)  # 4 MB/s from now on
        steps += 1
        assert steps <= 100, "the ETA never appeared"
    assert steps * 0.25 == pytest.approx(ETA_AFTER_S)  # once the bytes have moved for ETA_AFTER_S, not before
    snap = progress.snapshot()
    assert snap.rate == pytest.approx(4e6)
    assert snap.eta == pytest.approx((10**9 - snap.done) / 4e6)  # the time left at the measured rate
    assert figures(snap).endswith(f"ETA {human_duration(snap.eta)}") and ":" in human_duration(snap.eta)
    clock.advance(60.0)  # a stall: the rate falls to nothing and the ETA is unknown again, never a stale figure
    assert progress.snapshot().rate == 0.0 and progress.snapshot().eta is None


def test_a_resumed_run_says_how_many_shards_and_files_it_reused() -> None:
    seen = Recorder()
    progress = MergeProgress(seen)
    reuse = Reuse(shards=3, of_shards=4, files=7, of_files=7)
    progress.reused(reuse)
    assert seen.reuses == [reuse]
    assert reuse.words() == "reused 3 of 4 shards and 7 of 7 files"
    assert Reuse(1, 1, 0, 0).words() == "reused 1 of 1 shard"  # a transformer output copies no files
    out = io.StringIO()
    with stderr_progress(stream=out):
        fed = MERGE_PROGRESS.start()
        fed.begin_writing([100, 100], tensors=2)
        fed.shard_done(0, resumed=True)
        fed.shard_done(1)
        fed.reused(Reuse(1, 2, 0, 0))
        fed.begin(VALIDATING)
    lines = out.getvalue().splitlines()
    assert "mergeflow: resumed the staging an earlier run kept: reused 1 of 2 shards" in lines, lines
    assert any(line.endswith("resumed 100 B an earlier run had written") for line in lines), lines


def test_words_for_sizes_and_durations() -> None:
    assert [human_bytes(n) for n in (0, 999, 1000, 864_900_000, 5_300_000_000)] == ["0 B", "999 B", "1.0 kB", "864.9 MB", "5.3 GB"]
    assert [human_duration(s) for s in (None, 1.25, 21.0, 187, 3723)] == ["-", "1.2 s", "21.0 s", "3:07", "1:02:03"]


# --- stderr --------------------------------------------------------------------------------------


def _a_merge(progress: MergeProgress, clock: Clock, *, fail_at: int | None = None) -> None:
    """The flow's calls for a W=2 merge of 1.5 kB in 2 shards; with fail_at, the writes stop after that many bytes."""
    progress.begin(INSPECTING)
    clock.advance(1.0)
    progress.begin(LOADING, total=2)
    progress.step(2)
    clock.advance(1.0)
    progress.begin_writing([1000, 500], tensors=3)
    for _ in range(10):
        clock.advance(1.0)
        progress.wrote(0, 100)
        if fail_at is not None and progress.bytes_done >= fail_at:
            return
    progress.shard_done(0)
    progress.shard_done(1, resumed=True)
    progress.begin(HASHING, total=2)
    progress.step(2)
    progress.begin(VALIDATING)
    clock.advance(0.5)
    progress.begin(PUBLISHING)
    clock.advance(0.5)


def test_a_pipe_gets_one_plain_line_per_phase() -> None:
    clock, out = Clock(), io.StringIO()
    display = StderrProgress(stream=out, clock=clock)
    assert not display.live
    _a_merge(MergeProgress(display, clock=clock), clock)
    display.close()
    assert out.getvalue().splitlines() == [
        "mergeflow: inspecting the checkpoint",
        "mergeflow: loading 2 rank files",
        "mergeflow: writing 1.5 kB in 2 shards (3 tensors)",
        "mergeflow: wrote 1.0 kB in 10.0 s (100 B/s), resumed 500 B an earlier run had written",
        "mergeflow: hashing 2 rank files",
        "mergeflow: validating",
        "mergeflow: publishing",
        "mergeflow: done in 13.0 s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_failed_merge_says_how_far_it_wrote_before_the_error_line() -> None:
    clock, out = Clock(), io.StringIO()
    with pytest.raises(OSError), stderr_progress(stream=out):
        _a_merge(MERGE_PROGRESS.start(clock=clock), clock, fail_at=400)
        raise OSError(errno.ENOSPC, "No space left on device")
    lines = out.getvalue().splitlines()
    assert lines[-1] == "mergeflow: stopped while writing: 400 B of 1.5 kB written (27%)", lines
    assert all(line.startswith("mergeflow: ") for line in lines)


def test_a_failure_before_any_write_adds_no_line() -> None:
    clock, out = Clock(), io.StringIO()
    with pytest.raises(ValueError), stderr_progress(stream=out):
        MERGE_PROGRESS.start(clock=clock).begin(INSPECTING)
        raise ValueError("refused")
    assert out.getvalue().splitlines() == ["mergeflow: inspecting the checkpoint"]


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_a_terminal_gets_a_rich_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")  # a dumb terminal gets the plain lines
    clock, buf = Clock(), io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    display = StderrProgress(console=console, clock=clock)
    assert display.live
    progress = MergeProgress(display, clock=clock)
    progress.begin(INSPECTING)
    clock.advance(1.0)
    progress.begin_writing([1000, 1000], tensors=4)
    for _ in range(5):
        clock.advance(1.0)
        progress.wrote(0, 100)
    display.refresh()
    mid_write = _plain(buf.getvalue())
    assert "mergeflow: writing" in mid_write and "━" in mid_write  # rich's bar
    assert "500 B of 2.0 kB   25%  100 B/s  ETA 15.0 s" in mid_write  # bytes of total, percent, rate, ETA
    progress.shard_done(0)
    progress.shard_done(1)
    progress.begin(VALIDATING)
    display.close()
    text = _plain(buf.getvalue())
    lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines()]
    kept = [line for line in lines if line.startswith("mergeflow: ") and "  " not in line and "━" not in line]  # not the bar
    assert "mergeflow: inspected the checkpoint in 1.0 s" in kept
    assert any(line.startswith("mergeflow: wrote 2.0 kB in 5.0 s") for line in kept), kept
    assert "mergeflow: validated in 0.0 s" in kept and kept[-1] == "mergeflow: done in 6.0 s", kept
    assert "\x1b[" in buf.getvalue()  # redrawn in place by rich, cursor codes and all


# --- the command line and the UI -----------------------------------------------------------------


def test_the_cli_prints_the_phases_to_a_pipe(tmp_path: Path, prefect_server: Any, pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)  # the real W=2 checkpoint, copied: no torch build here
    target = tmp_path / "out"
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    proc = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--target_dir", str(target),
                                 "--base_model", str(ex.base_dir), "--output_format", "transformer"], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"output_dir": str(target),
                                                                 "manifest_path": str(target / "merge_manifest.json")}
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr  # never a redraw into a pipe
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert all(line.startswith("mergeflow: ") for line in lines), proc.stderr
    links = [i for i, line in enumerate(lines) if line.startswith("mergeflow: flow run ")]
    assert links in ([], [0]), proc.stderr  # the UI link (when the server has a UI) comes first
    phases = [line for line in lines if not line.startswith("mergeflow: flow run ")]
    tensors = output_state(target)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards = len(list(target.glob("*.safetensors")))
    assert phases[:3] == [
        "mergeflow: inspecting the checkpoint",
        "mergeflow: loading 2 rank files",
        f"mergeflow: writing {human_bytes(total)} in {shards} shard{'s' if shards > 1 else ''} ({len(tensors)} tensors)",
    ], proc.stderr
    wrote = re.fullmatch(r"mergeflow: wrote (.+) in ([0-9.]+ s|[0-9:]+) \((.+/s)\)", phases[3])  # the final rate line
    assert wrote is not None and wrote.group(1) == human_bytes(total), phases[3]
    assert phases[4:7] == ["mergeflow: hashing 2 rank files", "mergeflow: validating", "mergeflow: publishing"], proc.stderr
    assert re.fullmatch(r"mergeflow: done in .+", phases[7]) and len(phases) == 8, proc.stderr


def _progress_of(run_id: Any) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
    )

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), type=ArtifactFilterType(any_=["progress"])))

    found = asyncio.run(read())
    assert len(found) == 1, found
    return found[0]


def test_the_progress_artifact_ends_at_the_bytes_written(tmp_path: Path, prefect_api: object, pristine_flux_w2: Export) -> None:
    from prefect.context import TaskRunContext

    from mergeflow import merge_model
    from mergeflow.errors import MergeflowError
    from mergeflow.io.session import export_session

    ex = clone_export(pristine_flux_w2, tmp_path)
    writes: list[tuple[Any, int]] = []  # (flow run, bytes) of every tensor written

    def record(nbytes: int, ntensors: int) -> None:
        context = TaskRunContext.get()
        assert context is not None
        writes.append((context.task_run.flow_run_id, nbytes))

    # One export session per merge (merge_model runs in the one set here): its shard writes reach `record`.
    with export_session() as session, session.writes.listening(record):
        merge_model(ex.config(tmp_path / "ok"))
    run = writes[0][0]
    total = sum(n for _, n in writes)
    done = _progress_of(run)
    assert float(done.data) == 100.0 and human_bytes(total) in done.description

    writes.clear()

    def disk_full_at_the_third_tensor(nbytes: int, ntensors: int) -> None:
        record(nbytes, ntensors)  # after the flow's own listener: this tensor's bytes are counted
        if len(writes) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")

    with export_session() as session, session.writes.listening(disk_full_at_the_third_tensor), \
            pytest.raises(MergeflowError, match="no space"):
        merge_model(ex.config(tmp_path / "full"))
    assert len({r for r, _ in writes}) == 1 and len(writes) == 3  # one shard, one writer, stopped at once
    stopped = _progress_of(writes[0][0])
    expected = 100.0 * sum(n for _, n in writes) / total
    assert 0 < expected < 100 and float(stopped.data) == pytest.approx(expected)
    assert stopped.description.startswith("Stopped: ")


# --- Prefect's telemetry notice --------------------------------------------------------------------

TELEMETRY_NOTICE = "Prefect collects anonymous usage data"


def _stderr_on_a_terminal(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run `python -m mergeflow ARGS` cold with its stderr on a pseudo-terminal; (exit status, what the terminal got)."""
    import os
    import pty
    import subprocess
    import sys
    import threading

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mergeflow", *args], env=env, cwd=forked_cli.REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every holder of the terminal has gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=timeout)
    finally:
        proc.kill()
        reader.join(timeout=30)
        os.close(leader)
    return status, _plain(b"".join(chunks).decode("utf-8", "replace"))


def test_prefect_s_telemetry_notice_comes_before_the_progress_never_inside_it(
        tmp_path: Path, prefect_server: Any, pristine_flux_w2: Export) -> None:
    # A PREFECT_HOME that Prefect takes for a known user's (the local server keeps its database and
    # `storage` there) and a Dask runner, whose worker processes import Prefect once the bar is up:
    # the notice was printed by a worker, in the middle of the progress. One worker process shows it as
    # well as two (each imports Prefect, torch and the flows: the test took ~3 CPU-s less with one).
    from prefect._internal.analytics.ci_detection import CI_ENV_VARS

    ex = clone_export(pristine_flux_w2, tmp_path)
    home = tmp_path / "prefect-home"
    (home / "storage").mkdir(parents=True)
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(home), "TERM": "xterm-256color",
           # The Dask workers' scratch space here, not a dask-scratch-space left in /tmp by every suite run.
           "DASK_TEMPORARY_DIRECTORY": str(tmp_path / "dask-scratch")}
    for name in (*CI_ENV_VARS, "DO_NOT_TRACK"):  # telemetry as a user's terminal has it (Prefect never shows it in CI)
        env.pop(name, None)
    status, terminal = _stderr_on_a_terminal(
        ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--target_dir", str(tmp_path / "out"),
         "--base_model", str(ex.base_dir), "--output_format", "transformer", "--task_runner", "dask",
         "--workers", "1"], env)
    assert status == 0, terminal
    assert terminal.count(TELEMETRY_NOTICE) == 1, terminal  # shown once: Prefect's own rule, kept
    assert terminal.index(TELEMETRY_NOTICE) < terminal.index("mergeflow: inspecting"), terminal
    assert "mergeflow: done in " in terminal, terminal
