"""Watching a training output directory for completed checkpoints (no Prefect here).

`mergeflow watch TRAIN_OUTPUT_DIR` (mergeflow.flows.watch) emits one event per checkpoint this watcher
reports: file-system notifications (watchdog) wake the watcher, a periodic re-scan backs them up, and a checkpoint counts as complete only when
its structure is whole and nothing in it changed for `stable_seconds`. What was emitted is
kept in a JSON state file, so a restarted watcher never emits the same checkpoint twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import ApiAccessError, CheckpointError, UsageError
from mergeflow.formats.verl_checkpoint import (
    FSDP_CONFIG,
    RANK_FILE_RE,
    read_fsdp_config,
    step_of,
)
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.ops.watch_state import STATE_FILE_NAME, WatchState

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# Bursts of write notifications (a rank file streaming to disk) collapse into one scan.
_MIN_SCAN_INTERVAL = 0.1
# How quickly run() notices an external stop_event while it sleeps.
_STOP_CHECK_INTERVAL = 0.25
# Our own reads of the checkpoint (and the merge's) must not wake the watcher.
_IGNORED_EVENT_TYPES = frozenset({"opened", "closed_no_write"})

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class CheckpointCandidate:
    """One `global_step_N/actor` directory of a training run."""

    step: int
    actor_dir: Path


@dataclass(frozen=True)
class CheckpointSnapshot:
    """What one look at an actor directory saw."""

    ready: bool  # the file set is whole; stability is judged across snapshots
    reason: str  # why not ready; empty when ready
    fault: bool  # the reason will not go away by waiting (e.g. a stale rank file)
    fingerprint: str  # sha256 over every file's relative path, size and mtime


def find_checkpoints(train_dir: str | os.PathLike[str]) -> list[CheckpointCandidate]:
    """The `global_step_N/actor` directories under train_dir, lowest step first."""
    root = Path(train_dir).expanduser().absolute()
    found: list[CheckpointCandidate] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            step = step_of(entry.name)
            if step is not None and entry.is_dir() and (root / entry.name / "actor").is_dir():
                found.append(CheckpointCandidate(step, root / entry.name / "actor"))
    return sorted(found)


def training_dir(train_dir: str | os.PathLike[str]) -> Path:
    """The training output directory, absolute; refused when it does not exist."""
    path = Path(train_dir).expanduser().absolute()
    if not path.is_dir():
        raise UsageError(f"Training output directory {path} does not exist; start the watcher on an existing directory.")
    return path


def _fingerprint(actor_dir: Path) -> str:
    """Digest of (path, size, mtime_ns) for every file below actor_dir."""
    entries: list[tuple[str, int, int]] = []
    for folder, _dirs, files in os.walk(actor_dir):
        for name in files:
            path = Path(folder) / name
            stat = path.stat()
            entries.append((path.relative_to(actor_dir).as_posix(), stat.st_size, stat.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(entries)).encode("utf-8")).hexdigest()


def _declared_world_size(actor_dir: Path) -> int | str:
    """world_size from fsdp_config.json, or the reason it cannot be read (yet)."""
    if not (actor_dir / FSDP_CONFIG).is_file():
        return "fsdp_config.json is not written yet"
    try:  # the exporter's own reader: what it refuses would fail the merge; a half-written file only means "not yet"
        return read_fsdp_config(actor_dir).world_size
    except CheckpointError as exc:
        return f"{exc} (not usable yet)"


def inspect_checkpoint(actor_dir: str | os.PathLike[str]) -> CheckpointSnapshot:
    """Check an actor directory's file set once: fsdp_config, all W rank files, HF config."""
    actor_dir = Path(actor_dir)
    try:
        return _inspect_file_set(actor_dir, _fingerprint(actor_dir))
    except FileNotFoundError:  # a file vanished between listing and stat: still being written
        return CheckpointSnapshot(False, "files are being replaced", False, "")
    except OSError as exc:  # e.g. permissions: waiting will not help, so say it once
        return CheckpointSnapshot(False, f"it cannot be read ({exc})", True, "")


def _inspect_file_set(actor_dir: Path, fingerprint: str) -> CheckpointSnapshot:
    def not_ready(reason: str, fault: bool = False) -> CheckpointSnapshot:
        return CheckpointSnapshot(False, reason, fault, fingerprint)

    world_size = _declared_world_size(actor_dir)
    if isinstance(world_size, str):
        return not_ready(world_size)
    expected = {f"model_world_size_{world_size}_rank_{rank}.pt" for rank in range(world_size)}
    present = {name for name in os.listdir(actor_dir) if RANK_FILE_RE.match(name)}
    unexpected = sorted(present - expected)
    if unexpected:
        return not_ready(
            f"rank files that do not belong to world_size {world_size}: {', '.join(unexpected)} "
            "(left from another run? remove them)",
            fault=True,
        )
    missing = expected - present
    if missing:
        return not_ready(f"{len(missing)} of {world_size} model rank files are not written yet")
    if any((actor_dir / name).stat().st_size == 0 for name in expected):
        return not_ready("a model rank file is still empty")
    hf_config = actor_dir / "huggingface" / "config.json"
    if not hf_config.is_file():
        return not_ready("huggingface/config.json is not written yet")
    try:  # as strict as the merge's own read of it
        read_json_strict(hf_config, CheckpointError, "huggingface/config.json")
    except CheckpointError:
        return not_ready("huggingface/config.json is not valid JSON (yet)")
    behind = _tracker_behind(actor_dir)
    if behind:
        return not_ready(behind)
    return CheckpointSnapshot(True, "", False, fingerprint)


def _tracker_behind(actor_dir: Path) -> str:
    """Why verl's latest_checkpointed_iteration.txt says this step is not saved yet ('' if it does not).

    verl writes the tracker beside global_step_N/ after every rank has saved step N. Without a
    tracker (other trainers) or with an unreadable one, the file-set checks decide alone.
    """
    step = step_of(actor_dir.parent.name)
    if step is None:
        return ""
    try:
        latest = int((actor_dir.parent.parent / TRACKER_FILE).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return ""
    if step > latest:
        return f"{TRACKER_FILE} says step {latest}; training has not finished saving step {step}"
    return ""


def checkpoint_is_complete(actor_dir: str | os.PathLike[str], *, stable_seconds: float) -> bool:
    """True when the file set is whole and unchanged across two looks stable_seconds apart."""
    first = inspect_checkpoint(actor_dir)
    if not first.ready:
        return False
    time.sleep(stable_seconds)
    second = inspect_checkpoint(actor_dir)
    return second.ready and second.fingerprint == first.fingerprint


@dataclass
class _Pending:
    fingerprint: str
    since: float
    logged: str = ""  # the reason last logged at INFO or above, so each is said once


class CheckpointWatcher:
    """Emits `emit(actor_dir, step)` exactly once per completed checkpoint under train_dir."""

    def __init__(
        self,
        train_dir: str | os.PathLike[str],
        emit: Callable[[Path, int], None],
        *,
        stable_seconds: float = 5.0,
        poll_seconds: float = 1.0,
        state_file: str | os.PathLike[str] | None = None,
        retry_seconds: float = 30.0,
    ) -> None:
        self.train_dir = training_dir(train_dir)
        if stable_seconds < 0 or poll_seconds <= 0 or retry_seconds < 0:
            raise UsageError("stable_seconds and retry_seconds must be >= 0 and poll_seconds > 0.")
        self.emit = emit
        self.stable_seconds = stable_seconds
        self.poll_seconds = poll_seconds
        self.retry_seconds = retry_seconds
        self.state_file = Path(state_file).absolute() if state_file else self.train_dir / STATE_FILE_NAME
        self.state = WatchState.load(self.state_file, self.train_dir)
        self._pending: dict[Path, _Pending] = {}
        self._retry_at: dict[Path, float] = {}
        self._wake = threading.Event()

    def scan(self) -> tuple[list[CheckpointCandidate], float]:
        """Look at every checkpoint once, emit those that are due; returns (emitted, seconds to next due)."""
        emitted: list[CheckpointCandidate] = []
        next_due = float("inf")
        seen: set[Path] = set()
        for candidate in find_checkpoints(self.train_dir):
            seen.add(candidate.actor_dir)
            due = self._consider(candidate, time.monotonic(), emitted)
            next_due = min(next_due, due)
        for gone in set(self._pending) - seen:
            del self._pending[gone]
        return emitted, next_due

    def _consider(self, candidate: CheckpointCandidate, now: float, emitted: list[CheckpointCandidate]) -> float:
        """Advance one checkpoint's state; returns seconds until it needs another look."""
        snapshot = inspect_checkpoint(candidate.actor_dir)
        pending = self._pending.get(candidate.actor_dir)
        if pending is None or pending.fingerprint != snapshot.fingerprint:
            pending = self._pending[candidate.actor_dir] = _Pending(snapshot.fingerprint, now, pending.logged if pending else "")
        if snapshot.ready and self.state.already_emitted(candidate.actor_dir, snapshot.fingerprint):
            return float("inf")
        waited = now - pending.since
        if not snapshot.ready:
            if snapshot.fault and pending.logged != snapshot.reason:
                pending.logged = snapshot.reason
                logger.warning("Not emitting %s: %s.", candidate.actor_dir, snapshot.reason)
            elif waited >= self.stable_seconds and pending.logged != snapshot.reason:
                pending.logged = snapshot.reason
                logger.info("Waiting for %s: %s.", candidate.actor_dir, snapshot.reason)
            else:
                logger.debug("Waiting for %s: %s.", candidate.actor_dir, snapshot.reason)
            # One more look when the stability window ends, to report a checkpoint stuck incomplete.
            return self.stable_seconds - waited if waited < self.stable_seconds else float("inf")
        if waited < self.stable_seconds:
            return self.stable_seconds - waited
        retry_at = self._retry_at.get(candidate.actor_dir, 0.0)
        if now < retry_at:
            return retry_at - now
        try:
            self.emit(candidate.actor_dir, candidate.step)
        except ApiAccessError:
            raise  # refused credentials stay refused: the watcher ends with the reason instead of retrying for ever
        except Exception as exc:  # the watcher outlives one failed emit (a server down) and retries later
            self._retry_at[candidate.actor_dir] = now + self.retry_seconds
            logger.error("Emitting %s failed (%s); retrying in %g s.", candidate.actor_dir, exc, self.retry_seconds)
            return self.retry_seconds
        self._retry_at.pop(candidate.actor_dir, None)
        self.state.record(candidate.actor_dir, candidate.step, snapshot.fingerprint)
        emitted.append(candidate)
        logger.info("Emitted checkpoint step %d: %s.", candidate.step, candidate.actor_dir)
        return float("inf")

    def notify(self) -> None:
        """Wake the watcher for an immediate re-scan (used by the file-system observer)."""
        self._wake.set()

    def run(self, stop_event: threading.Event | None = None, timeout: float | None = None) -> list[CheckpointCandidate]:
        """Watch until stop_event is set or timeout seconds pass; returns what was emitted."""
        stop = stop_event if stop_event is not None else threading.Event()
        deadline = None if timeout is None else time.monotonic() + timeout
        emitted: list[CheckpointCandidate] = []
        with self._exclusive(), self._observing():
            while not stop.is_set():
                self._wake.clear()
                started = time.monotonic()
                new, next_due = self.scan()
                emitted.extend(new)
                wait = min(self.poll_seconds, next_due)
                if deadline is not None:
                    if started >= deadline:
                        break
                    wait = min(wait, deadline - time.monotonic())
                if self._sleep(wait, stop):
                    time.sleep(max(0.0, _MIN_SCAN_INTERVAL - (time.monotonic() - started)))
        return emitted

    def _sleep(self, seconds: float, stop: threading.Event) -> bool:
        """Wait up to seconds for a notification (True) while staying responsive to stop."""
        end = time.monotonic() + seconds
        while not stop.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            if self._wake.wait(min(remaining, _STOP_CHECK_INTERVAL)):
                return True
        return False

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold a lock beside the state file: two watchers would emit everything twice."""
        lock_path = self.state_file.with_name(self.state_file.name + ".lock")
        try:
            lock = open(lock_path, "a")
        except OSError as exc:
            raise UsageError(f"Cannot create {lock_path} ({exc}); pass a writable state_file.") from exc
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise UsageError(f"Another mergeflow watcher holds {lock_path}; stop it before starting a second one.") from exc
            yield

    @contextlib.contextmanager
    def _observing(self) -> Iterator[None]:
        """Run a watchdog observer that wakes the loop on relevant file-system changes."""
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        own_files = (str(self.state_file), str(self.state_file.parent / f".{self.state_file.name}."))
        watcher = self

        class _Wake(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                path = os.fsdecode(event.src_path)
                if event.event_type in _IGNORED_EVENT_TYPES or path.startswith(own_files):
                    return
                watcher.notify()

        # watchdog re-registers its (identical) callback when a new directory tree appears
        # in a burst and warns each time; the warning is harmless noise on the user's terminal.
        warnings.filterwarnings("ignore", message=r"Callback with id .* already exists for watch", category=RuntimeWarning)
        observer = Observer()
        try:
            observer.schedule(_Wake(), str(self.train_dir), recursive=True)
            observer.start()
        except OSError as exc:  # e.g. the inotify watch limit; the periodic re-scan still works
            logger.warning("File-system notifications unavailable (%s); re-scanning every %g s instead.", exc, self.poll_seconds)
            yield
            return
        try:
            yield
        finally:
            observer.stop()
            observer.join(timeout=5.0)
