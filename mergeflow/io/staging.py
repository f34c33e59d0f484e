"""Kept staging directories of failed or interrupted exports: find, describe, remove.

A failed export leaves `.<target>.mergeflow-staging-<key>/` beside its target (see
`mergeflow.io.paths`) so that rerunning the same command resumes it. `mergeflow staging list`
shows them; `mergeflow staging clean` removes them, never while an export holds the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import (
    ConcurrentExportError,
    FileAccessError,
    MergeflowError,
    TargetExistsError,
    UsageError,
)
from mergeflow.io.fs import TargetLock
from mergeflow.io.jsonfiles import is_partial_write
from mergeflow.io.paths import STAGING_MARKER, lock_path_for

# Staging dirs live directly beside targets; `serve` puts targets at <root>/<run>/global_step_N,
# so three levels below the scanned directory cover the usual layouts without a full walk.
DEFAULT_SCAN_DEPTH = 3


@dataclass(frozen=True)
class StagingInfo:
    """One kept staging directory and what a rerun of its export would find in it."""

    path: str
    target: str
    size_bytes: int
    age_seconds: float
    resumable_shards: int
    has_manifest: bool
    locked: bool
    # "" while a rerun of its export may resume it; else why nothing will (see `orphan_reason`).
    orphaned: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path, "target": self.target, "size_bytes": self.size_bytes,
            "age_seconds": round(self.age_seconds, 1), "resumable_shards": self.resumable_shards,
            "has_manifest": self.has_manifest, "locked": self.locked, "orphaned": self.orphaned,
        }


def is_staging_dir(path: Path) -> bool:
    """True for a directory named like a mergeflow staging directory."""
    return path.name.startswith(".") and STAGING_MARKER in path.name and path.is_dir() and not path.is_symlink()


def target_of(staging: Path) -> Path:
    """The target an export staged in `staging` would publish to."""
    return staging.parent / staging.name[1:].split(STAGING_MARKER, 1)[0]


def artifact_root(path: Path) -> Path:
    """The artifact inside a staging directory, or `path` itself for anything else."""
    return path / "artifact" if is_staging_dir(path) and (path / "artifact").is_dir() else path


def find_staging(root: Path, *, depth: int = DEFAULT_SCAN_DEPTH) -> list[Path]:
    """Staging directories at most `depth` levels below root (root itself counts as level 1)."""
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    if is_staging_dir(root):
        return [root]
    found: list[Path] = []
    level = [root]
    for _ in range(depth):
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                path = Path(entry.path)
                if is_staging_dir(path):
                    found.append(path)
                elif not entry.name.startswith("."):  # hidden dirs (.git, caches) hold no targets
                    below.append(path)
        level = below
    return sorted(found)


def staging_dirs_of(target: Path) -> list[Path]:
    """The staging directories kept beside `target` (what rerunning its export resumes)."""
    target = Path(target).expanduser().absolute()
    if not target.parent.is_dir():
        return []
    return [p for p in find_staging(target.parent, depth=1) if target_of(p) == target]


def lock_is_held(lock: Path) -> bool:
    """True when a running export holds the flock on `lock` (a killed one's is released)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may have taken
    return False


def _tree_size_and_mtime(path: Path) -> tuple[int, float]:
    size, newest = 0, path.stat().st_mtime
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest


def count_resumable_shards(staging: Path) -> int:
    """Shard records whose staged file is still there with the recorded size (no hashing)."""
    work, count = staging / "work", 0
    for record in sorted(work.glob("shard-*.json")):
        try:
            data = json.loads(record.read_text())
            name, size = data["file_name"], data["size"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            continue
        matches = [p for p in (staging / "artifact").rglob(name) if p.is_file()]
        if any(p.stat().st_size == size for p in matches):
            count += 1
    return count


def orphan_reason(staging: Path) -> str:
    """Why no export will resume `staging` ("" when one may): its target exists, or a newer one replaced it.

    A staging dir is keyed by the target and the export's inputs and options; one of the same
    target that is not the newest was left by an export that was changed (or, before keys were
    built from resolved paths, spelled differently) and is resumed by nothing.
    """
    target = target_of(staging)
    if target.exists() or target.is_symlink():
        return f"its target {target} exists"
    siblings = [p for p in staging_dirs_of(target) if p != staging]
    newer = [p for p in siblings if _tree_size_and_mtime(p)[1] > _tree_size_and_mtime(staging)[1]]
    if newer:
        return f"another export of {target} staged in {newer[-1].name} later"
    return ""


def orphans_of(target: Path, current: Path | None = None) -> list[Path]:
    """Staging dirs of `target` other than `current` (the one this export uses): resumed by nothing now."""
    return [p for p in staging_dirs_of(target) if current is None or p != Path(current)]


def clear_publish_leftovers(target: Path) -> list[str]:
    """Remove what a kill after the publish rename left beside a published `target`; the paths removed.

    The rename moved the artifact out of its staging dir, so a staging dir of an existing target
    without `artifact/` is a finished export's remainder, and a lock file no process holds is a
    killed holder's. Nothing is touched while another export holds the lock.
    """
    target = Path(target).expanduser().absolute()
    if not (target.exists() or target.is_symlink()):
        return []
    lock = lock_path_for(target)
    had_lock = lock.exists()
    if not had_lock and all((p / "artifact").exists() for p in staging_dirs_of(target)):
        return []
    empty: list[Path] = []
    try:
        with TargetLock(lock):  # released, the lock file is unlinked: the stale one goes with it
            empty = [p for p in staging_dirs_of(target) if not (p / "artifact").exists()]  # listed under the lock
            for staging in empty:
                shutil.rmtree(staging)
    except FileAccessError:
        raise  # no lock file can be made beside the target: said as before FileAccessError became an OSError
    except (ConcurrentExportError, OSError):
        return []  # a running export (or one of ours in this process) owns them
    return [str(p) for p in empty] + ([str(lock)] if had_lock else [])


def check_target(target: Path) -> Path:
    """The target must not exist and its parent must; returns the absolute target."""
    target = Path(target).expanduser()
    if target.name in ("", ".", ".."):
        raise UsageError(f"--target_dir {target} must name a new directory")
    absolute = target.parent.resolve() / target.name
    if absolute.exists() or absolute.is_symlink():
        removed = clear_publish_leftovers(absolute)  # a kill after the publish rename left them
        kept = orphans_of(absolute)
        raise TargetExistsError(
            f"target {absolute} already exists; mergeflow never overwrites, choose a new --target_dir"
            + (f"; removed what an interrupted publish left beside it: {', '.join(removed)}" if removed else "")
            + (f"; staging dir(s) of this target that nothing will resume: {', '.join(map(str, kept))} "
               "(`mergeflow staging clean` removes them)" if kept else ""))
    if not absolute.parent.is_dir():
        raise UsageError(f"the parent of --target_dir ({absolute.parent}) does not exist; create it first")
    return absolute


def describe_staging(staging: Path, *, now: float | None = None) -> StagingInfo:
    """Size, age (since the last write), resumable shards and lock state of one staging dir."""
    size, newest = _tree_size_and_mtime(staging)
    target = target_of(staging)
    return StagingInfo(
        path=str(staging),
        target=str(target),
        size_bytes=size,
        age_seconds=max(0.0, (time.time() if now is None else now) - newest),
        resumable_shards=count_resumable_shards(staging),
        has_manifest=any((staging / "artifact").rglob("merge_manifest.json")),
        locked=lock_is_held(lock_path_for(target)),
        orphaned=orphan_reason(staging),
    )


def list_staging(root: Path, *, depth: int = DEFAULT_SCAN_DEPTH) -> list[StagingInfo]:
    """Describe every kept staging directory under root."""
    return [describe_staging(p) for p in find_staging(root, depth=depth)]


def settle_failed_staging(error: MergeflowError, staging: Path) -> MergeflowError:
    """After a failed export (the target lock still held): keep the staging for a resume, or remove it.

    Kept, and named in the error, only when rerunning the same command can use it (disk full,
    an interruption, a failed validation); a refusal of the input leaves nothing behind.
    """
    if not staging.exists():
        return error
    if not error.resumable:
        try:
            shutil.rmtree(staging)
            return error
        except OSError:
            pass  # could not remove it: say where it is rather than leave it unnamed
    return error.kept_in(str(staging))


def remove_staging(staging: Path) -> None:
    """Remove one staging directory while holding its target's lock; refuses a running export."""
    if not is_staging_dir(staging):
        raise UsageError(f"{staging} is not a mergeflow staging directory")
    # Holding the lock while deleting keeps an export of the same target from starting
    # (and resuming into this directory) half-way through the removal.
    with TargetLock(lock_path_for(target_of(staging))):
        shutil.rmtree(staging)


def clean_staging(root: Path, *, older_than: float = 0.0, depth: int = DEFAULT_SCAN_DEPTH) -> dict[str, list[str]]:
    """Remove kept staging dirs under root idle for more than `older_than` seconds.

    Directories of a running export are left alone and reported under "refused".
    """
    removed: list[str] = []
    refused: list[str] = []
    kept: list[str] = []
    for staging in find_staging(root, depth=depth):
        if describe_staging(staging).age_seconds < older_than:
            kept.append(str(staging))
            continue
        try:
            remove_staging(staging)
        except ConcurrentExportError:
            refused.append(str(staging))
            continue
        removed.append(str(staging))
    return {"removed": removed, "refused": refused, "kept": kept}


STAGING_ID_FILE = "staging-id"


def staging_id(staging: Path) -> str:
    """A random id of this staging directory, created on first use (`work/staging-id`).

    Cache keys of staged work include it: a staging directory that was removed (say by
    `mergeflow staging clean`) and is created again gets a new id, so Prefect never
    answers a rerun with records of files that no longer exist.
    """
    work = Path(staging) / "work"
    path = work / STAGING_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / f".{STAGING_ID_FILE}.{os.getpid()}.{uuid.uuid4().hex}"
    tmp.write_text(uuid.uuid4().hex)
    try:
        os.link(tmp, path)  # atomic and never replaces: concurrent first users agree on one id
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def file_stamp(path: Path) -> list[int] | None:
    """[size, mtime_ns, inode] of a file, None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def staged_file_state(final: Path, record: Path) -> str:
    """'intact' while a staged file is absent with no record, or unchanged since its record was written.

    Anything else (a file changed, deleted or written without a record) names what is there,
    so a cache key built from it misses and the task redoes (or re-verifies) the file.
    """
    current = file_stamp(final)
    try:
        recorded = json.loads(record.read_text()).get("stamp")
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError, AttributeError):
        recorded = "unreadable"
    if current == recorded:
        return "intact"
    return f"changed:{current}:{recorded}"


def remove_partial_writes(staging: Path) -> list[str]:
    """Remove the temporary files killed writers left in a staging tree; their names, relative.

    Run under the target lock before a resume: no writer is alive then, and every durable write
    renames its temporary file into place, so a file with a temporary name is a crash's leftover.
    """
    removed: list[str] = []
    if not staging.is_dir() or staging.is_symlink():
        return removed
    for folder, dirs, files in os.walk(staging, followlinks=False):
        for name in files:
            if is_partial_write(name):
                path = Path(folder) / name
                path.unlink(missing_ok=True)
                removed.append(path.relative_to(staging).as_posix())
    return sorted(removed)
