"""What the checkpoint watcher has emitted, kept in a JSON file so restarts never re-emit."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mergeflow.errors import UsageError

STATE_FILE_NAME = ".mergeflow-watch.json"
STATE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class EmittedRecord:
    """One checkpoint the watcher has emitted."""

    step: int
    fingerprint: str
    emitted_at: str


class WatchState:
    """Emitted checkpoints, persisted as JSON; keys are actor dirs relative to the train dir."""

    def __init__(self, path: Path, train_dir: Path, emitted: dict[str, EmittedRecord] | None = None) -> None:
        self.path = path
        self.train_dir = train_dir
        self.emitted: dict[str, EmittedRecord] = dict(emitted or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str], train_dir: str | os.PathLike[str]) -> WatchState:
        """Read the state file; a missing file is an empty state, a corrupt one an error."""
        path, train_dir = Path(path), Path(train_dir)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls(path, train_dir)
        except (OSError, ValueError) as exc:
            raise UsageError(f"Watch state {path} is unreadable ({exc}); fix or delete it (deleting re-emits every checkpoint).") from exc
        try:
            if data["schema_version"] != STATE_SCHEMA_VERSION:
                raise ValueError(f"schema_version {data['schema_version']!r}")
            emitted = {key: EmittedRecord(**record) for key, record in data["emitted"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"Watch state {path} has an unknown layout ({exc}); fix or delete it (deleting re-emits every checkpoint).") from exc
        return cls(path, train_dir, emitted)

    def key(self, actor_dir: Path) -> str:
        """State key of an actor dir: relative to the train dir, so moving the run keeps it."""
        try:
            return actor_dir.relative_to(self.train_dir).as_posix()
        except ValueError:
            return str(actor_dir)

    def already_emitted(self, actor_dir: Path, fingerprint: str) -> bool:
        """True when this exact content of actor_dir was emitted before."""
        record = self.emitted.get(self.key(actor_dir))
        return record is not None and record.fingerprint == fingerprint

    def record(self, actor_dir: Path, step: int, fingerprint: str) -> None:
        """Remember an emitted checkpoint and persist the state at once."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.emitted[self.key(actor_dir)] = EmittedRecord(step, fingerprint, now)
        self.save()

    def save(self) -> None:
        """Write the state atomically (temp file + rename), forgetting deleted checkpoints."""
        self.emitted = {key: rec for key, rec in self.emitted.items() if (self.train_dir / key).is_dir()}
        data = {"schema_version": STATE_SCHEMA_VERSION, "emitted": {k: asdict(v) for k, v in sorted(self.emitted.items())}}
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle, indent=2, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
