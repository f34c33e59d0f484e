"""The checkpoint watcher: completeness rules, exactly-once emission, restart safety."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from mergeflow.errors import UsageError
from mergeflow.ops.watch import (
    STATE_FILE_NAME,
    CheckpointCandidate,
    CheckpointWatcher,
    WatchState,
    checkpoint_is_complete,
    find_checkpoints,
    inspect_checkpoint,
)

STABLE = 0.3
POLL = 0.2


def write_fsdp_config(actor: Path, world_size: int) -> None:
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4))


def write_hf_config(actor: Path) -> None:
    (actor / "huggingface").mkdir(parents=True, exist_ok=True)
    (actor / "huggingface" / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))


def write_checkpoint(train_dir: Path, step: int, world_size: int = 2) -> Path:
    """A whole checkpoint written at once (rank files are dummy bytes: the watcher never reads them)."""
    actor = train_dir / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    for rank in range(world_size):
        (actor / f"model_world_size_{world_size}_rank_{rank}.pt").write_bytes(os.urandom(64))
    write_hf_config(actor)
    write_fsdp_config(actor, world_size)
    return actor


class Recorder:
    """An emit callback that records (actor_dir, step, time) and lets tests wait for calls."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls: list[tuple[Path, int, float]] = []
        self.fail_first = fail_first
        self.attempts = 0
        self._cond = threading.Condition()

    def __call__(self, actor_dir: Path, step: int) -> None:
        with self._cond:
            self.attempts += 1
            if self.attempts <= self.fail_first:
                raise ConnectionError("server down")
            self.calls.append((actor_dir, step, time.monotonic()))
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 15.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= count, timeout), f"only {len(self.calls)} emits"


class Running:
    """A watcher running in a background thread; stopped (bounded) on exit."""

    def __init__(self, watcher: CheckpointWatcher) -> None:
        self.stop = threading.Event()
        self.result: list[CheckpointCandidate] = []
        self.thread = threading.Thread(target=self._run, args=(watcher,), daemon=True)

    def _run(self, watcher: CheckpointWatcher) -> None:
        self.result = watcher.run(stop_event=self.stop, timeout=60)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "watcher did not stop"


def test_find_checkpoints_lists_actor_dirs_by_step(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 2)
    (tmp_path / "global_step_5").mkdir()  # no actor/ yet
    (tmp_path / "global_step_x" / "actor").mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    assert find_checkpoints(tmp_path) == [
        CheckpointCandidate(2, tmp_path / "global_step_2" / "actor"),
        CheckpointCandidate(10, tmp_path / "global_step_10" / "actor"),
    ]
    assert find_checkpoints(tmp_path / "missing") == []


def test_inspect_checkpoint_reports_each_missing_piece(tmp_path: Path) -> None:
    actor = tmp_path / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    assert "fsdp_config.json is not written" in inspect_checkpoint(actor).reason
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_')
    assert "not valid JSON" in inspect_checkpoint(actor).reason
    (actor / "fsdp_config.json").write_text('{"world_size": 2, "world_size": 2}')
    assert "not valid JSON" in inspect_checkpoint(actor).reason
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": true}')
    assert "world_size must be an integer" in inspect_checkpoint(actor).reason  # the merge's own reader says why
    write_fsdp_config(actor, 2)
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"x")
    assert "1 of 2 model rank files" in inspect_checkpoint(actor).reason
    (actor / "model_world_size_2_rank_1.pt").write_bytes(b"")
    assert "still empty" in inspect_checkpoint(actor).reason
    (actor / "model_world_size_2_rank_1.pt").write_bytes(b"x")
    assert "huggingface/config.json" in inspect_checkpoint(actor).reason
    write_hf_config(actor)
    ready = inspect_checkpoint(actor)
    assert ready.ready and not ready.fault and ready.reason == ""
    (actor / "model_world_size_4_rank_3.pt").write_bytes(b"x")
    stale = inspect_checkpoint(actor)
    assert not stale.ready and stale.fault and "model_world_size_4_rank_3.pt" in stale.reason
    assert stale.fingerprint != ready.fingerprint


def test_checkpoint_is_complete_needs_a_quiet_window(tmp_path: Path) -> None:
    actor = write_checkpoint(tmp_path, 1)
    assert checkpoint_is_complete(actor, stable_seconds=0.1)
    growing = actor / "optim_world_size_2_rank_0.pt"
    stop = threading.Event()

    def grow() -> None:
        with open(growing, "ab") as handle:
            while not stop.is_set():
                handle.write(b"y" * 1024)
                handle.flush()
                time.sleep(0.02)

    writer = threading.Thread(target=grow, daemon=True)
    writer.start()
    try:
        assert not checkpoint_is_complete(actor, stable_seconds=0.2)
    finally:
        stop.set()
        writer.join(timeout=5)


def slow_save(train_dir: Path, step: int, world_size: int, done: dict[str, float]) -> None:
    """Write a checkpoint the way ranks do: files one by one, rank 0 growing, fsdp_config last."""
    actor = train_dir / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    growing = actor / f"model_world_size_{world_size}_rank_0.pt"
    with open(growing, "wb") as handle:
        for _ in range(12):  # ~0.6 s of growth, longer than STABLE
            handle.write(os.urandom(4096))
            handle.flush()
            time.sleep(0.05)
    for rank in range(1, world_size):
        (actor / f"model_world_size_{world_size}_rank_{rank}.pt").write_bytes(os.urandom(256))
        time.sleep(0.1)
    write_hf_config(actor)
    time.sleep(0.1)
    write_fsdp_config(actor, world_size)
    done["finished"] = time.monotonic()


def test_slowly_written_checkpoint_emits_once_after_the_last_write(tmp_path: Path) -> None:
    recorder = Recorder()
    watcher = CheckpointWatcher(tmp_path, recorder, stable_seconds=STABLE, poll_seconds=POLL)
    done: dict[str, float] = {}
    with Running(watcher) as running:
        writer = threading.Thread(target=slow_save, args=(tmp_path, 3, 4, done), daemon=True)
        writer.start()
        writer.join(timeout=20)
        recorder.wait_for(1)
        time.sleep(4 * STABLE)  # room for a wrong second emit
    assert [(path, step) for path, step, _ in recorder.calls] == [(tmp_path / "global_step_3" / "actor", 3)]
    assert recorder.calls[0][2] > done["finished"]
    assert recorder.calls[0][2] >= done["finished"] + STABLE - 0.05  # a full quiet window after it
    assert running.result == [CheckpointCandidate(3, tmp_path / "global_step_3" / "actor")]


def test_file_growing_after_structure_is_whole_delays_the_emit(tmp_path: Path) -> None:
    actor = write_checkpoint(tmp_path, 1)
    recorder = Recorder()
    stable = 0.5
    watcher = CheckpointWatcher(tmp_path, recorder, stable_seconds=stable, poll_seconds=POLL)
    with open(actor / "model_world_size_2_rank_1.pt", "ab") as handle:
        with Running(watcher):
            for _ in range(30):  # 1.5 s of appends, each well inside the stability window
                handle.write(os.urandom(1024))
                handle.flush()
                time.sleep(0.05)
            handle.close()
            finished = time.monotonic()
            recorder.wait_for(1)
            time.sleep(3 * stable)
    assert len(recorder.calls) == 1
    assert recorder.calls[0][2] >= finished + stable - 0.05  # mtime granularity slack


def test_two_checkpoints_two_emits_and_a_restart_emits_nothing(tmp_path: Path) -> None:
    recorder = Recorder()
    write_checkpoint(tmp_path, 1)
    with Running(CheckpointWatcher(tmp_path, recorder, stable_seconds=STABLE, poll_seconds=POLL)):
        recorder.wait_for(1)
        write_checkpoint(tmp_path, 2)
        recorder.wait_for(2)
    assert [step for _, step, _ in recorder.calls] == [1, 2]
    state = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert sorted(state["emitted"]) == ["global_step_1/actor", "global_step_2/actor"]

    restarted = Recorder()
    emitted = CheckpointWatcher(tmp_path, restarted, stable_seconds=STABLE, poll_seconds=POLL).run(timeout=4 * STABLE)
    assert emitted == [] and restarted.attempts == 0

    # A checkpoint re-saved under the same step (resumed run) is new content: emit it again.
    (tmp_path / "global_step_2" / "actor" / "model_world_size_2_rank_0.pt").write_bytes(os.urandom(99))
    again = CheckpointWatcher(tmp_path, restarted, stable_seconds=STABLE, poll_seconds=POLL).run(timeout=6 * STABLE)
    assert [c.step for c in again] == [2] and restarted.attempts == 1


def test_stale_rank_file_is_not_emitted_and_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    actor = write_checkpoint(tmp_path, 7, world_size=2)
    (actor / "model_world_size_4_rank_2.pt").write_bytes(b"old run")
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="mergeflow.ops.watch"):
        emitted = CheckpointWatcher(tmp_path, recorder, stable_seconds=STABLE, poll_seconds=POLL).run(timeout=5 * STABLE)
    assert emitted == [] and recorder.attempts == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model_world_size_4_rank_2.pt" in warnings[0]


def test_failed_emit_is_retried_and_recorded_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_checkpoint(tmp_path, 1)
    recorder = Recorder(fail_first=1)
    watcher = CheckpointWatcher(tmp_path, recorder, stable_seconds=STABLE, poll_seconds=POLL, retry_seconds=0.3)
    with caplog.at_level(logging.ERROR, logger="mergeflow.ops.watch"):
        with Running(watcher):
            recorder.wait_for(1)
            time.sleep(3 * STABLE)
    assert recorder.attempts == 2 and len(recorder.calls) == 1
    assert any("server down" in r.getMessage() for r in caplog.records)


def test_refused_credentials_end_the_watcher_without_retry(tmp_path: Path) -> None:
    """A 401/403 stays one on every retry: the watcher ends with it (the CLI's one line, exit 2); a server down is retried."""
    from mergeflow.errors import ApiAccessError

    write_checkpoint(tmp_path, 1)
    attempts: list[int] = []

    def refused(actor_dir: Path, step: int) -> None:
        attempts.append(step)
        raise ApiAccessError("The Prefect API at http://127.0.0.1:1/api refused PREFECT_API_AUTH_STRING (401)")

    watcher = CheckpointWatcher(tmp_path, refused, stable_seconds=0, poll_seconds=POLL, retry_seconds=0)
    with pytest.raises(ApiAccessError, match="refused PREFECT_API_AUTH_STRING"):
        watcher.run(timeout=30)
    assert attempts == [1] and not (tmp_path / STATE_FILE_NAME).exists()


def test_custom_state_file_and_second_watcher_refused(tmp_path: Path) -> None:
    train = tmp_path / "run"
    train.mkdir()
    state_file = tmp_path / "state.json"
    write_checkpoint(train, 4)
    recorder = Recorder()
    with Running(CheckpointWatcher(train, recorder, stable_seconds=STABLE, poll_seconds=POLL, state_file=state_file)):
        recorder.wait_for(1)
        with pytest.raises(UsageError, match="Another mergeflow watcher"):
            CheckpointWatcher(train, Recorder(), state_file=state_file).run(timeout=1)
    assert not (train / STATE_FILE_NAME).exists()
    state = WatchState.load(state_file, train)
    assert set(state.emitted) == {"global_step_4/actor"} and state.emitted["global_step_4/actor"].step == 4


def test_corrupt_state_file_is_an_error_not_a_re_emit(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE_NAME).write_text("{not json")
    with pytest.raises(UsageError, match="delete it"):
        CheckpointWatcher(tmp_path, Recorder())
    with pytest.raises(UsageError, match="does not exist"):
        CheckpointWatcher(tmp_path / "absent", Recorder())


def test_file_system_notifications_wake_the_watcher_between_polls(tmp_path: Path) -> None:
    recorder = Recorder()
    # A 60 s poll would miss the deadline below: only the watchdog observer can wake it.
    watcher = CheckpointWatcher(tmp_path, recorder, stable_seconds=STABLE, poll_seconds=60)
    with Running(watcher):
        time.sleep(0.5)  # let the first (empty) scan finish and the observer start
        written = time.monotonic()
        write_checkpoint(tmp_path, 9)
        recorder.wait_for(1, timeout=10)
    assert recorder.calls[0][1] == 9 and recorder.calls[0][2] - written < 8


def test_watch_checks_api_and_template_before_watching(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mergeflow.errors import EventError
    from mergeflow.flows.watch import watch

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(EventError, match="PREFECT_API_URL"):
            watch(tmp_path, timeout=1)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with pytest.raises(UsageError, match="target_dir_template"):
            watch(tmp_path, target_dir_template="/out/{epoch}", timeout=1)
    assert not (tmp_path / STATE_FILE_NAME).exists()
